import CPyfa
import PyfaShaderCommon

/// A TurboQuant-compressed KV cache for one sequence: each K and V row is
/// rotated (a randomised Hadamard transform), coded with a Lloyd-Max
/// codebook of `kBits` / `vBits` bits per value and stored with one f32
/// scale (codec: shaders/common/turboquant_params.h; the codes are the same
/// bytes on every backend). Storage per token and KV head:
/// headDim·(kBits + vBits)/8 bytes of codes plus two f32 scales (136 B at
/// headDim 128 and 4 bits, against 512 B of f16 K and V).
/// Ring, window and thread rules are `KVCache`'s.
public final class TurboQuantKVCache: @unchecked Sendable {
    /// How a row's scale is chosen (turboquant_params.h).
    public enum NormCorrection: UInt32, Sendable {
        /// scale = |x|.
        case none = 0
        /// |x~| = |x| (the default: the lowest error at 3, 4 and 8 bits).
        case normPreserving = 1
        /// <x~, x> = <x, x>.
        case unbiased = 2
    }

    /// The device holding the cache.
    public let device: Device
    /// Bits per K value and per V value (each one of `Library.turboQuantBits`).
    public let kBits: Int, vBits: Int
    /// Draws the K and V sign vectors of the rotation.
    public let seed: UInt64
    /// How row scales are chosen.
    public let normCorrection: NormCorrection
    private var ring: Ring
    private let codes: [Buffer]   // K, V: [numKVHeads, capacity, headDim * bits / 8] u8
    private let scales: [Buffer]  // K, V: [numKVHeads, capacity] f32
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
    /// Bytes of codes and scales.
    public var nbytes: Int { (codes + scales).reduce(0) { $0 + $1.nbytes } }

    /// A cache of `capacity` slots per KV head. Throws `.invalidArgument` for
    /// a headDim outside `Library.turboQuantHeadDims` (the rotation needs a
    /// power of two), bits outside `Library.turboQuantBits`, and the rules of
    /// `KVCache.init`.
    public init(_ device: Device, numKVHeads: Int, headDim: Int, capacity: Int, kBits: Int = 4, vBits: Int = 4,
                seed: UInt64 = 0, normCorrection: NormCorrection = .normPreserving, slidingWindow: Int? = nil) throws {
        ring = try Ring(numKVHeads: numKVHeads, headDim: headDim, capacity: capacity, slidingWindow: slidingWindow)
        let dims = Library.turboQuantHeadDims, widths = Library.turboQuantBits
        try require(dims.contains(headDim),
                    "headDim: \(headDim) is not supported by TurboQuant (the Hadamard rotation needs one of \(dims))")
        for (name, bits) in [("kBits", kBits), ("vBits", vBits)] {
            try require(widths.contains(bits), "\(name): \(bits) is not a TurboQuant bit width (one of \(widths))")
        }
        self.device = device
        self.kBits = kBits
        self.vBits = vBits
        self.seed = seed
        self.normCorrection = normCorrection
        codes = try [kBits, vBits].map {
            try Buffer(device, shape: [numKVHeads, capacity, headDim * $0 / 8], dtype: .uint8, storage: .private)
        }
        scales = try (0..<2).map { _ in
            try Buffer(device, shape: [numKVHeads, capacity], dtype: .float32, storage: .private)
        }
    }

    private var seedLo: UInt32 { UInt32(truncatingIfNeeded: seed) }
    private var seedHi: UInt32 { UInt32(truncatingIfNeeded: seed >> 32) }

