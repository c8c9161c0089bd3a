import CPyfa
import PyfaShaderCommon

/// TurboQuant compressed KV cache: encoder, decoder, FWHT transforms and
/// decode attention over codes. Contracts (codec, slots, tmp layout):
/// turboquant_params.h.
public enum TurboQuant {
    static let bitWidths: [UInt32] = supportedList("tq_bits")
    static let headDims: [UInt32] = supportedList("tq_head_dims")
    static let floatTypes: [DType] = attentionFloatTypes

    static func checkBits(_ bits: UInt32, _ name: String) throws {
        try require(bitWidths.contains(bits),
                    "\(name): \(bits) is not a TurboQuant bit width (\(bitWidths.map(String.init).joined(separator: ", ")))")
    }

    /// The codec options of an op that encodes both streams (k_bits != 0).
    static func checkCodecOptions(headDim: UInt32, kBits: UInt32, vBits: UInt32, normCorrection: UInt32) throws {
        try checkHeadDim(headDim)
        try checkBits(kBits, "k_bits")
        try checkBits(vBits, "v_bits")
        try checkNormCorrection(normCorrection)
    }

    static func checkNormCorrection(_ mode: UInt32) throws {
        try require(mode <= UInt32(PYFA_TQ_NORM_UNBIASED),
                    "norm_correction: \(mode) must be 0 (none), 1 (norm-preserving) or 2 (unbiased)")
    }

    static func checkHeadDim(_ d: UInt32) throws {
        try require(headDims.contains(d),
                    "head_dim: \(d) is not supported by TurboQuant (the Hadamard rotation needs a power of two: \(headDims.map(String.init).joined(separator: ", ")))")
    }

    static func checkStream(_ s: UInt32) throws {
        try require(s == UInt32(PYFA_TQ_STREAM_K) || s == UInt32(PYFA_TQ_STREAM_V),
                    "stream: \(s) must be \(PYFA_TQ_STREAM_K) (K) or \(PYFA_TQ_STREAM_V) (V)")
    }

    static func rowBytes(_ headDim: UInt32, _ bits: UInt32) -> Int { Int(headDim) * Int(bits) / 8 }

    /// The library's f32 codebook, passed to kernels as inline bytes.
    static func codebookArg(_ bits: UInt32) throws -> KernelArg {
        guard let table = pyfa_turboquant_codebook_table(bits) else {
            throw PyfaError.invalid("bits: \(bits) is not a TurboQuant bit width (2, 3, 4 or 8)")
        }
        return .bytes(Array(UnsafeRawBufferPointer(start: table, count: 4 << Int(bits))))
    }

    /// A cache's codes and scales for `sequences` sequences.
    static func checkCache(_ codes: Buffer?, _ scales: Buffer?, _ prefix: String, sequences: Int, heads: UInt32,
                           capacity: UInt32, headDim: UInt32, bits: UInt32) throws -> (Buffer, Buffer) {
        let rows = try checkedProduct([sequences, Int(heads), Int(capacity)], what: "\(prefix)codes")
        let c = try Check.buffer(codes, "\(prefix)codes", dtypes: [.u8],
                                 elements: checkedProduct([rows, rowBytes(headDim, bits)], what: "\(prefix)codes"), rows: true)
        let s = try Check.buffer(scales, "\(prefix)scales", dtypes: [.f32], elements: rows)
        return (c, s)
    }

    // MARK: encoder / decoder

    /// The rules hadamard_quantize_kv and tq_dequantize_kv share.
    static func checkRowShape(heads: UInt32, headDim: UInt32, bits: UInt32, stream: UInt32, capacity: UInt32) throws {
        try require(heads > 0, "num_kv_heads: must be > 0")
        try checkHeadDim(headDim)
        try checkBits(bits, "bits")
        try checkStream(stream)
        try require(capacity > 0, "kv_capacity: must be > 0")
    }

