import CPyfa
import PyfaShaderCommon

/// Appends into paged KV pools: dense rows (kv_append_paged) and TurboQuant
/// rows (tq_quantize_paged), K and V of a batch in one dispatch each op.
/// Contracts: paged_kv_params.h.
public enum PagedAppend {
    static let denseKernel = "kv_append_paged"
    static let turboQuantKernel = "tq_quantize_paged"

    // MARK: shared rules

    /// Pool geometry: page_size a power of two in 1...PYFA_MAX_PAGE_SIZE, a
    /// known layout, num_pages >= 1, and every pool row index fitting 32 bits.
    /// Returns the pool's rows (num_pages * page_size * num_kv_heads).
    static func checkPages(_ pages: pyfa_kv_pages, numKvHeads: UInt32) throws -> Int {
        let ps = pages.page_size
        try require(ps >= 1 && ps <= UInt32(PYFA_MAX_PAGE_SIZE) && ps & (ps - 1) == 0,
                    "page_size: \(ps) must be a power of two in 1...\(PYFA_MAX_PAGE_SIZE)")
        try require(pages.num_pages >= 1, "num_pages: must be >= 1")
        try require(pages.layout == UInt32(PYFA_PAGES_NHD) || pages.layout == UInt32(PYFA_PAGES_HND),
                    "page_layout: \(pages.layout) must be \(PYFA_PAGES_NHD) (NHD) or \(PYFA_PAGES_HND) (HND)")
        try require(numKvHeads > 0, "num_kv_heads: must be > 0")
        // num_pages * page_size <= 2^42; the product with num_kv_heads may pass 64 bits.
        let (rows, overflow) = (UInt64(pages.num_pages) * UInt64(ps)).multipliedReportingOverflow(by: UInt64(numKvHeads))
        try require(!overflow && rows <= UInt64(UInt32.max),
                    "num_pages: num_pages * page_size * num_kv_heads = \(overflow ? "more than 2^64" : String(rows)) must fit 32 bits (at most \(UInt32.max))")
        return Int(rows)
    }

    /// slot_mapping: int32 [num_tokens], host values (sent with the launch) or
    /// memory. Where the host can read them, each value is a slot of the pool
    /// or negative (padding), and no two tokens name one slot: a duplicate
    /// would leave the row to whichever write lands last. Device values are
    /// only clamped by the kernels (out of range: nothing written; duplicates:
    /// the last writer is unspecified).
    static func checkSlotMapping(_ v: SequenceValues?, numTokens: Int, slots: Int) throws -> SequenceValues {
        let v = try SequenceValues.check(v, "slot_mapping", count: numTokens)
        if case .buffer(let b) = v { try Check.buffer(b, "slot_mapping", dtypes: [.i32], elements: numTokens) }
        guard let values = try v.hostValues(count: numTokens, "slot_mapping") else { return v }
        var owner = [Int32: Int](minimumCapacity: numTokens)
        for (i, s) in values.enumerated() {
            if s < 0 { continue }
            try require(Int(s) < slots,
                        "slot_mapping[\(i)]: slot \(s) is outside the pool (num_pages * page_size = \(slots)); negative values mark padding")
            if let j = owner.updateValue(i, forKey: s) {
                throw PyfaError.invalid("slot_mapping[\(i)]: slot \(s) is also token \(j)'s; each slot takes at most one token per append")
            }
        }
        return v
    }

    /// src_k and src_v: one float dtype, num_tokens x num_kv_heads x head_dim each.
    static func checkSources(_ k: Buffer?, _ v: Buffer?, elements: Int) throws -> (Buffer, Buffer) {
        let k = try Check.buffer(k, "src_k", dtypes: attentionFloatTypes, elements: elements, rows: true)
        let v = try Check.buffer(v, "src_v", dtypes: attentionFloatTypes, elements: elements, rows: true)
        try require(v.dtype == k.dtype, "src_v: dtype \(v.dtype.name) must equal src_k's (\(k.dtype.name))")
        return (k, v)
    }

    /// Outputs overlap nothing the kernel reads, nor each other.
    static func checkNoOverlap(outputs: [(String, Buffer)], inputs: [(String, Buffer?)]) throws {
        for (i, (name, out)) in outputs.enumerated() {
            let others = outputs.enumerated().filter { $0.offset != i }.map { ($0.element.0, Optional($0.element.1)) }
            try Check.noOverlap(out, name, inputs: inputs + others)
        }
    }

    // MARK: dense

