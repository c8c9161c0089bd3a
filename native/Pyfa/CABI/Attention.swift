import CPyfa
import PyfaShaderCommon

@_cdecl("pyfa_flash_attn_vec_plan")
public func pyfa_flash_attn_vec_plan_impl(_ device: OpaquePointer?, _ params: UnsafeMutablePointer<pyfa_flash_attn_vec_params>?,
                                          _ kvDType: Int32, _ maxKvLen: UInt32,
                                          _ tmpBytes: UnsafeMutablePointer<UInt64>?) -> Int32 {
    abiCall {
        let d: Device = try object(device, "device")
        guard let params else { throw PyfaError.invalid("params: NULL") }
        var p = params.pointee
        let (_, bytes) = try FlashAttnVec.plan(d, &p, kvDType: try DType(code: kvDType), maxKvLen: maxKvLen)
        params.pointee = p
        try writeOut(tmpBytes, UInt64(bytes), "tmp_bytes")
    }
}

@_cdecl("pyfa_flash_attn_vec")
public func pyfa_flash_attn_vec_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_flash_attn_vec_params>?,
                                     _ q: OpaquePointer?, _ k: OpaquePointer?, _ v: OpaquePointer?,
                                     _ kvLen: OpaquePointer?, _ ringStart: OpaquePointer?, _ tmp: OpaquePointer?,
                                     _ out: OpaquePointer?, _ lse: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try FlashAttnVec.encode(e, try value(params, "params"), q: optionalObject(q, "q"), k: optionalObject(k, "k"), v: optionalObject(v, "v"),
                                kvLen: sequenceValues(kvLen, "kv_len"), ringStart: sequenceValues(ringStart, "ring_start"),
                                tmp: optionalObject(tmp, "tmp"), out: optionalObject(out, "out"),
                                lse: optionalObject(lse, "lse"))
    }
}
