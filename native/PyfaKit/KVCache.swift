import CPyfa
import PyfaShaderCommon

/// Options of a cache's `attend`.
public struct CacheAttendOptions: Sendable {
    /// Multiplies q·k; nil is 1/sqrt(head_dim). Must be finite.
    public var scale: Float?
    /// > 0 applies softcap * tanh(s / softcap) to the scores; 0 disables. Must be finite.
    public var softcap: Float
    /// The output's dtype (f32, f16 or bf16); nil is q's.
    public var outDType: DType?
    /// Also return the f32 LSE [H] (-inf for an empty cache).
    public var returnLSE: Bool

    /// Options with the defaults above: every argument is the property of its name.
    public init(scale: Float? = nil, softcap: Float = 0, outDType: DType? = nil, returnLSE: Bool = false) {
        self.scale = scale
        self.softcap = softcap
        self.outDType = outDType
        self.returnLSE = returnLSE
    }
}

/// Token bookkeeping of a single-sequence cache. Without a sliding window it
/// holds at most `capacity` tokens; with one it is a ring: token t (counting
/// every token ever appended) lives in slot t mod capacity.
struct Ring {
    let numKVHeads: Int
    let headDim: Int
    let capacity: Int
    let slidingWindow: Int?
    private(set) var total = 0

    init(numKVHeads: Int, headDim: Int, capacity: Int, slidingWindow: Int?) throws {
        try require(numKVHeads >= 1 && numKVHeads <= Int(UInt32.max), "numKVHeads: must be >= 1, got \(numKVHeads)")
        try require(headDim >= 1 && headDim <= Int(UInt32.max), "headDim: must be >= 1, got \(headDim)")
        try require(capacity >= 1 && capacity <= Int(Int32.max), "capacity: must be in 1...\(Int32.max), got \(capacity)")
        if let w = slidingWindow {
            try require(w >= 1, "slidingWindow: must be nil or >= 1, got \(w)")
            try require(capacity >= w, "capacity: \(capacity) must be >= slidingWindow (\(w)) for a ring-buffer cache")
        }
        self.numKVHeads = numKVHeads
        self.headDim = headDim
        self.capacity = capacity
        self.slidingWindow = slidingWindow
    }

    /// Tokens stored (at most capacity).
    var count: Int { min(total, capacity) }

    /// (kv_len, ring_start) of the decode contract.
    var lengths: (Int, Int) { total < capacity ? (total, 0) : (capacity, total % capacity) }

    /// Checks rows [n, numKVHeads, headDim] of a float dtype on `device`; returns n.
    func checkRows(_ rows: Buffer, _ name: String, device: Device) throws -> Int {
        try rows.requireDevice(device, name)
        try require(rows.dtype.isFloat, "\(name): dtype \(rows.dtype) must be f32, f16 or bf16")
        try require(rows.shape.count == 3 && rows.shape[0] >= 1 && Array(rows.shape.dropFirst()) == [numKVHeads, headDim],
                    "\(name): expected shape [n >= 1, numKVHeads=\(numKVHeads), headDim=\(headDim)], got \(rows.shape)")
        return rows.shape[0]
    }

    /// (first source row, first slot, rows to write) of appending n tokens,
    /// or throws before anything changes.
    func planAppend(_ n: Int) throws -> (skip: Int, slot: Int, count: Int) {
        if slidingWindow == nil {
            try require(n <= capacity - total,
                        "append: \(n) tokens would exceed capacity \(capacity) (\(total) stored); pass slidingWindow for a ring buffer")
        }
        let skip = max(0, n - capacity)  // a ring keeps only the last `capacity` rows
        return (skip, (total + skip) % capacity, n - skip)
    }

    mutating func appended(_ n: Int) { total += n }

    /// Checks q [H, headDim] of a float dtype on `device`; returns H.
    func checkQuery(_ q: Buffer, device: Device, outDType: DType?) throws -> Int {
        try q.requireDevice(device, "q")
        try require(q.dtype.isFloat, "q: dtype \(q.dtype) must be f32, f16 or bf16")
        try require(q.shape.count == 2 && q.shape[1] == headDim,
                    "q: expected shape [H, headDim=\(headDim)], got \(q.shape)")
        if let outDType { try require(outDType.isFloat, "outDType: \(outDType) must be f32, f16 or bf16") }
        return q.shape[0]
    }