    /// `position`: as KVAppend.encode's (nil: p.write_pos; else a cache's device state).
    /// On backends that append in one dispatch
    /// (BackendPlan.appendsInOneDispatch): `v` (V's rows, codes and scales; same src dtype and
    /// bits) joins the dispatch with the V sign stream, and with `advance` and `tickets` the
    /// dispatch advances the state at `position` itself, as KVAppend.encode's does.
    public static func encodeQuantize(_ encoder: CommandEncoder, _ p: pyfa_tq_quantize_params,
                                      src: Buffer?, codes: Buffer?, scales: Buffer?, position: Buffer? = nil,
                                      v: (src: Buffer, codes: Buffer, scales: Buffer)? = nil,
                                      advance: pyfa_kv_advance_params? = nil, tickets: Buffer? = nil) throws {
        try checkRowShape(heads: p.num_kv_heads, headDim: p.head_dim, bits: p.bits, stream: p.stream,
                          capacity: p.kv_capacity)
        try require(p.kv_capacity <= UInt32(Int32.max),
                    "kv_capacity: \(p.kv_capacity) must be at most \(Int32.max) (slots are int32 positions)")
        try require(p.num_tokens > 0 && p.num_tokens <= p.kv_capacity,
                    "num_tokens: \(p.num_tokens) must be in 1...kv_capacity (\(p.kv_capacity)); one dispatch writes each slot at most once")
        try require(p.write_pos < p.kv_capacity, "write_pos: \(p.write_pos) must be < kv_capacity (\(p.kv_capacity))")
        try checkNormCorrection(p.norm_correction)
        let srcElements = try checkedProduct([Int(p.num_tokens), Int(p.num_kv_heads), Int(p.head_dim)], what: "src")
        let src = try Check.buffer(src, "src", dtypes: floatTypes, elements: srcElements, rows: true)
        let (c, s) = try checkCache(codes, scales, "", sequences: Int(p.sequence) + 1, heads: p.num_kv_heads,
                                    capacity: p.kv_capacity, headDim: p.head_dim, bits: p.bits)
        try Check.sameDevice([src, c, s], encoder.device)
        var args: [SlotArg] = [
            .at(PYFA_TQ_QUANT_ARG_PARAMS, .value(p)),
            .at(PYFA_TQ_QUANT_ARG_SRC, .buffer(src)),
            .at(PYFA_TQ_QUANT_ARG_CODES, .buffer(c)),
            .at(PYFA_TQ_QUANT_ARG_SCALES, .buffer(s)),
            .at(PYFA_TQ_QUANT_ARG_CODEBOOK, try codebookArg(p.bits)),
            .at(PYFA_TQ_QUANT_ARG_POSITION, KVAppend.positionArg(position, p.write_pos)),
        ]
        if v != nil || advance != nil || tickets != nil {
            try require(encoder.device.backend.plan.appendsInOneDispatch,
                        "v: this backend encodes K and V in dispatches of their own")
        }
        if let v {
            try require(p.stream == UInt32(PYFA_TQ_STREAM_K), "stream: \(p.stream) must be K's (\(PYFA_TQ_STREAM_K)) when V joins the dispatch")
            let vs = try Check.buffer(v.src, "src_v", dtypes: [src.dtype], elements: srcElements, rows: true)
            let (vc, vsc) = try checkCache(v.codes, v.scales, "v_", sequences: Int(p.sequence) + 1, heads: p.num_kv_heads,
                                           capacity: p.kv_capacity, headDim: p.head_dim, bits: p.bits)
            try Check.sameDevice([vs, vc, vsc], encoder.device)
            for (b, name) in [(vc, "v_codes"), (vsc, "v_scales")] {
                try Check.noOverlap(b, name, inputs: [("src", src), ("src_v", vs), ("codes", c), ("scales", s)])
            }
            try Check.noOverlap(vc, "v_codes", inputs: [("v_scales", vsc)])
            try Check.noOverlap(c, "codes", inputs: [("src_v", vs)])  // K's blocks write while V's read
            try Check.noOverlap(s, "scales", inputs: [("src_v", vs)])
            args += [.at(PYFA_TQ_QUANT_ARG_SRC_V, .buffer(vs)), .at(PYFA_TQ_QUANT_ARG_CODES_V, .buffer(vc)),
                     .at(PYFA_TQ_QUANT_ARG_SCALES_V, .buffer(vsc))]
        }
        args += try KVAppend.advanceArgs(advance, tickets: tickets, state: position, capacity: p.kv_capacity,
                                         numTokens: p.num_tokens,
                                         slots: (PYFA_TQ_QUANT_ARG_ADVANCE, PYFA_TQ_QUANT_ARG_TICKETS))
        let pipeline = try encoder.device.registry.pipeline("hadamard_quantize_kv",
                                                            constants: quantizeConstants(src: src.dtype, bits: p.bits, headDim: p.head_dim))
        let g = encoder.device.backend.plan.turboquantRows(headDim: p.head_dim)
        encoder.setOpKind(.quantize)
        try encoder.dispatch(pipeline, args: args, grid: (p.num_tokens, p.num_kv_heads, v == nil ? 1 : 2),
                             threads: (g.threads, 1, 1), threadgroupMemory: g.threadgroupMemory)
    }

