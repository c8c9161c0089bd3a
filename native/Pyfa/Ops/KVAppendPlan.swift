import CPyfa
import PyfaShaderCommon

/// An append to a single-sequence ring cache, prepared
/// (pyfa_kv_append_plan_desc): the cache geometry, dtypes and (k_bits != 0)
/// the TurboQuant options are checked once and the kernels compiled; a run
/// binds the memory, num_tokens and write_pos and records K and V through the
/// buffer-form dispatchers (KVAppend, TurboQuant.encodeQuantize), so it checks
/// their rules.
public final class KVAppendPlan: OpPlan {
    let desc: pyfa_kv_append_plan_desc
    let kDType: DType, vDType: DType, cacheDType: DType
    var turboQuant: Bool { desc.k_bits != 0 }
    /// K and V (and a state's advance) in one dispatch (BackendPlan.appendsInOneDispatch).
    let oneDispatch: Bool

    public init(device: Device, desc: pyfa_kv_append_plan_desc) throws {
        try require(desc.reserved == 0, "reserved: must be 0")
        kDType = try DType(code: desc.k_dtype)
        vDType = try DType(code: desc.v_dtype)
        cacheDType = try DType(code: desc.cache_dtype)
        try require(attentionFloatTypes.contains(kDType), "k_dtype: \(kDType.name) is not one of f32, f16, bf16")
        try require(attentionFloatTypes.contains(vDType), "v_dtype: \(vDType.name) is not one of f32, f16, bf16")
        try require(desc.num_kv_heads > 0, "num_kv_heads: must be > 0")
        try require(desc.kv_capacity > 0 && desc.kv_capacity <= UInt32(Int32.max),
                    "kv_capacity: \(desc.kv_capacity) must be in 1...\(Int32.max)")
        _ = try checkedProduct([Int(desc.num_kv_heads), Int(desc.kv_capacity), Int(max(desc.head_dim, 1)), 4],
                               what: "cache")
        self.desc = desc
        // Appends of one row dtype (and, for TurboQuant, one bit width) run as one dispatch where
        // the backend can (the state's advance included: the plan's ticket tells the last workgroup).
        oneDispatch = desc.k_bits == desc.v_bits && desc.k_dtype == desc.v_dtype && device.backend.plan.appendsInOneDispatch
        try super.init(device: device, workspaceBytes: 0, tickets: oneDispatch ? 1 : 0)
        // Compiled now, so a run with a state cannot fail on first use after recording its advance
        // (one-dispatch appends advance the state in kv_append or hadamard_quantize_kv itself).
        if !oneDispatch { _ = try device.registry.pipeline(KVAdvance.kernel, constants: KVAdvance.constants()) }
        if desc.k_bits != 0 {
            try TurboQuant.checkCodecOptions(headDim: desc.head_dim, kBits: desc.k_bits, vBits: desc.v_bits,
                                             normCorrection: desc.norm_correction)
            try require(cacheDType == .u8, "cache_dtype: \(cacheDType.name) must be u8 for TurboQuant codes (k_bits != 0)")
            for (src, bits) in [(kDType, desc.k_bits), (vDType, desc.v_bits)] {
                _ = try device.registry.pipeline("hadamard_quantize_kv", constants: TurboQuant.quantizeConstants(
                    src: src, bits: bits, headDim: desc.head_dim))
            }
        } else {
            try require(desc.head_dim > 0, "head_dim: must be > 0")
            for (name, value) in [("v_bits", desc.v_bits), ("norm_correction", desc.norm_correction),
                                  ("seed_lo", desc.seed_lo), ("seed_hi", desc.seed_hi)] {
                try require(value == 0, "\(name): \(value) given to a dense cache (k_bits 0), which takes no TurboQuant options (0)")
            }
            try require(attentionFloatTypes.contains(cacheDType),
                        "cache_dtype: \(cacheDType.name) is not one of f32, f16, bf16 (dense caches)")
            for src in [kDType, vDType] {
                _ = try device.registry.pipeline(KVAppend.kernel, constants: KVAppend.constants(src: src, cache: cacheDType))
            }
        }
    }

