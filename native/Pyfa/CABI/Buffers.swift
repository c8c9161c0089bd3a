import CPyfa

@_cdecl("pyfa_buffer_new")
public func pyfa_buffer_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?, _ dtype: Int32,
                                 _ ndim: UInt32, _ shape: UnsafePointer<Int64>?, _ storage: Int32) -> Int32 {
    abiCall {
        guard let out else { throw PyfaError.invalid("out: out-pointer is NULL") }
        out.pointee = nil
        let d: Device = try object(device, "device")
        guard let mode = Storage(rawValue: storage) else {
            throw PyfaError.invalid("storage: unknown storage mode \(storage) (expected 0 = shared, 1 = private)")
        }
        let buffer = try d.makeBuffer(dtype: try DType(code: dtype), shape: try shapeArray(ndim, shape), storage: mode)
        out.pointee = retainHandle(buffer)
    }
}

@_cdecl("pyfa_buffer_wrap")
public func pyfa_buffer_wrap_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                  _ data: UnsafeMutableRawPointer?, _ nbytes: UInt64, _ dtype: Int32, _ ndim: UInt32,
                                  _ shape: UnsafePointer<Int64>?) -> Int32 {
    abiCall {
        guard let out else { throw PyfaError.invalid("out: out-pointer is NULL") }
        out.pointee = nil
        let d: Device = try object(device, "device")
        try require(nbytes <= UInt64(Int.max), "nbytes: too large")
        let buffer = try d.wrapBuffer(address: UInt64(UInt(bitPattern: data)), nbytes: Int(nbytes),
                                      dtype: try DType(code: dtype), shape: try shapeArray(ndim, shape))
        out.pointee = retainHandle(buffer)
    }
}

@_cdecl("pyfa_buffer_free")
public func pyfa_buffer_free_impl(_ buffer: OpaquePointer?) {
    releaseHandle(buffer, as: Buffer.self)
}

@_cdecl("pyfa_buffer_contents")
public func pyfa_buffer_contents_impl(_ buffer: OpaquePointer?) -> UnsafeMutableRawPointer? {
    let b: Buffer? = try? object(buffer, "buffer")
    guard let b, b.storage == .shared else { return nil }
    return b.contents
}

@_cdecl("pyfa_buffer_nbytes")
public func pyfa_buffer_nbytes_impl(_ buffer: OpaquePointer?) -> UInt64 {
    let b: Buffer? = try? object(buffer, "buffer")
    return UInt64(b?.nbytes ?? 0)
}

@_cdecl("pyfa_buffer_address")
public func pyfa_buffer_address_impl(_ buffer: OpaquePointer?) -> UInt64 {
    let b: Buffer? = try? object(buffer, "buffer")
    return b?.deviceAddress ?? 0
}

@_cdecl("pyfa_buffer_dtype")
public func pyfa_buffer_dtype_impl(_ buffer: OpaquePointer?) -> Int32 {
    let b: Buffer? = try? object(buffer, "buffer")
    return b?.dtype.rawValue ?? -1
}

@_cdecl("pyfa_buffer_write")
public func pyfa_buffer_write_impl(_ buffer: OpaquePointer?, _ offset: UInt64, _ src: UnsafeRawPointer?,
                                   _ nbytes: UInt64) -> Int32 {
    abiCall {
        let b: Buffer = try object(buffer, "buffer")
        guard let src else { if nbytes == 0 { return }; throw PyfaError.invalid("src: NULL pointer") }
        try require(offset <= UInt64(Int.max) && nbytes <= UInt64(Int.max), "offset/nbytes: too large")
        try b.write(offset: Int(offset), from: src, count: Int(nbytes))
    }
}

@_cdecl("pyfa_buffer_read")
public func pyfa_buffer_read_impl(_ buffer: OpaquePointer?, _ offset: UInt64, _ dst: UnsafeMutableRawPointer?,
                                  _ nbytes: UInt64) -> Int32 {
    abiCall {
        let b: Buffer = try object(buffer, "buffer")
        guard let dst else { if nbytes == 0 { return }; throw PyfaError.invalid("dst: NULL pointer") }
        try require(offset <= UInt64(Int.max) && nbytes <= UInt64(Int.max), "offset/nbytes: too large")
        try b.read(offset: Int(offset), into: dst, count: Int(nbytes))
    }
}
