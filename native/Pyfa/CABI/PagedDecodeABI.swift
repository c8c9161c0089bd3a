import CPyfa
import PyfaShaderCommon

// The paged decode plans' C entry points (pyfa.h, "paged decode").

/// pyfa_seq_values of `count` values (kv_len: batch; block_table: batch * pages_per_seq).
private func values(_ s: pyfa_seq_values, count: Int) -> SequenceRef {
    guard let host = s.host else { return .device(TensorRef(s.device)) }
    return .host(Array(UnsafeBufferPointer(start: host, count: count)))
}

private func newPagedPlan<Desc>(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                _ desc: UnsafePointer<Desc>?, _ make: (Device, Desc) throws -> OpPlan) -> Int32 {
    abiCall {
        guard let out else { throw PyfaError.invalid("out: out-pointer is NULL") }
        out.pointee = nil
        let d: Device = try object(device, "device")
        out.pointee = retainHandle(try make(d, try value(desc, "desc")))
    }
}

private func runPaged<P: OpPlan, Args>(_ plan: OpaquePointer?, _ encoder: OpaquePointer?, _ args: UnsafePointer<Args>?,
                                       flags: KeyPath<Args, UInt32>, reserved: KeyPath<Args, UInt32>,
                                       _ body: (P, CommandEncoder, Args) throws -> Void) -> Int32 {
    abiCall {
        let p: P = try object(plan, "plan")
        let e: CommandEncoder = try object(encoder, "encoder")
        let a = try value(args, "args")
        let f = a[keyPath: flags]
        try require(f & ~UInt32(PYFA_RUN_FINISH) == 0, "flags: unknown bits 0x\(String(f, radix: 16))")
        try require(a[keyPath: reserved] == 0, "reserved: must be 0")
        try body(p, e, a)
        if f & UInt32(PYFA_RUN_FINISH) != 0 { try e.finish() }
    }
}

@_cdecl("pyfa_paged_decode_plan_new")
public func pyfa_paged_decode_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                            _ desc: UnsafePointer<pyfa_paged_decode_plan_desc>?) -> Int32 {
    newPagedPlan(out, device, desc) { try PagedDecodePlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_paged_tq_decode_plan_new")
public func pyfa_paged_tq_decode_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                               _ desc: UnsafePointer<pyfa_paged_tq_decode_plan_desc>?) -> Int32 {
    newPagedPlan(out, device, desc) { try PagedTQDecodePlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_paged_decode_run")
public func pyfa_paged_decode_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                       _ args: UnsafePointer<pyfa_paged_decode_run_args>?) -> Int32 {
    runPaged(plan, encoder, args, flags: \.flags, reserved: \.reserved) { (p: PagedDecodePlan, e, a) in
        let B = Int(p.params.batch)
        try p.run(e, q: TensorRef(a.q), kPages: TensorRef(a.k_pages), vPages: TensorRef(a.v_pages),
                  out: TensorRef(a.out), lse: TensorRef(a.lse), workspace: TensorRef(a.workspace),
                  kvLen: values(a.kv_len, count: B),
                  blockTable: values(a.block_table, count: Paged.tableCount(batch: p.params.batch, p.pages)))
    }
}

@_cdecl("pyfa_paged_tq_decode_run")
public func pyfa_paged_tq_decode_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                          _ args: UnsafePointer<pyfa_paged_tq_decode_run_args>?) -> Int32 {
    runPaged(plan, encoder, args, flags: \.flags, reserved: \.reserved) { (p: PagedTQDecodePlan, e, a) in
        let B = Int(p.params.attn.batch)
        try p.run(e, q: TensorRef(a.q), kCodes: TensorRef(a.k_codes), kScales: TensorRef(a.k_scales),
                  vCodes: TensorRef(a.v_codes), vScales: TensorRef(a.v_scales), out: TensorRef(a.out),
                  lse: TensorRef(a.lse), workspace: TensorRef(a.workspace), kvLen: values(a.kv_len, count: B),
                  blockTable: values(a.block_table, count: Paged.tableCount(batch: p.params.attn.batch, p.pages)))
    }
}
