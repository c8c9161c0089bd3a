import CPyfa
import PyfaShaderCommon

@_cdecl("pyfa_flash_attn_prefill_varlen")
public func pyfa_flash_attn_prefill_varlen_impl(_ encoder: OpaquePointer?,
                                                _ params: UnsafePointer<pyfa_flash_attn_prefill_params>?,
                                                _ packed: UnsafePointer<pyfa_prefill_packed>?,
                                                _ q: OpaquePointer?, _ k: OpaquePointer?, _ v: OpaquePointer?,
                                                _ cuSeqlensQ: OpaquePointer?, _ cuSeqlensK: OpaquePointer?,
                                                _ out: OpaquePointer?, _ lse: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try FlashAttnPrefillPacked.encode(
            e, try value(params, "params"), mode: PYFA_PREFILL_KV_VARLEN, packed: try value(packed, "packed"),
            pages: pyfa_kv_pages(), q: optionalObject(q, "q"), k: optionalObject(k, "k"), v: optionalObject(v, "v"),
            cuSeqlensQ: optionalObject(cuSeqlensQ, "cu_seqlens_q"), seqK: optionalObject(cuSeqlensK, "cu_seqlens_k"),
            blockTable: nil, out: optionalObject(out, "out"), lse: optionalObject(lse, "lse"))
    }
}

@_cdecl("pyfa_flash_attn_prefill_paged")
public func pyfa_flash_attn_prefill_paged_impl(_ encoder: OpaquePointer?,
                                               _ params: UnsafePointer<pyfa_flash_attn_prefill_params>?,
                                               _ packed: UnsafePointer<pyfa_prefill_packed>?,
                                               _ pages: UnsafePointer<pyfa_kv_pages>?,
                                               _ q: OpaquePointer?, _ kPages: OpaquePointer?, _ vPages: OpaquePointer?,
                                               _ cuSeqlensQ: OpaquePointer?, _ kvLen: OpaquePointer?,
                                               _ blockTable: OpaquePointer?, _ out: OpaquePointer?,
                                               _ lse: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try FlashAttnPrefillPacked.encode(
            e, try value(params, "params"), mode: PYFA_PREFILL_KV_PAGED, packed: try value(packed, "packed"),
            pages: try value(pages, "pages"), q: optionalObject(q, "q"), k: optionalObject(kPages, "k_pages"),
            v: optionalObject(vPages, "v_pages"), cuSeqlensQ: optionalObject(cuSeqlensQ, "cu_seqlens_q"),
            seqK: optionalObject(kvLen, "kv_len"), blockTable: optionalObject(blockTable, "block_table"),
            out: optionalObject(out, "out"), lse: optionalObject(lse, "lse"))
    }
}