    public static func encodeDequantize(_ encoder: CommandEncoder, _ p: pyfa_tq_dequantize_params,
                                        codes: Buffer?, scales: Buffer?, out: Buffer?) throws {
        try checkRowShape(heads: p.num_kv_heads, headDim: p.head_dim, bits: p.bits, stream: p.stream,
                          capacity: p.kv_capacity)
        try require(p.num_tokens > 0 && p.num_tokens <= p.kv_capacity,
                    "num_tokens: \(p.num_tokens) must be in 1...kv_capacity (\(p.kv_capacity))")
        try require(p.first_slot < p.kv_capacity, "first_slot: \(p.first_slot) must be < kv_capacity (\(p.kv_capacity))")
        let (c, s) = try checkCache(codes, scales, "", sequences: Int(p.sequence) + 1, heads: p.num_kv_heads,
                                    capacity: p.kv_capacity, headDim: p.head_dim, bits: p.bits)
        let outElements = try checkedProduct([Int(p.num_tokens), Int(p.num_kv_heads), Int(p.head_dim)], what: "out")
        let out = try Check.buffer(out, "out", dtypes: [.f32], elements: outElements, rows: true)
        try Check.sameDevice([c, s, out], encoder.device)
        let pipeline = try encoder.device.registry.pipeline("tq_dequantize_kv",
                                                            constants: dequantizeConstants(bits: p.bits, headDim: p.head_dim))
        let g = encoder.device.backend.plan.turboquantRows(headDim: p.head_dim)
        encoder.setOpKind(.quantize)
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_TQ_DEQUANT_ARG_PARAMS, .value(p)),
            .at(PYFA_TQ_DEQUANT_ARG_CODES, .buffer(c)),
            .at(PYFA_TQ_DEQUANT_ARG_SCALES, .buffer(s)),
            .at(PYFA_TQ_DEQUANT_ARG_CODEBOOK, try codebookArg(p.bits)),
            .at(PYFA_TQ_DEQUANT_ARG_OUT, .buffer(out)),
        ], grid: (p.num_tokens, p.num_kv_heads, 1), threads: (g.threads, 1, 1), threadgroupMemory: g.threadgroupMemory)
    }

    static func quantizeConstants(src: DType, bits: UInt32, headDim: UInt32) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_TQ_QUANT_FC_COUNT, [
            PYFA_TQ_QUANT_FC_SRC_DTYPE: src.rawValue,
            PYFA_TQ_QUANT_FC_BITS: Int32(bits),
            PYFA_TQ_QUANT_FC_HEAD_DIM: Int32(headDim),
        ])
    }

    static func dequantizeConstants(bits: UInt32, headDim: UInt32) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_TQ_DEQUANT_FC_COUNT, [
            PYFA_TQ_DEQUANT_FC_BITS: Int32(bits),
            PYFA_TQ_DEQUANT_FC_HEAD_DIM: Int32(headDim),
        ])
    }

    static func fwhtConstants(src: DType, headDim: UInt32, dst: DType) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_TQ_FWHT_FC_COUNT, [
            PYFA_TQ_FWHT_FC_SRC_DTYPE: src.rawValue,
            PYFA_TQ_FWHT_FC_HEAD_DIM: Int32(headDim),
            PYFA_TQ_FWHT_FC_DST_DTYPE: dst.rawValue,
        ])
    }

    // MARK: FWHT

    /// pyfa_fwht writes f32 rows (its public contract); the kernels also store
    /// f16 / bf16, which TurboQuant decode's undo uses for its output.
    static let fwhtKernels = ["fwht", "fwht_sign_premult", "fwht_sign_undo"]

    public static func encodeFwht(_ encoder: CommandEncoder, _ p: pyfa_tq_fwht_params, src: Buffer?, dst: Buffer?) throws {
        try require(p.transform <= UInt32(PYFA_TQ_FWHT_SIGN_UNDO),
                    "transform: \(p.transform) must be 0 (fwht), 1 (fwht_sign_premult) or 2 (fwht_sign_undo)")
        try checkHeadDim(p.head_dim)
        try checkStream(p.stream)
        try require(p.nrows > 0, "nrows: must be > 0")
        let elements = try checkedProduct([Int(p.nrows), Int(p.head_dim)], what: "src")
        let src = try Check.buffer(src, "src", dtypes: floatTypes, elements: elements, rows: true)
        let dst = try Check.buffer(dst, "dst", dtypes: [.f32], elements: elements, rows: true)
        try Check.sameDevice([src, dst], encoder.device)
        try encodeFwht(encoder, p, src: .buffer(src), srcType: src.dtype, dst: .buffer(dst), dstType: dst.dtype)
    }

    static func encodeFwht(_ encoder: CommandEncoder, _ p: pyfa_tq_fwht_params, src: KernelArg, srcType: DType,
                           dst: KernelArg, dstType: DType) throws {
        let pipeline = try encoder.device.registry.pipeline(
            fwhtKernels[Int(p.transform)], constants: fwhtConstants(src: srcType, headDim: p.head_dim, dst: dstType))
        let g = encoder.device.backend.plan.turboquantRows(headDim: p.head_dim)
        encoder.setOpKind(.transform)
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_TQ_FWHT_ARG_PARAMS, .value(p)),
            .at(PYFA_TQ_FWHT_ARG_SRC, src),
            .at(PYFA_TQ_FWHT_ARG_DST, dst),
        ], grid: (p.nrows, 1, 1), threads: (g.threads, 1, 1), threadgroupMemory: g.threadgroupMemory)
    }
}
