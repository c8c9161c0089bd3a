import CPyfa
import PyfaShaderCommon

/// A decode (`decodeAttention`'s op) prepared once for its shapes, dtypes and
/// options, then run many times on the caller's buffers: the serving loop's
/// form. The plan checks every option and shape rule when it is made, picks
/// the split and kernels, and owns the workspace; a run checks its buffers
/// against the plan, writes `out` (and `lse`) in place and allocates nothing.
/// Runs are synchronous and serialised per device (so the plan's one
/// workspace is never shared by two runs at once).
public final class DecodePlan {
    let handle: OpaquePointer
    /// The device the plan runs on; its buffers must belong to it.
    public let device: Device
    /// Sequences per run (B).
    public let batch: Int
    /// Query heads (H).
    public let heads: Int
    /// KV heads (H_kv; H is a multiple of it).
    public let kvHeads: Int
    /// Values per row (D).
    public let headDim: Int
    /// Slots per (sequence, KV head) of the caches.
    public let capacity: Int
    /// dtype of q.
    public let qDType: DType
    /// dtype of k and v.
    public let kvDType: DType
    /// dtype of out.
    public let outDType: DType
    /// Whether runs write the f32 LSE (and so need an `lse` buffer).
    public let returnLSE: Bool

    /// A plan for q [B, H, D], caches [B, H_kv, capacity, D] and out
    /// [B, H, D] (for batch 1 also [H, D] and [H_kv, capacity, D]).
    /// `scale`, `window`, `softcap`, `outDType` (nil: qDType) and
    /// `returnLSE` are `DecodeOptions`'s. `maxKvLen` (nil: capacity) sizes the
    /// split for the longest kv_len the runs will pass; longer ones still
    /// run, with a split sized for less. Throws `PyfaError` naming the
    /// argument that breaks a rule (head dim, heads, dtypes, options).
    public init(_ device: Device, batch: Int = 1, heads: Int, kvHeads: Int, headDim: Int, capacity: Int,
                qDType: DType, kvDType: DType, scale: Float? = nil, window: Int? = nil, softcap: Float = 0,
                outDType: DType? = nil, returnLSE: Bool = false, maxKvLen: Int? = nil) throws {
        let outDType = outDType ?? qDType
        var desc = pyfa_decode_plan_desc()
        desc.attn = pyfa_flash_attn_vec_params(
            batch: try Arg.u32(batch, "batch"), num_heads: try Arg.u32(heads, "heads"),
            num_kv_heads: try Arg.u32(kvHeads, "kvHeads"), head_dim: try Arg.u32(headDim, "headDim"),
            kv_capacity: try Arg.u32(capacity, "capacity"), nwg: 0, window: try Arg.window(window),
            scale: Arg.scale(scale, headDim: headDim), softcap: softcap, reserved: 0)
        desc.q_dtype = qDType.rawValue
        desc.kv_dtype = kvDType.rawValue
        desc.out_dtype = outDType.rawValue
        desc.max_kv_len = try Arg.u32(min(maxKvLen ?? capacity, capacity), "maxKvLen")
        desc.return_lse = returnLSE ? 1 : 0
        var h: OpaquePointer?
        try check(pyfa_decode_plan_new(&h, device.handle, &desc))
        guard let h else { throw PyfaError(.internal, "pyfa_decode_plan_new: returned no plan") }
        handle = h
        self.device = device
        self.batch = batch
        self.heads = heads
        self.kvHeads = kvHeads
        self.headDim = headDim
        self.capacity = capacity
        self.qDType = qDType
        self.kvDType = kvDType
        self.outDType = outDType
        self.returnLSE = returnLSE
    }

    deinit { pyfa_plan_free(handle) }

    /// Runs the decode: q, k, v and out (and lse [B, H] f32 when the plan
    /// returns it) of the plan's shapes and dtypes on its device; kvLen and
    /// ringStart as in `decodeAttention` (one per sequence; ringStart nil is
    /// 0). Writes out and lse in place. Throws `.invalidArgument` naming the
    /// buffer or value that does not fit the plan.
    public func run(q: Buffer, k: Buffer, v: Buffer, kvLen: [Int], ringStart: [Int]? = nil, out: Buffer,
                    lse: Buffer? = nil) throws {
        let (B, H, D) = (batch, heads, headDim)
        try expect(q, "q", qDType, [[B, H, D]] + (B == 1 ? [[H, D]] : []))
        for (name, cache) in [("k", k), ("v", v)] {
            try expect(cache, name, kvDType, [[B, kvHeads, capacity, D]] + (B == 1 ? [[kvHeads, capacity, D]] : []))
        }
        try expect(out, "out", outDType, [[B, H, D]] + (B == 1 ? [[H, D]] : []))
        if let lse { try expect(lse, "lse", .float32, [[B, H]] + (B == 1 ? [[H]] : [])) }
        let lens = try Arg.perSequence(kvLen, "kvLen", count: B)
        let rings = try Arg.perSequence(ringStart ?? Array(repeating: 0, count: B), "ringStart", count: B)
        var args = pyfa_decode_run_args()
        args.q = tensor(q)
        args.k_cache = tensor(k)
        args.v_cache = tensor(v)
        args.out = tensor(out)
        args.lse = lse.map(tensor) ?? pyfa_tensor()
        args.kv_capacity = UInt32(capacity)  // fits: checked when the plan was made
        try lens.withUnsafeBufferPointer { lensPointer in
            try rings.withUnsafeBufferPointer { ringsPointer in
                args.kv_len = pyfa_seq_values(host: lensPointer.baseAddress, device: pyfa_tensor())
                args.ring_start = pyfa_seq_values(host: ringsPointer.baseAddress, device: pyfa_tensor())
                try device.run { encoder in try check(pyfa_decode_run(handle, encoder, &args)) }
            }
        }
    }

    /// `run` with one kvLen for every sequence.
    public func run(q: Buffer, k: Buffer, v: Buffer, kvLen: Int, out: Buffer, lse: Buffer? = nil) throws {
        try run(q: q, k: k, v: v, kvLen: Array(repeating: kvLen, count: batch), out: out, lse: lse)
    }

    private func expect(_ b: Buffer, _ name: String, _ dtype: DType, _ shapes: [[Int]]) throws {
        try b.requireDevice(device, name)
        try require(b.dtype == dtype, "\(name): dtype \(b.dtype) differs from the plan's \(dtype)")
        try require(shapes.contains(b.shape),
                    "\(name): shape \(b.shape) does not fit the plan (expected \(shapes.map { "\($0)" }.joined(separator: " or ")))")
    }

    /// The memory a plan run takes: the address kernels use and its size.
    private func tensor(_ b: Buffer) -> pyfa_tensor {
        pyfa_tensor(address: pyfa_buffer_address(b.handle), nbytes: UInt64(b.nbytes))
    }
}