    /// The decode parameters of attending `heads` query heads over this cache.
    func attendParams(heads: Int, options: CacheAttendOptions) throws -> pyfa_flash_attn_vec_params {
        pyfa_flash_attn_vec_params(
            batch: 1, num_heads: try Arg.u32(heads, "num_heads"), num_kv_heads: UInt32(numKVHeads),
            head_dim: UInt32(headDim), kv_capacity: UInt32(capacity), nwg: 0,
            window: try Arg.window(slidingWindow), scale: Arg.scale(options.scale, headDim: headDim),
            softcap: options.softcap, reserved: 0)
    }

    /// An attend's buffers and run: zeros for an empty cache, else the workspace,
    /// the per-sequence values, out [heads, headDim] (and the LSE [heads]) made
    /// here and `encode` recording the op with them on one submission.
    func attend(_ device: Device, heads: Int, outDType: DType, returnLSE: Bool, workspaceBytes: UInt64,
                encode: (_ encoder: OpaquePointer, _ lens: Buffer, _ rings: Buffer, _ tmp: Buffer?, _ out: Buffer,
                         _ lse: Buffer?) throws -> Void) throws -> AttentionOutput {
        let (kvLen, ringStart) = lengths
        if kvLen == 0 {
            return try emptyAttention(device, heads: heads, headDim: headDim, dtype: outDType, returnLSE: returnLSE)
        }
        let tmp = try workspace(device, bytes: workspaceBytes)
        let lens = try sequenceBuffer(device, [Int32(kvLen)]), rings = try sequenceBuffer(device, [Int32(ringStart)])
        let out = try resultBuffer(device, shape: [heads, headDim], dtype: outDType)
        let lse = returnLSE ? try resultBuffer(device, shape: [heads], dtype: .float32) : nil
        try device.run { encoder in try encode(encoder, lens, rings, tmp, out, lse) }
        return AttentionOutput(out: out, lse: lse)
    }
}

/// Rows [skip..<n] of a [n, ...] buffer as a buffer of their own (a ring
/// append longer than the cache keeps only its last `capacity` rows).
func tailRows(_ rows: Buffer, from skip: Int) throws -> Buffer {
    if skip == 0 { return rows }
    let rowBytes = rows.nbytes / rows.shape[0]
    let tail = try Buffer(rows.device, shape: [rows.shape[0] - skip] + rows.shape.dropFirst(), dtype: rows.dtype)
    try tail.write(bytes: Array(try rows.bytes()[(skip * rowBytes)...]))
    return tail
}

/// The result of attending an empty cache: zeros, and an LSE of -inf.
func emptyAttention(_ device: Device, heads: Int, headDim: Int, dtype: DType, returnLSE: Bool) throws -> AttentionOutput {
    let out = try resultBuffer(device, shape: [heads, headDim], dtype: dtype)
    try out.write([Float](repeating: 0, count: heads * headDim))
    var lse: Buffer?
    if returnLSE {
        let l = try resultBuffer(device, shape: [heads], dtype: .float32)
        try l.write([Float](repeating: -.infinity, count: heads))
        lse = l
    }
    return AttentionOutput(out: out, lse: lse)
}

/// A dense KV cache for one sequence: K and V as [numKVHeads, capacity,
/// headDim] of `dtype` in device memory. `append` writes rows with one
/// kv_append dispatch each for K and V; `attend` runs decode attention over
/// the stored tokens. Appends and attends of one cache are serialised by its
/// lock, so a cache may be shared between threads.
public final class KVCache: @unchecked Sendable {
    /// The device holding the cache.
    public let device: Device
    /// The storage dtype (f32, f16 or bf16).
    public let dtype: DType
    private var ring: Ring
    private let k: Buffer
    private let v: Buffer
    private let lock = Mutex()

