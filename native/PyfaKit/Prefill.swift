import CPyfa
import PyfaShaderCommon

/// How a 4-D attention tensor orders its axes.
public enum Layout: Sendable {
    /// [B, H, L, D]: batch, heads, rows, head_dim.
    case bhsd
    /// [B, L, H, D]: batch, rows, heads, head_dim.
    case bshd

    /// (batch, heads, rows, head_dim) of a 4-D shape.
    func dims(_ s: [Int]) -> (Int, Int, Int, Int) {
        self == .bhsd ? (s[0], s[1], s[2], s[3]) : (s[0], s[2], s[1], s[3])
    }

    /// Element strides (batch, head, row) of a contiguous tensor.
    func strides(heads: Int, rows: Int, headDim: Int) -> (Int64, Int64, Int64) {
        let (h, l, d) = (Int64(heads), Int64(rows), Int64(headDim))
        return self == .bhsd ? (h * l * d, l * d, d) : (l * h * d, d, h * d)
    }
}

/// Options of `attention` (prefill).
public struct AttentionOptions {
    /// Multiplies q·k; nil is 1/sqrt(head_dim). Must be finite.
    public var scale: Float?
    /// Query row i (at position qOffset + i) sees keys j <= qOffset + i.
    public var causal: Bool
    /// The absolute position of query row 0; nil is kv_len - q_len
    /// (bottom-right alignment). May be negative.
    public var qOffset: Int?
    /// nil, or [q_len, kv_len] (shared by every batch and head) or
    /// [B, H, q_len, kv_len]: `.uint8` (non-zero attends) or q's dtype
    /// (additive: -inf blocks, finite values are biases). Combines with
    /// `causal` and `window`.
    public var mask: Buffer?
    /// nil, or (>= 1) a query at position p sees keys j with p - j < window.
    public var window: Int?
    /// > 0 applies softcap * tanh(s / softcap) to the scores before the mask; 0 disables.
    public var softcap: Float
    /// The axis order of q, k, v and the output.
    public var layout: Layout
    /// nil (q's dtype) or `.float32` (an f32 output from f16 / bf16 inputs).
    public var outDType: DType?
    /// Also return the f32 LSE [B, H, q_len].
    public var returnLSE: Bool

    /// Options with the defaults above: every argument is the property of its name.
    public init(scale: Float? = nil, causal: Bool = false, qOffset: Int? = nil, mask: Buffer? = nil,
                window: Int? = nil, softcap: Float = 0, layout: Layout = .bhsd, outDType: DType? = nil,
                returnLSE: Bool = false) {
        self.scale = scale
        self.causal = causal
        self.qOffset = qOffset
        self.mask = mask
        self.window = window
        self.softcap = softcap
        self.layout = layout
        self.outDType = outDType
        self.returnLSE = returnLSE
    }
}

/// A mask spanning at least this many key tiles of the backend's plan gets
/// the tile-classifying pre-pass: blocked tiles are then skipped and all-zero
/// tiles skip the mask read, for one more read of the mask (the Python API's rule).
private let blkMinKeyBlocks: UInt32 = 2

