import CPyfa
import PyfaShaderCommon

@_cdecl("pyfa_kv_append_paged")
public func pyfa_kv_append_paged_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_kv_append_paged_params>?,
                                      _ srcK: OpaquePointer?, _ srcV: OpaquePointer?, _ kPages: OpaquePointer?,
                                      _ vPages: OpaquePointer?, _ slotMapping: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try PagedAppend.encodeDense(e, try value(params, "params"), srcK: optionalObject(srcK, "src_k"),
                                    srcV: optionalObject(srcV, "src_v"), kPages: optionalObject(kPages, "k_pages"),
                                    vPages: optionalObject(vPages, "v_pages"),
                                    slotMapping: optionalObject(slotMapping, "slot_mapping").map { SequenceValues.buffer($0) })
    }
}

@_cdecl("pyfa_tq_quantize_paged")
public func pyfa_tq_quantize_paged_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_tq_quantize_paged_params>?,
                                        _ srcK: OpaquePointer?, _ srcV: OpaquePointer?, _ kCodes: OpaquePointer?,
                                        _ kScales: OpaquePointer?, _ vCodes: OpaquePointer?, _ vScales: OpaquePointer?,
                                        _ slotMapping: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try PagedAppend.encodeTurboQuant(e, try value(params, "params"), srcK: optionalObject(srcK, "src_k"),
                                         srcV: optionalObject(srcV, "src_v"), kCodes: optionalObject(kCodes, "k_codes"),
                                         kScales: optionalObject(kScales, "k_scales"),
                                         vCodes: optionalObject(vCodes, "v_codes"),
                                         vScales: optionalObject(vScales, "v_scales"),
                                         slotMapping: optionalObject(slotMapping, "slot_mapping").map { SequenceValues.buffer($0) })
    }
}

@_cdecl("pyfa_paged_append_plan_new")
public func pyfa_paged_append_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                            _ desc: UnsafePointer<pyfa_paged_append_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try PagedAppendPlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_paged_append_run")
public func pyfa_paged_append_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                       _ args: UnsafePointer<pyfa_paged_append_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: PagedAppendPlan, e, a) in
        try p.run(e, k: TensorRef(a.k), v: TensorRef(a.v), kPages: TensorRef(a.k_pages), vPages: TensorRef(a.v_pages),
                  kScales: TensorRef(a.k_scales), vScales: TensorRef(a.v_scales),
                  slotMapping: sequenceRef(a.slot_mapping, count: Int(a.num_tokens)), numTokens: a.num_tokens)
    }
}
