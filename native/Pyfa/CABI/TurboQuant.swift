import CPyfa
import PyfaShaderCommon

// pyfa_turboquant_codebook is implemented in C (native/CPyfa/turboquant_codebook.c).

@_cdecl("pyfa_hadamard_quantize_kv")
public func pyfa_hadamard_quantize_kv_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_tq_quantize_params>?,
                                           _ src: OpaquePointer?, _ codes: OpaquePointer?,
                                           _ scales: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try TurboQuant.encodeQuantize(e, try value(params, "params"), src: optionalObject(src, "src"), codes: optionalObject(codes, "codes"),
                                      scales: optionalObject(scales, "scales"))
    }
}

@_cdecl("pyfa_tq_dequantize_kv")
public func pyfa_tq_dequantize_kv_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_tq_dequantize_params>?,
                                       _ codes: OpaquePointer?, _ scales: OpaquePointer?,
                                       _ out: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try TurboQuant.encodeDequantize(e, try value(params, "params"), codes: optionalObject(codes, "codes"), scales: optionalObject(scales, "scales"),
                                        out: optionalObject(out, "out"))
    }
}

@_cdecl("pyfa_fwht")
public func pyfa_fwht_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_tq_fwht_params>?,
                           _ src: OpaquePointer?, _ dst: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try TurboQuant.encodeFwht(e, try value(params, "params"), src: optionalObject(src, "src"), dst: optionalObject(dst, "dst"))
    }
}

@_cdecl("pyfa_flash_attn_vec_tq_plan")
public func pyfa_flash_attn_vec_tq_plan_impl(_ device: OpaquePointer?,
                                             _ params: UnsafeMutablePointer<pyfa_flash_attn_vec_tq_params>?,
                                             _ maxKvLen: UInt32, _ tmpBytes: UnsafeMutablePointer<UInt64>?) -> Int32 {
    abiCall {
        let d: Device = try object(device, "device")
        guard let params else { throw PyfaError.invalid("params: NULL") }
        var p = params.pointee
        let (_, layout) = try FlashAttnVecTQ.plan(d, &p, maxKvLen: maxKvLen)
        params.pointee = p
        try writeOut(tmpBytes, UInt64(layout.total), "tmp_bytes")
    }
}

@_cdecl("pyfa_flash_attn_vec_tq")
public func pyfa_flash_attn_vec_tq_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_flash_attn_vec_tq_params>?,
                                        _ q: OpaquePointer?, _ kCodes: OpaquePointer?, _ kScales: OpaquePointer?,
                                        _ vCodes: OpaquePointer?, _ vScales: OpaquePointer?, _ kvLen: OpaquePointer?,
                                        _ ringStart: OpaquePointer?, _ tmp: OpaquePointer?,
                                        _ out: OpaquePointer?, _ lse: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try FlashAttnVecTQ.encode(e, try value(params, "params"), q: optionalObject(q, "q"), kCodes: optionalObject(kCodes, "k_codes"),
                                  kScales: optionalObject(kScales, "k_scales"), vCodes: optionalObject(vCodes, "v_codes"),
                                  vScales: optionalObject(vScales, "v_scales"), kvLen: sequenceValues(kvLen, "kv_len"),
                                  ringStart: sequenceValues(ringStart, "ring_start"), tmp: optionalObject(tmp, "tmp"),
                                  out: optionalObject(out, "out"), lse: optionalObject(lse, "lse"))
    }
}
