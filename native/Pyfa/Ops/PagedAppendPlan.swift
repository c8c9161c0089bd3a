import CPyfa
import PyfaShaderCommon

/// A paged append prepared (pyfa_paged_append_plan_desc): the pool geometry,
/// dtypes and codec options are checked once and the kernel compiled; a run
/// binds the memory and num_tokens and records the op through the same
/// dispatcher as the buffer form (PagedAppend), so it checks the same rules.
public final class PagedAppendPlan: OpPlan {
    let desc: pyfa_paged_append_plan_desc
    let srcDType: DType, poolDType: DType
    var turboQuant: Bool { desc.k_bits != 0 }
    let poolRows: Int

    public init(device: Device, desc: pyfa_paged_append_plan_desc) throws {
        try require(desc.reserved == 0, "reserved: must be 0")
        srcDType = try DType(code: desc.src_dtype)
        poolDType = try DType(code: desc.pool_dtype)
        try require(attentionFloatTypes.contains(srcDType), "src_dtype: \(srcDType.name) is not one of f32, f16, bf16")
        poolRows = try PagedAppend.checkPages(desc.pages, numKvHeads: desc.num_kv_heads)
        self.desc = desc
        try super.init(device: device, workspaceBytes: 0)
        if desc.k_bits != 0 {
            try TurboQuant.checkCodecOptions(headDim: desc.head_dim, kBits: desc.k_bits, vBits: desc.v_bits,
                                             normCorrection: desc.norm_correction)
            try require(poolDType == .u8, "pool_dtype: \(poolDType.name) must be u8 for TurboQuant pools (k_bits != 0)")
            _ = try device.registry.pipeline(PagedAppend.turboQuantKernel, constants: PagedAppend.turboQuantConstants(
                src: srcDType, kBits: desc.k_bits, vBits: desc.v_bits, headDim: desc.head_dim))
        } else {
            try require(desc.head_dim > 0, "head_dim: must be > 0")
            try require(desc.v_bits == 0 && desc.norm_correction == 0 && desc.seed_lo == 0 && desc.seed_hi == 0,
                        "v_bits: dense pools (k_bits 0) take no TurboQuant options: v_bits, norm_correction and seed must be 0")
            try require(attentionFloatTypes.contains(poolDType),
                        "pool_dtype: \(poolDType.name) is not one of f32, f16, bf16 (dense pools)")
            _ = try device.registry.pipeline(PagedAppend.denseKernel,
                                             constants: PagedAppend.denseConstants(src: srcDType, cache: poolDType))
        }
    }

    public func run(_ encoder: CommandEncoder, k: TensorRef, v: TensorRef, kPages: TensorRef, vPages: TensorRef,
                    kScales: TensorRef, vScales: TensorRef, slotMapping: SequenceRef, numTokens: UInt32) throws {
        try require(encoder.device === device, "encoder: belongs to another device than the plan")
        try require(numTokens > 0, "num_tokens: must be > 0")
        let rowElements = try checkedProduct([Int(numTokens), Int(desc.num_kv_heads), Int(desc.head_dim)], what: "k")
        let sk = try bind(k, "k", dtype: srcDType, elements: rowElements)
        let sv = try bind(v, "v", dtype: srcDType, elements: rowElements)
        let slots = try sequence(slotMapping, "slot_mapping", count: Int(numTokens))
        if turboQuant {
            let kRow = TurboQuant.rowBytes(desc.head_dim, desc.k_bits), vRow = TurboQuant.rowBytes(desc.head_dim, desc.v_bits)
            let p = pyfa_tq_quantize_paged_params(pages: desc.pages, num_tokens: numTokens, num_kv_heads: desc.num_kv_heads,
                                                  head_dim: desc.head_dim, k_bits: desc.k_bits, v_bits: desc.v_bits,
                                                  norm_correction: desc.norm_correction, seed_lo: desc.seed_lo,
                                                  seed_hi: desc.seed_hi)
            try PagedAppend.encodeTurboQuant(
                encoder, p, srcK: sk, srcV: sv,
                kCodes: bind(kPages, "k_pages", dtype: .u8, elements: poolRows * kRow),
                kScales: bind(kScales, "k_scales", dtype: .f32, elements: poolRows, perElement: true),
                vCodes: bind(vPages, "v_pages", dtype: .u8, elements: poolRows * vRow),
                vScales: bind(vScales, "v_scales", dtype: .f32, elements: poolRows, perElement: true), slotMapping: slots)
        } else {
            try require(kScales.isAbsent && vScales.isAbsent, "k_scales: dense pools take no scales (pass address 0)")
            let p = pyfa_kv_append_paged_params(pages: desc.pages, num_tokens: numTokens, num_kv_heads: desc.num_kv_heads,
                                                head_dim: desc.head_dim, reserved: 0)
            let poolElements = try checkedProduct([poolRows, Int(desc.head_dim)], what: "k_pages")
            try PagedAppend.encodeDense(encoder, p, srcK: sk, srcV: sv,
                                        kPages: bind(kPages, "k_pages", dtype: poolDType, elements: poolElements),
                                        vPages: bind(vPages, "v_pages", dtype: poolDType, elements: poolElements),
                                        slotMapping: slots)
        }
    }
}
