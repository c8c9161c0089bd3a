import CPyfa
import PyfaShaderCommon

extension TensorRef {
    init(_ t: pyfa_tensor) { self.init(address: t.address, nbytes: t.nbytes) }
}

/// pyfa_seq_values as a run takes them: host values are read here, once.
/// `count`: the values the op reads (a batch's kv_len, a block table's
/// batch * pages_per_seq entries, an append's slots).
func sequenceRef(_ s: pyfa_seq_values, count: Int) -> SequenceRef {
    guard let host = s.host else { return .device(TensorRef(s.device)) }
    return .host(Array(UnsafeBufferPointer(start: host, count: count)))
}

/// The body of every pyfa_*_plan_new: a plan made from `desc` on `device`, or NULL and the error.
func newPlan<Desc>(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                           _ desc: UnsafePointer<Desc>?, _ make: (Device, Desc) throws -> OpPlan) -> Int32 {
    abiCall {
        guard let out else { throw PyfaError.invalid("out: out-pointer is NULL") }
        out.pointee = nil
        let d: Device = try object(device, "device")
        out.pointee = retainHandle(try make(d, try value(desc, "desc")))
    }
}

@_cdecl("pyfa_decode_plan_new")
public func pyfa_decode_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                      _ desc: UnsafePointer<pyfa_decode_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try DecodePlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_tq_decode_plan_new")
public func pyfa_tq_decode_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                         _ desc: UnsafePointer<pyfa_tq_decode_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try TQDecodePlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_prefill_plan_new")
public func pyfa_prefill_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                       _ desc: UnsafePointer<pyfa_prefill_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { d, description in
        try require(description.reserved == 0, "reserved: must be 0")
        return try PrefillPlan(device: d, desc: description)
    }
}

@_cdecl("pyfa_prefill_run")
public func pyfa_prefill_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                  _ args: UnsafePointer<pyfa_prefill_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: PrefillPlan, e, a) in
        try p.run(e, q: TensorRef(a.q), k: TensorRef(a.k), v: TensorRef(a.v), mask: TensorRef(a.mask),
                  out: TensorRef(a.out), lse: TensorRef(a.lse), workspace: TensorRef(a.workspace))
    }
}

/// The body of every pyfa_*_run: the plan, encoder and arguments checked, the
/// flags checked before anything is recorded, the run, then PYFA_RUN_FINISH.
func runPlan<P: OpPlan, Args>(_ plan: OpaquePointer?, _ encoder: OpaquePointer?, _ args: UnsafePointer<Args>?,
                                      flags: (Args) -> UInt32,
                                      _ body: (P, CommandEncoder, Args) throws -> Void) -> Int32 {
    abiCall {
        let p: P = try object(plan, "plan")
        let e: CommandEncoder = try object(encoder, "encoder")
        let a = try value(args, "args")
        let f = flags(a)  // a function, not a KeyPath: a key path's projection is a runtime call
        try require(f & ~UInt32(PYFA_RUN_FINISH) == 0, "flags: unknown bits 0x\(String(f, radix: 16))")
        try body(p, e, a)
        if f & UInt32(PYFA_RUN_FINISH) != 0 { try e.finish() }
    }
}

@_cdecl("pyfa_plan_free")
public func pyfa_plan_free_impl(_ plan: OpaquePointer?) {
    releaseHandle(plan, as: OpPlan.self)
}

@_cdecl("pyfa_plan_workspace_bytes")
public func pyfa_plan_workspace_bytes_impl(_ plan: OpaquePointer?, _ bytes: UnsafeMutablePointer<UInt64>?) -> Int32 {
    abiCall {
        let p: OpPlan = try object(plan, "plan")
        try writeOut(bytes, UInt64(p.workspaceBytes), "bytes")
    }
}

@_cdecl("pyfa_decode_run")
public func pyfa_decode_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                 _ args: UnsafePointer<pyfa_decode_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: DecodePlan, e, a) in
        let B = Int(p.params.batch)
        try p.run(e, q: TensorRef(a.q), k: TensorRef(a.k_cache), v: TensorRef(a.v_cache), out: TensorRef(a.out),
                  lse: TensorRef(a.lse), workspace: TensorRef(a.workspace), kvLen: sequenceRef(a.kv_len, count: B),
                  ringStart: sequenceRef(a.ring_start, count: B), kvCapacity: a.kv_capacity)
    }
}

@_cdecl("pyfa_tq_decode_run")
public func pyfa_tq_decode_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                    _ args: UnsafePointer<pyfa_tq_decode_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: TQDecodePlan, e, a) in
        let B = Int(p.params.attn.batch)
        try p.run(e, q: TensorRef(a.q), kCodes: TensorRef(a.k_codes), kScales: TensorRef(a.k_scales),
                  vCodes: TensorRef(a.v_codes), vScales: TensorRef(a.v_scales), out: TensorRef(a.out),
                  lse: TensorRef(a.lse), workspace: TensorRef(a.workspace), kvLen: sequenceRef(a.kv_len, count: B),
                  ringStart: sequenceRef(a.ring_start, count: B), kvCapacity: a.kv_capacity)
    }
}

@_cdecl("pyfa_encoder_finish")
public func pyfa_encoder_finish_impl(_ encoder: OpaquePointer?) -> Int32 {
    abiCall { try (object(encoder, "encoder") as CommandEncoder).finish() }
}


// ---- packed prefill (varlen / paged) plans ----

@_cdecl("pyfa_varlen_prefill_plan_new")
public func pyfa_varlen_prefill_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                              _ desc: UnsafePointer<pyfa_varlen_prefill_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try PackedPrefillPlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_varlen_prefill_run")
public func pyfa_varlen_prefill_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                         _ args: UnsafePointer<pyfa_varlen_prefill_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: PackedPrefillPlan, e, a) in
        try require(a.reserved == 0, "reserved: must be 0")
        try p.run(e, args: a)
    }
}
