import CPyfa

@_cdecl("pyfa_encoder_new")
public func pyfa_encoder_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?) -> Int32 {
    abiCall {
        guard let out else { throw PyfaError.invalid("out: out-pointer is NULL") }
        out.pointee = nil
        let d: Device = try object(device, "device")
        out.pointee = retainHandle(try d.makeEncoder())
    }
}

@_cdecl("pyfa_encoder_free")
public func pyfa_encoder_free_impl(_ encoder: OpaquePointer?) {
    releaseHandle(encoder, as: CommandEncoder.self)
}

@_cdecl("pyfa_encoder_commit")
public func pyfa_encoder_commit_impl(_ encoder: OpaquePointer?) -> Int32 {
    abiCall { try (object(encoder, "encoder") as CommandEncoder).commit() }
}

@_cdecl("pyfa_encoder_reset")
public func pyfa_encoder_reset_impl(_ encoder: OpaquePointer?) -> Int32 {
    abiCall { (try object(encoder, "encoder") as CommandEncoder).reset() }
}

@_cdecl("pyfa_encoder_device_seconds")
public func pyfa_encoder_device_seconds_impl(_ encoder: OpaquePointer?, _ seconds: UnsafeMutablePointer<Double>?) -> Int32 {
    abiCall {
        guard let seconds else { throw PyfaError.invalid("seconds: out-pointer is NULL") }
        let e: CommandEncoder = try object(encoder, "encoder")
        guard let s = e.lastDeviceSeconds else {
            throw PyfaError.unsupported("device_seconds: backend '\(e.device.backend.name)' has no device clock")
        }
        seconds.pointee = s
    }
}

@_cdecl("pyfa_encoder_wait")
public func pyfa_encoder_wait_impl(_ encoder: OpaquePointer?) -> Int32 {
    abiCall { try (object(encoder, "encoder") as CommandEncoder).wait() }
}
