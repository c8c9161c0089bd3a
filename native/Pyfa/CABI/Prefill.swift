import CPyfa
import PyfaShaderCommon

@_cdecl("pyfa_flash_attn_prefill_plan")
public func pyfa_flash_attn_prefill_plan_impl(_ device: OpaquePointer?,
                                              _ params: UnsafeMutablePointer<pyfa_flash_attn_prefill_params>?,
                                              _ dtype: Int32, _ blkBytes: UnsafeMutablePointer<UInt64>?) -> Int32 {
    abiCall {
        let d: Device = try object(device, "device")
        guard let params else { throw PyfaError.invalid("params: NULL") }
        var p = params.pointee
        let (_, bytes) = try FlashAttnPrefill.plan(d, &p, dtype: try DType(code: dtype))
        params.pointee = p
        try writeOut(blkBytes, UInt64(bytes), "blk_bytes")
    }
}

@_cdecl("pyfa_flash_attn_prefill_blk")
public func pyfa_flash_attn_prefill_blk_impl(_ encoder: OpaquePointer?,
                                             _ params: UnsafePointer<pyfa_flash_attn_prefill_params>?,
                                             _ dtype: Int32, _ mask: OpaquePointer?, _ blk: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try FlashAttnPrefill.encodeBlk(e, try value(params, "params"), dtype: try DType(code: dtype),
                                       mask: optionalObject(mask, "mask"), blk: optionalObject(blk, "blk"))
    }
}

@_cdecl("pyfa_flash_attn_prefill")
public func pyfa_flash_attn_prefill_impl(_ encoder: OpaquePointer?,
                                         _ params: UnsafePointer<pyfa_flash_attn_prefill_params>?,
                                         _ q: OpaquePointer?, _ k: OpaquePointer?, _ v: OpaquePointer?,
                                         _ mask: OpaquePointer?, _ blk: OpaquePointer?, _ out: OpaquePointer?,
                                         _ lse: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try FlashAttnPrefill.encode(e, try value(params, "params"), q: optionalObject(q, "q"), k: optionalObject(k, "k"), v: optionalObject(v, "v"),
                                    mask: optionalObject(mask, "mask"), blk: optionalObject(blk, "blk"), out: optionalObject(out, "out"),
                                    lse: optionalObject(lse, "lse"))
    }
}

@_cdecl("pyfa_merge_attention_states")
public func pyfa_merge_attention_states_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_merge_attn_params>?,
                                             _ oA: OpaquePointer?, _ lseA: OpaquePointer?, _ oB: OpaquePointer?,
                                             _ lseB: OpaquePointer?, _ out: OpaquePointer?, _ lseOut: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try MergeAttentionStates.encode(e, try value(params, "params"), oA: optionalObject(oA, "o_a"), lseA: optionalObject(lseA, "lse_a"),
                                        oB: optionalObject(oB, "o_b"), lseB: optionalObject(lseB, "lse_b"), out: optionalObject(out, "out"),
                                        lseOut: optionalObject(lseOut, "lse_out"))
    }
}