    /// Encodes and appends k and v rows [n, numKVHeads, headDim] (f32, f16 or
    /// bf16, on the cache's device), one dispatch each. Throws
    /// `.invalidArgument`, changing nothing, as `KVCache.append` does.
    public func append(k: Buffer, v: Buffer) throws {
        try lock.withLock {
            let n = try ring.checkRows(k, "k", device: device)
            let nv = try ring.checkRows(v, "v", device: device)
            try require(nv == n, "v: \(nv) tokens, k has \(n) (append needs one v row per k row)")
            let (skip, slot, count) = try ring.planAppend(n)
            let sources = [try tailRows(k, from: skip), try tailRows(v, from: skip)]
            try device.run { encoder in
                for stream in 0..<2 {
                    var params = pyfa_tq_quantize_params(
                        num_tokens: UInt32(count), num_kv_heads: UInt32(numKVHeads), head_dim: UInt32(headDim),
                        kv_capacity: UInt32(capacity), write_pos: UInt32(slot),
                        bits: UInt32(stream == 0 ? kBits : vBits), stream: UInt32(stream),
                        norm_correction: normCorrection.rawValue, seed_lo: seedLo, seed_hi: seedHi,
                        sequence: 0, reserved: 0)
                    try check(pyfa_hadamard_quantize_kv(encoder, &params, sources[stream].handle,
                                                        codes[stream].handle, scales[stream].handle))
                }
            }
            ring.appended(n)
        }
    }

    /// Decode attention of q [H, headDim] (f32, f16 or bf16; H a multiple of
    /// numKVHeads) over the codes, in the rotated domain; returns out
    /// [H, headDim] in the original domain (zeros for an empty cache) and,
    /// when asked, the LSE [H] (the rotation is orthogonal, so it is the
    /// original scores'). Throws `PyfaError` naming the argument that breaks a rule.
    public func attend(q: Buffer, options: CacheAttendOptions = CacheAttendOptions()) throws -> AttentionOutput {
        try lock.withLock {
            let H = try ring.checkQuery(q, device: device, outDType: options.outDType)
            var params = pyfa_flash_attn_vec_tq_params(attn: try ring.attendParams(heads: H, options: options),
                                                       k_bits: UInt32(kBits), v_bits: UInt32(vBits),
                                                       seed_lo: seedLo, seed_hi: seedHi, fused: 1, q_in: 0)
            var tmpBytes: UInt64 = 0
            try check(pyfa_flash_attn_vec_tq_plan(device.handle, &params, UInt32(ring.lengths.0), &tmpBytes))
            return try ring.attend(device, heads: H, outDType: options.outDType ?? q.dtype,
                                   returnLSE: options.returnLSE, workspaceBytes: tmpBytes) { encoder, lens, rings, tmp, out, lse in
                try check(pyfa_flash_attn_vec_tq(encoder, &params, q.handle, codes[0].handle, scales[0].handle,
                                                 codes[1].handle, scales[1].handle, lens.handle, rings.handle,
                                                 tmp?.handle, out.handle, lse?.handle))
            }
        }
    }

    /// The stored K and V rows decoded by the library: f32 [count,
    /// numKVHeads, headDim] each, oldest token first, in the original domain.
    public func dequantize() throws -> (k: Buffer, v: Buffer) {
        try lock.withLock {
            let (n, first) = ring.lengths
            let rows = try (0..<2).map { _ in
                try resultBuffer(device, shape: [n, numKVHeads, headDim], dtype: .float32)
            }
            if n == 0 { return (rows[0], rows[1]) }
            try device.run { encoder in
                for stream in 0..<2 {
                    var params = pyfa_tq_dequantize_params(
                        num_tokens: UInt32(n), num_kv_heads: UInt32(numKVHeads), head_dim: UInt32(headDim),
                        kv_capacity: UInt32(capacity), first_slot: UInt32(first),
                        bits: UInt32(stream == 0 ? kBits : vBits), stream: UInt32(stream), sequence: 0,
                        seed_lo: seedLo, seed_hi: seedHi)
                    try check(pyfa_tq_dequantize_kv(encoder, &params, codes[stream].handle, scales[stream].handle,
                                                    rows[stream].handle))
                }
            }
            return (rows[0], rows[1])
        }
    }
}
