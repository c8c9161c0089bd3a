import CPyfa
import PyfaShaderCommon

/// The result of an attention op: the output and, when asked for, the f32
/// log-sum-exp of each query row (natural log of the sum of exp(score) over
/// its visible keys; -inf for a row that saw no key, whose output is zeros).
public struct AttentionOutput {
    /// The attention output, shaped like the query.
    public let out: Buffer
    /// The f32 LSE (the query's shape without its head_dim axis), or nil when
    /// the op was not asked for it.
    public let lse: Buffer?
}

/// Options of `decodeAttention`.
public struct DecodeOptions: Sendable {
    /// Multiplies q·k; nil is 1/sqrt(head_dim). Must be finite.
    public var scale: Float?
    /// nil: every valid slot is visible; else (>= 1) only the last `window` positions.
    public var window: Int?
    /// > 0 applies softcap * tanh(s / softcap) to the scores; 0 disables. Must be finite.
    public var softcap: Float
    /// Per sequence, the physical slot of the oldest entry of a ring-buffer
    /// cache (slot s holds position (s - ringStart) mod capacity), in
    /// 0..<capacity and non-zero only for a full ring (kvLen == capacity);
    /// nil is 0 for every sequence.
    public var ringStart: [Int]?
    /// The output's dtype (f32, f16 or bf16); nil is q's. Accumulation is
    /// f32 either way; the result is rounded once, to nearest even.
    public var outDType: DType?
    /// Also return the f32 LSE, shaped [B, H] ([H] for a 2-D q).
    public var returnLSE: Bool

    /// Options with the defaults above: every argument is the property of its name.
    public init(scale: Float? = nil, window: Int? = nil, softcap: Float = 0, ringStart: [Int]? = nil,
                outDType: DType? = nil, returnLSE: Bool = false) {
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.ringStart = ringStart
        self.outDType = outDType
        self.returnLSE = returnLSE
    }
}

/// Decode attention: one query row per head against a KV cache.
///
/// - q: [B, H, D] (or [H, D] for one sequence), f32 / f16 / bf16; D one of
///   `Library.headDims`.
/// - k, v: [B, H_kv, capacity, D] (or [H_kv, capacity, D]), one float dtype
///   and shape for both; H a multiple of H_kv (query head h reads KV head
///   h / (H / H_kv)).
/// - kvLen: per sequence, the valid slots, in 1...capacity.
///
/// Returns out [B, H, D] ([H, D] for a 2-D q) of `options.outDType` (q's by
/// default), and the LSE when `options.returnLSE`. All buffers must belong to
/// q's device. Throws `PyfaError` with `.invalidArgument` naming the
/// argument for a shape, dtype, length or option that breaks these rules,
/// `.unsupported`-class errors as the library reports them.
public func decodeAttention(q: Buffer, k: Buffer, v: Buffer, kvLen: [Int],
                            options: DecodeOptions = DecodeOptions()) throws -> AttentionOutput {
    try Arg.rank(q, "q", [2, 3], "[B, H, D] or [H, D]")
    let single = q.shape.count == 2
    try Arg.rank(k, "k", [q.shape.count + 1], single ? "[H_kv, capacity, D] for a 2-D q" : "[B, H_kv, capacity, D]")
    try require(v.shape == k.shape, "v: shape \(v.shape) differs from k's \(k.shape)")
    try require(v.dtype == k.dtype, "v: dtype \(v.dtype) differs from k's \(k.dtype)")
    let qs = single ? [1] + q.shape : q.shape
    let ks = single ? [1] + k.shape : k.shape
    let (B, H, D) = (qs[0], qs[1], qs[2])
    let (Hkv, capacity) = (ks[1], ks[2])
    try require(ks[0] == B && ks[3] == D,
                "k: shape \(k.shape) does not match q's \(q.shape) (expected [B=\(B), H_kv, capacity, D=\(D)])")
    let device = q.device
    for (name, b) in [("k", k), ("v", v)] { try b.requireDevice(device, name) }
    let lens = try Arg.perSequence(kvLen, "kvLen", count: B)
    let rings = try Arg.perSequence(options.ringStart ?? Array(repeating: 0, count: B), "ringStart", count: B)
    let outDType = options.outDType ?? q.dtype

    var params = pyfa_flash_attn_vec_params(
        batch: try Arg.u32(B, "batch"), num_heads: try Arg.u32(H, "num_heads"),
        num_kv_heads: try Arg.u32(Hkv, "num_kv_heads"), head_dim: try Arg.u32(D, "head_dim"),
        kv_capacity: try Arg.u32(capacity, "capacity"), nwg: 0, window: try Arg.window(options.window),
        scale: Arg.scale(options.scale, headDim: D), softcap: options.softcap, reserved: 0)
    // The split is sized for the longest kv_len; lengths out of range are
    // refused by the dispatch itself, which names the sequence.
    let longest = UInt32(clamping: min(Int(lens.max() ?? 0), capacity))
    var tmpBytes: UInt64 = 0
    try check(pyfa_flash_attn_vec_plan(device.handle, &params, k.dtype.rawValue, longest, &tmpBytes))
    let tmp = try workspace(device, bytes: tmpBytes)
    let lenBuffer = try sequenceBuffer(device, lens)
    let ringBuffer = try sequenceBuffer(device, rings)
    let out = try resultBuffer(device, shape: single ? [H, D] : [B, H, D], dtype: outDType)
    let lse = options.returnLSE ? try resultBuffer(device, shape: single ? [H] : [B, H], dtype: .float32) : nil
    try device.run { encoder in
        try check(pyfa_flash_attn_vec(encoder, &params, q.handle, k.handle, v.handle, lenBuffer.handle,
                                      ringBuffer.handle, tmp?.handle, out.handle, lse?.handle))
    }
    return AttentionOutput(out: out, lse: lse)
}

/// `decodeAttention` with one kvLen for every sequence.
public func decodeAttention(q: Buffer, k: Buffer, v: Buffer, kvLen: Int,
                            options: DecodeOptions = DecodeOptions()) throws -> AttentionOutput {
    let batch = q.shape.count == 3 ? q.shape[0] : 1
    return try decodeAttention(q: q, k: k, v: v, kvLen: Array(repeating: kvLen, count: batch), options: options)
}
