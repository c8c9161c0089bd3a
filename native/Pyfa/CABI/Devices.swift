import CPyfa

@_cdecl("pyfa_device_new")
public func pyfa_device_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ backend: UnsafePointer<CChar>?) -> Int32 {
    abiCall {
        guard let out else { throw PyfaError.invalid("out: out-pointer is NULL") }
        out.pointee = nil
        let device = try Device.open(try string(backend, "backend"))
        out.pointee = retainHandle(device)
    }
}

@_cdecl("pyfa_device_free")
public func pyfa_device_free_impl(_ device: OpaquePointer?) {
    releaseHandle(device, as: Device.self)
}

@_cdecl("pyfa_device_info_get")
public func pyfa_device_info_get_impl(_ device: OpaquePointer?, _ out: UnsafeMutablePointer<pyfa_device_info>?) -> Int32 {
    abiCall {
        let d: Device = try object(device, "device")
        try writeOut(out, d.backend.info, "out")
    }
}