    static func denseConstants(src: DType, cache: DType) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_KV_APPEND_PAGED_FC_COUNT, [
            PYFA_KV_APPEND_PAGED_FC_SRC_DTYPE: src.rawValue,
            PYFA_KV_APPEND_PAGED_FC_CACHE_DTYPE: cache.rawValue,
        ])
    }

    public static func encodeDense(_ encoder: CommandEncoder, _ p: pyfa_kv_append_paged_params, srcK: Buffer?,
                                   srcV: Buffer?, kPages: Buffer?, vPages: Buffer?, slotMapping: SequenceValues?) throws {
        let rows = try checkPages(p.pages, numKvHeads: p.num_kv_heads)
        try require(p.head_dim > 0, "head_dim: must be > 0")
        try require(p.num_tokens > 0, "num_tokens: must be > 0")
        try require(p.reserved == 0, "reserved: must be 0")
        let srcElements = try checkedProduct([Int(p.num_tokens), Int(p.num_kv_heads), Int(p.head_dim)], what: "src_k")
        let poolElements = try checkedProduct([rows, Int(p.head_dim)], what: "k_pages")
        let (sk, sv) = try checkSources(srcK, srcV, elements: srcElements)
        let kp = try Check.buffer(kPages, "k_pages", dtypes: attentionFloatTypes, elements: poolElements, rows: true)
        let vp = try Check.buffer(vPages, "v_pages", dtypes: attentionFloatTypes, elements: poolElements, rows: true)
        try require(vp.dtype == kp.dtype, "v_pages: dtype \(vp.dtype.name) must equal k_pages' (\(kp.dtype.name))")
        let slots = try checkSlotMapping(slotMapping, numTokens: Int(p.num_tokens),
                                         slots: Int(p.pages.num_pages) * Int(p.pages.page_size))
        try Check.sameDevice([sk, sv, kp, vp, slots.buffer], encoder.device)
        try checkNoOverlap(outputs: [("k_pages", kp), ("v_pages", vp)],
                           inputs: [("src_k", sk), ("src_v", sv), ("slot_mapping", slots.buffer)])
        let pipeline = try encoder.device.registry.pipeline(denseKernel, constants: denseConstants(src: sk.dtype,
                                                                                                  cache: kp.dtype))
        encoder.setOpKind(.other)
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_KV_APPEND_PAGED_ARG_PARAMS, .value(p)),
            .at(PYFA_KV_APPEND_PAGED_ARG_SRC_K, .buffer(sk)),
            .at(PYFA_KV_APPEND_PAGED_ARG_SRC_V, .buffer(sv)),
            .at(PYFA_KV_APPEND_PAGED_ARG_K_PAGES, .buffer(kp)),
            .at(PYFA_KV_APPEND_PAGED_ARG_V_PAGES, .buffer(vp)),
            .at(PYFA_KV_APPEND_PAGED_ARG_SLOT_MAPPING, slots.argument),
        ], grid: (p.num_tokens, p.num_kv_heads, 2),
           threads: (encoder.device.backend.plan.kvAppend(headDim: p.head_dim), 1, 1))
    }

    // MARK: TurboQuant

    static func turboQuantConstants(src: DType, kBits: UInt32, vBits: UInt32, headDim: UInt32) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_TQ_QUANT_PAGED_FC_COUNT, [
            PYFA_TQ_QUANT_PAGED_FC_SRC_DTYPE: src.rawValue,
            PYFA_TQ_QUANT_PAGED_FC_K_BITS: Int32(kBits),
            PYFA_TQ_QUANT_PAGED_FC_HEAD_DIM: Int32(headDim),
            PYFA_TQ_QUANT_PAGED_FC_V_BITS: Int32(vBits),
        ])
    }

    public static func encodeTurboQuant(_ encoder: CommandEncoder, _ p: pyfa_tq_quantize_paged_params,
                                        srcK: Buffer?, srcV: Buffer?, kCodes: Buffer?, kScales: Buffer?,
                                        vCodes: Buffer?, vScales: Buffer?, slotMapping: SequenceValues?) throws {
        let rows = try checkPages(p.pages, numKvHeads: p.num_kv_heads)
        try TurboQuant.checkCodecOptions(headDim: p.head_dim, kBits: p.k_bits, vBits: p.v_bits,
                                         normCorrection: p.norm_correction)
        try require(p.num_tokens > 0, "num_tokens: must be > 0")
        let srcElements = try checkedProduct([Int(p.num_tokens), Int(p.num_kv_heads), Int(p.head_dim)], what: "src_k")
        let (sk, sv) = try checkSources(srcK, srcV, elements: srcElements)
        let kc = try Check.buffer(kCodes, "k_codes", dtypes: [.u8],
                                  elements: checkedProduct([rows, TurboQuant.rowBytes(p.head_dim, p.k_bits)], what: "k_codes"), rows: true)
        let vc = try Check.buffer(vCodes, "v_codes", dtypes: [.u8],
                                  elements: checkedProduct([rows, TurboQuant.rowBytes(p.head_dim, p.v_bits)], what: "v_codes"), rows: true)
        let ks = try Check.buffer(kScales, "k_scales", dtypes: [.f32], elements: rows)
        let vs = try Check.buffer(vScales, "v_scales", dtypes: [.f32], elements: rows)
        let slots = try checkSlotMapping(slotMapping, numTokens: Int(p.num_tokens),
                                         slots: Int(p.pages.num_pages) * Int(p.pages.page_size))
        try Check.sameDevice([sk, sv, kc, ks, vc, vs, slots.buffer], encoder.device)
        try checkNoOverlap(outputs: [("k_codes", kc), ("k_scales", ks), ("v_codes", vc), ("v_scales", vs)],
                           inputs: [("src_k", sk), ("src_v", sv), ("slot_mapping", slots.buffer)])
        let pipeline = try encoder.device.registry.pipeline(
            turboQuantKernel, constants: turboQuantConstants(src: sk.dtype, kBits: p.k_bits, vBits: p.v_bits,
                                                             headDim: p.head_dim))
        let g = encoder.device.backend.plan.turboquantRows(headDim: p.head_dim)
        encoder.setOpKind(.quantize)
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_TQ_QUANT_PAGED_ARG_PARAMS, .value(p)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_SRC_K, .buffer(sk)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_SRC_V, .buffer(sv)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_K_CODES, .buffer(kc)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_K_SCALES, .buffer(ks)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_V_CODES, .buffer(vc)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_V_SCALES, .buffer(vs)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_SLOT_MAPPING, slots.argument),
            .at(PYFA_TQ_QUANT_PAGED_ARG_K_CODEBOOK, try TurboQuant.codebookArg(p.k_bits)),
            .at(PYFA_TQ_QUANT_PAGED_ARG_V_CODEBOOK, try TurboQuant.codebookArg(p.v_bits)),
        ], grid: (p.num_tokens, p.num_kv_heads, 2), threads: (g.threads, 1, 1), threadgroupMemory: g.threadgroupMemory)
    }
}