    /// KV heads per token.
    public var numKVHeads: Int { ring.numKVHeads }
    /// Values per row.
    public var headDim: Int { ring.headDim }
    /// Slots per KV head.
    public var capacity: Int { ring.capacity }
    /// nil, or the number of latest tokens attention sees (a ring buffer).
    public var slidingWindow: Int? { ring.slidingWindow }
    /// Tokens stored (at most `capacity`).
    public var count: Int { lock.withLock { ring.count } }
    /// Bytes of K and V storage.
    public var nbytes: Int { k.nbytes + v.nbytes }

    /// A cache of `capacity` slots per KV head. Without `slidingWindow`,
    /// appending past `capacity` throws; with it (`capacity >= slidingWindow`)
    /// the cache is a ring and attention sees the last `slidingWindow` tokens.
    /// Throws `.invalidArgument` for a non-positive size, a capacity above
    /// Int32.max or below the window, or a non-float dtype.
    public init(_ device: Device, numKVHeads: Int, headDim: Int, capacity: Int, dtype: DType = .float16,
                slidingWindow: Int? = nil) throws {
        ring = try Ring(numKVHeads: numKVHeads, headDim: headDim, capacity: capacity, slidingWindow: slidingWindow)
        try require(dtype.isFloat, "dtype: \(dtype) must be f32, f16 or bf16")
        self.device = device
        self.dtype = dtype
        k = try Buffer(device, shape: [numKVHeads, capacity, headDim], dtype: dtype, storage: .private)
        v = try Buffer(device, shape: [numKVHeads, capacity, headDim], dtype: dtype, storage: .private)
    }

    /// Appends k and v rows [n, numKVHeads, headDim] (f32, f16 or bf16, on
    /// the cache's device), rounded to the cache dtype to nearest even.
    /// Throws `.invalidArgument`, changing nothing, for a wrong shape or
    /// dtype, differing token counts, or (without a window) overflow.
    public func append(k newK: Buffer, v newV: Buffer) throws {
        try lock.withLock {
            let n = try ring.checkRows(newK, "k", device: device)
            let nv = try ring.checkRows(newV, "v", device: device)
            try require(nv == n, "v: \(nv) tokens, k has \(n) (append needs one v row per k row)")
            let (skip, slot, count) = try ring.planAppend(n)
            var params = pyfa_kv_append_params(
                num_tokens: UInt32(count), num_kv_heads: UInt32(numKVHeads), head_dim: UInt32(headDim),
                kv_capacity: UInt32(capacity), write_pos: UInt32(slot), sequence: 0)
            let srcK = try tailRows(newK, from: skip), srcV = try tailRows(newV, from: skip)
            try device.run { encoder in
                try check(pyfa_kv_append(encoder, &params, srcK.handle, k.handle))
                try check(pyfa_kv_append(encoder, &params, srcV.handle, v.handle))
            }
            ring.appended(n)
        }
    }

    /// Decode attention of q [H, headDim] (f32, f16 or bf16; H a multiple of
    /// numKVHeads; headDim one of `Library.headDims`) over the stored tokens
    /// (the last `slidingWindow` of them for a ring). Returns out [H, headDim]
    /// (zeros for an empty cache) and, when asked, the LSE [H]. Throws
    /// `PyfaError` naming the argument that breaks a rule.
    public func attend(q: Buffer, options: CacheAttendOptions = CacheAttendOptions()) throws -> AttentionOutput {
        try lock.withLock {
            let H = try ring.checkQuery(q, device: device, outDType: options.outDType)
            var params = try ring.attendParams(heads: H, options: options)
            // The plan checks every option, so an empty cache refuses what a full one would.
            var tmpBytes: UInt64 = 0
            try check(pyfa_flash_attn_vec_plan(device.handle, &params, dtype.rawValue, UInt32(ring.lengths.0), &tmpBytes))
            return try ring.attend(device, heads: H, outDType: options.outDType ?? q.dtype,
                                   returnLSE: options.returnLSE, workspaceBytes: tmpBytes) { encoder, lens, rings, tmp, out, lse in
                try check(pyfa_flash_attn_vec(encoder, &params, q.handle, k.handle, v.handle, lens.handle, rings.handle,
                                              tmp?.handle, out.handle, lse?.handle))
            }
        }
    }
}