/// Attention of many query rows (prefill): softmax(scale · q kᵀ [+ mask]) v.
///
/// - q: [B, H, q_len, D] (`.bhsd`) or [B, q_len, H, D] (`.bshd`), f32 / f16 /
///   bf16; D one of `Library.headDims`.
/// - k, v: [B, H_kv, kv_len, D] / [B, kv_len, H_kv, D], q's dtype, one
///   shape; H a multiple of H_kv.
///
/// Returns out of q's shape and `options.outDType` (rows with no visible key
/// are zeros) and the LSE [B, H, q_len] when `options.returnLSE`. Throws
/// `PyfaError` `.invalidArgument` naming the argument for a shape, dtype or
/// option that breaks these rules.
public func attention(q: Buffer, k: Buffer, v: Buffer,
                      options: AttentionOptions = AttentionOptions()) throws -> AttentionOutput {
    let layout = options.layout
    let what = layout == .bhsd ? "[B, H, L, D] (layout bhsd)" : "[B, L, H, D] (layout bshd)"
    for (name, b) in [("q", q), ("k", k), ("v", v)] { try Arg.rank(b, name, [4], what) }
    for (name, b) in [("k", k), ("v", v)] {
        try require(b.dtype == q.dtype, "\(name): dtype \(b.dtype) differs from q's \(q.dtype)")
        try b.requireDevice(q.device, name)
    }
    try require(v.shape == k.shape, "v: shape \(v.shape) differs from k's \(k.shape)")
    let (B, H, qLen, D) = layout.dims(q.shape)
    let (Bk, Hkv, kvLen, Dk) = layout.dims(k.shape)
    try require(Dk == D, "k: head_dim \(Dk) differs from q's head_dim \(D)")
    try require(Bk == B, "k: batch \(Bk) differs from q's batch \(B)")
    let device = q.device

    var maskStrides: (Int64, Int64, Int64) = (0, 0, 0)
    if let mask = options.mask {
        try mask.requireDevice(device, "mask")
        if mask.shape == [qLen, kvLen] {
            maskStrides = (0, 0, Int64(kvLen))
        } else if mask.shape == [B, H, qLen, kvLen] {
            maskStrides = (Int64(H * qLen * kvLen), Int64(qLen * kvLen), Int64(kvLen))
        } else {
            throw PyfaError(.invalidArgument, "mask: expected shape [q_len, kv_len] = \([qLen, kvLen]) or "
                            + "[B, H, q_len, kv_len] = \([B, H, qLen, kvLen]), got \(mask.shape)")
        }
    }
    let qStrides = layout.strides(heads: H, rows: qLen, headDim: D)
    let kvStrides = layout.strides(heads: Hkv, rows: kvLen, headDim: D)
    var params = pyfa_flash_attn_prefill_params()
    params.batch = try Arg.u32(B, "batch")
    params.num_heads = try Arg.u32(H, "num_heads")
    params.num_kv_heads = try Arg.u32(Hkv, "num_kv_heads")
    params.head_dim = try Arg.u32(D, "head_dim")
    params.q_len = try Arg.length(qLen, "q_len")
    params.kv_len = try Arg.length(kvLen, "kv_len")
    params.q_offset = try Arg.i32(options.qOffset ?? kvLen - qLen, "qOffset")
    params.window = try Arg.window(options.window)
    params.scale = Arg.scale(options.scale, headDim: D)
    params.softcap = options.softcap
    params.causal = options.causal ? 1 : 0
    params.q_strides = qStrides
    params.k_strides = kvStrides
    params.v_strides = kvStrides
    params.out_strides = qStrides
    params.mask_strides = maskStrides

    var blkBytes: UInt64 = 0
    try check(pyfa_flash_attn_prefill_plan(device.handle, &params, q.dtype.rawValue, &blkBytes))
    let blk = options.mask != nil && params.num_k_blocks >= blkMinKeyBlocks && blkBytes > 0
        ? try Buffer(device, shape: [Int(clamping: blkBytes)], dtype: .uint8, storage: device.hostVisible ? .shared : .private)
        : nil
    let out = try resultBuffer(device, shape: q.shape, dtype: options.outDType ?? q.dtype)
    let lse = options.returnLSE ? try resultBuffer(device, shape: [B, H, qLen], dtype: .float32) : nil
    try device.run { encoder in
        if let blk, let mask = options.mask {
            try check(pyfa_flash_attn_prefill_blk(encoder, &params, q.dtype.rawValue, mask.handle, blk.handle))
        }
        try check(pyfa_flash_attn_prefill(encoder, &params, q.handle, k.handle, v.handle, options.mask?.handle,
                                          blk?.handle, out.handle, lse?.handle))
    }
    return AttentionOutput(out: out, lse: lse)
}

/// Combines two attentions of the same queries over disjoint key sets
/// (split-KV, cascade): with m = max(lseA, lseB) and w = exp(lse - m),
/// out = (wA·oA + wB·oB) / (wA + wB) and lse = m + log(wA + wB); rows with
/// -inf on both sides give zeros and -inf.
///
/// - oA, oB: one shape and float dtype: [B, H, L, D] / [B, L, H, D] (by
///   `layout`), or a decode's output [B, H, D] or [H, D]; D a multiple of 8.
/// - lseA, lseB: f32, oA's shape without its D axis ([B, H, L] for 4-D).
///
/// Returns out (oA's shape; `outDType` nil is oA's dtype, or `.float32`) and
/// the merged f32 LSE. Throws `PyfaError` `.invalidArgument` naming the
/// argument that breaks a rule.
public func mergeAttentionStates(oA: Buffer, lseA: Buffer, oB: Buffer, lseB: Buffer, layout: Layout = .bhsd,
                                 outDType: DType? = nil) throws -> (out: Buffer, lse: Buffer) {
    try Arg.rank(oA, "oA", [2, 3, 4], "[B, H, L, D] / [B, L, H, D], or [B, H, D] or [H, D]")
    try require(oB.shape == oA.shape, "oB: shape \(oB.shape) differs from oA's \(oA.shape)")
    try require(oB.dtype == oA.dtype, "oB: dtype \(oB.dtype) differs from oA's \(oA.dtype)")
    let s = oA.shape
    let (B, H, L, D): (Int, Int, Int, Int) =
        s.count == 4 ? layout.dims(s) : s.count == 3 ? (s[0], s[1], 1, s[2]) : (1, s[0], 1, s[1])
    let lseShape = s.count == 4 ? [B, H, L] : Array(s.dropLast())
    let device = oA.device
    for (name, b) in [("lseA", lseA), ("oB", oB), ("lseB", lseB)] { try b.requireDevice(device, name) }
    for (name, b) in [("lseA", lseA), ("lseB", lseB)] {
        try require(b.shape == lseShape, "\(name): expected shape \(lseShape), got \(b.shape)")
        try require(b.dtype == .float32, "\(name): dtype \(b.dtype) must be f32")
    }
    var params = pyfa_merge_attn_params()
    params.batch = try Arg.u32(B, "batch")
    params.num_heads = try Arg.u32(H, "num_heads")
    params.seq_len = try Arg.u32(L, "seq_len")
    params.head_dim = try Arg.u32(D, "head_dim")
    params.o_strides = s.count == 4 ? layout.strides(heads: H, rows: L, headDim: D) : (Int64(H * D), Int64(D), Int64(D))
    let out = try resultBuffer(device, shape: s, dtype: outDType ?? oA.dtype)
    let lse = try resultBuffer(device, shape: lseShape, dtype: .float32)
    try device.run { encoder in
        try check(pyfa_merge_attention_states(encoder, &params, oA.handle, lseA.handle, oB.handle, lseB.handle,
                                              out.handle, lse.handle))
    }
    return (out, lse)
}
