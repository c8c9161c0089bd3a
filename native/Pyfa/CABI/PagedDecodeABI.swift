import CPyfa
import PyfaShaderCommon

// The paged decode plans' C entry points (pyfa.h, "paged decode").

@_cdecl("pyfa_paged_decode_plan_new")
public func pyfa_paged_decode_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                            _ desc: UnsafePointer<pyfa_paged_decode_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try PagedDecodePlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_paged_tq_decode_plan_new")
public func pyfa_paged_tq_decode_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                               _ desc: UnsafePointer<pyfa_paged_tq_decode_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try PagedTQDecodePlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_paged_decode_run")
public func pyfa_paged_decode_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                       _ args: UnsafePointer<pyfa_paged_decode_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: PagedDecodePlan, e, a) in
        try require(a.reserved == 0, "reserved: must be 0")
        let B = Int(p.params.batch)
        try p.run(e, q: TensorRef(a.q), kPages: TensorRef(a.k_pages), vPages: TensorRef(a.v_pages),
                  out: TensorRef(a.out), lse: TensorRef(a.lse), workspace: TensorRef(a.workspace),
                  kvLen: sequenceRef(a.kv_len, count: B),
                  blockTable: sequenceRef(a.block_table, count: Paged.tableCount(batch: p.params.batch, p.pages)))
    }
}

@_cdecl("pyfa_paged_tq_decode_run")
public func pyfa_paged_tq_decode_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                          _ args: UnsafePointer<pyfa_paged_tq_decode_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: PagedTQDecodePlan, e, a) in
        try require(a.reserved == 0, "reserved: must be 0")
        let B = Int(p.params.attn.batch)
        try p.run(e, q: TensorRef(a.q), kCodes: TensorRef(a.k_codes), kScales: TensorRef(a.k_scales),
                  vCodes: TensorRef(a.v_codes), vScales: TensorRef(a.v_scales), out: TensorRef(a.out),
                  lse: TensorRef(a.lse), workspace: TensorRef(a.workspace), kvLen: sequenceRef(a.kv_len, count: B),
                  blockTable: sequenceRef(a.block_table, count: Paged.tableCount(batch: p.params.attn.batch, p.pages)))
    }
}