    static func separate(_ a: Buffer, _ b: Buffer, _ nameA: String, _ nameB: String,
                         because reason: String = "K and V are stored apart") throws {
        try require(!a.addressRange.overlaps(b.addressRange), "\(nameA): overlaps \(nameB) in memory (\(reason))")
    }

    /// Binds every tensor of the run before recording anything, so a refused
    /// run leaves nothing on the encoder.
    /// `state` (optional): the cache's pyfa_kv_state; the run then advances
    /// it (kv_advance) by num_tokens and the appends write k and v, which hold
    /// the last min(num_tokens, kv_capacity) rows, where it says instead of at
    /// writePos.
    public func run(_ encoder: CommandEncoder, k: TensorRef, v: TensorRef, kCache: TensorRef, vCache: TensorRef,
                    kScales: TensorRef, vScales: TensorRef, numTokens: UInt32, writePos: UInt32,
                    state: TensorRef = TensorRef(address: 0, nbytes: 0), ring: UInt32 = 0) throws {
        try require(encoder.device === device, "encoder: belongs to another device than the plan")
        let cap = desc.kv_capacity
        if state.isAbsent {
            try require(numTokens > 0 && numTokens <= cap,
                        "num_tokens: \(numTokens) must be in 1...kv_capacity (\(cap)); one run writes each slot at most once")
            try require(writePos < cap, "write_pos: \(writePos) must be < kv_capacity (\(cap))")
            try require(ring == 0, "ring: \(ring) given without a state (it says how the state advances); pass 0")
        } else {
            try require(numTokens > 0, "num_tokens: must be > 0")
            try require(writePos == 0, "write_pos: \(writePos) given with a state, which says where rows go; pass 0")
            try require(ring <= 1, "ring: \(ring) must be 0 or 1")
        }
        // With a state, k and v hold the last min(num_tokens, kv_capacity) rows:
        // only those can stay (a ring's; without a ring such an append is dropped).
        let written = state.isAbsent ? numTokens : min(numTokens, cap)
        let rowElements = try checkedProduct([Int(written), Int(desc.num_kv_heads), Int(desc.head_dim)], what: "k")
        let sk = try bind(k, "k", dtype: kDType, elements: rowElements)
        let sv = try bind(v, "v", dtype: vDType, elements: rowElements)
        let st = try bindOptional(state, "state", dtype: .i32, elements: 4, perElement: true)
        /// The state is memory of its own: no row, cache or scale shares a byte with it.
        func stateApart(_ others: [(Buffer, String)]) throws {
            guard let st else { return }
            for (b, name) in [(sk, "k"), (sv, "v")] + others {
                try require(!st.addressRange.overlaps(b.addressRange),
                            "state: overlaps \(name) in memory (a cache's state is memory of its own)")
            }
        }
        let rows = Int(desc.num_kv_heads) * Int(cap)
        if turboQuant {
            let kCodes = try bind(kCache, "k_cache", dtype: .u8, elements: rows * TurboQuant.rowBytes(desc.head_dim, desc.k_bits))
            let vCodes = try bind(vCache, "v_cache", dtype: .u8, elements: rows * TurboQuant.rowBytes(desc.head_dim, desc.v_bits))
            let ks = try bind(kScales, "k_scales", dtype: .f32, elements: rows, perElement: true)
            let vs = try bind(vScales, "v_scales", dtype: .f32, elements: rows, perElement: true)
            try KVAppendPlan.separate(kCodes, vCodes, "k_cache", "v_cache")
            try KVAppendPlan.separate(ks, vs, "k_scales", "v_scales")
            for (codes, codesName) in [(kCodes, "k_cache"), (vCodes, "v_cache")] {
                for (scales, scalesName) in [(ks, "k_scales"), (vs, "v_scales")] {
                    try KVAppendPlan.separate(codes, scales, codesName, scalesName,
                                              because: "codes and scales are stored apart")
                }
            }
            // No output aliases rows an encoder reads: one dispatch may encode K and V at once.
            for (out, name) in [(kCodes, "k_cache"), (vCodes, "v_cache"), (ks, "k_scales"), (vs, "v_scales")] {
                try Check.noOverlap(out, name, inputs: [("k", sk), ("v", sv)])
            }
            try stateApart([(kCodes, "k_cache"), (vCodes, "v_cache"), (ks, "k_scales"), (vs, "v_scales")])
            func params(_ stream: Int32, _ bits: UInt32) -> pyfa_tq_quantize_params {
                pyfa_tq_quantize_params(num_tokens: written, num_kv_heads: desc.num_kv_heads, head_dim: desc.head_dim,
                                        kv_capacity: desc.kv_capacity, write_pos: writePos, bits: bits,
                                        stream: UInt32(stream), norm_correction: desc.norm_correction,
                                        seed_lo: desc.seed_lo, seed_hi: desc.seed_hi, sequence: 0, reserved: 0)
            }
            if oneDispatch {
                if st != nil { noteCapture(encoder) }  // a graph replaying this run writes the tickets
                try TurboQuant.encodeQuantize(encoder, params(PYFA_TQ_STREAM_K, desc.k_bits), src: sk, codes: kCodes,
                                              scales: ks, position: st, v: (sv, vCodes, vs),
                                              advance: st.map { _ in advanceParams(numTokens, ring) },
                                              tickets: st == nil ? nil : tickets)
            } else {
                if let st { try advance(encoder, numTokens, ring, st) }
                for (stream, src, bits, codes, scales) in [(PYFA_TQ_STREAM_K, sk, desc.k_bits, kCodes, ks),
                                                          (PYFA_TQ_STREAM_V, sv, desc.v_bits, vCodes, vs)] {
                    try TurboQuant.encodeQuantize(encoder, params(stream, bits), src: src, codes: codes, scales: scales,
                                                  position: st)
                }
            }
        } else {
            try require(kScales.isAbsent && vScales.isAbsent, "k_scales: dense caches take no scales (pass address 0)")
            let cacheElements = rows * Int(desc.head_dim)
            let kc = try bind(kCache, "k_cache", dtype: cacheDType, elements: cacheElements)
            let vc = try bind(vCache, "v_cache", dtype: cacheDType, elements: cacheElements)
            try KVAppendPlan.separate(kc, vc, "k_cache", "v_cache")
            try Check.noOverlap(kc, "k_cache", inputs: [("k", sk), ("v", sv)])  // KVAppend.encode's rule, for V too
            try Check.noOverlap(vc, "v_cache", inputs: [("k", sk), ("v", sv)])  // before K is recorded
            try stateApart([(kc, "k_cache"), (vc, "v_cache")])
            let p = pyfa_kv_append_params(num_tokens: written, num_kv_heads: desc.num_kv_heads, head_dim: desc.head_dim,
                                          kv_capacity: desc.kv_capacity, write_pos: writePos, sequence: 0)
            if oneDispatch {
                if st != nil { noteCapture(encoder) }  // a graph replaying this run writes the tickets
                try KVAppend.encode(encoder, p, src: sk, cache: kc, position: st, v: (sv, vc),
                                    advance: st.map { _ in advanceParams(numTokens, ring) },
                                    tickets: st == nil ? nil : tickets)
            } else {
                if let st { try advance(encoder, numTokens, ring, st) }
                try KVAppend.encode(encoder, p, src: sk, cache: kc, position: st)
                try KVAppend.encode(encoder, p, src: sv, cache: vc, position: st)
            }
        }
    }

    private func advanceParams(_ numTokens: UInt32, _ ring: UInt32) -> pyfa_kv_advance_params {
        pyfa_kv_advance_params(kv_capacity: desc.kv_capacity, num_tokens: numTokens, ring: ring, reserved: 0)
    }

    private func advance(_ encoder: CommandEncoder, _ numTokens: UInt32, _ ring: UInt32, _ state: Buffer) throws {
        try KVAdvance.encode(encoder, advanceParams(numTokens, ring), state: state)
    }
}
