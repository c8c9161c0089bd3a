import CPyfa
import PyfaShaderCommon

/// Packed prefill (varlen or paged), prepared (pyfa_varlen_prefill_plan_desc):
/// the mode, shapes, strides, pool geometry and options are the plan's; a run
/// binds q, k, v (or the pools), the metadata, out and lse, and the packed
/// lengths (total_q, total_k), which may change from run to run.
public final class PackedPrefillPlan: OpPlan {
    let params: pyfa_flash_attn_prefill_params
    let mode: Int32
    let pages: pyfa_kv_pages
    let dtype: DType, outDType: DType
    let returnLse: Bool

    public init(device: Device, desc: pyfa_varlen_prefill_plan_desc) throws {
        var p = desc.attn
        mode = Int32(bitPattern: desc.kv_mode)
        pages = desc.pages
        dtype = try DType(code: desc.dtype)
        outDType = try DType(code: desc.out_dtype)
        try require(FlashAttnPrefill.floatTypes.contains(dtype), "dtype: \(dtype.name) not accepted (expected f32, f16 or bf16)")
        try require(FlashAttnPrefill.outTypes(dtype).contains(outDType),
                    "out_dtype: \(outDType.name) must be the I/O dtype (\(dtype.name)) or f32")
        try require(desc.return_lse <= 1, "return_lse: must be 0 or 1")
        returnLse = desc.return_lse == 1
        // total_q / total_k are the run's; 1 stands in for the checks of the structs.
        let probe = pyfa_prefill_packed(total_q: 1, total_k: mode == PYFA_PREFILL_KV_VARLEN ? 1 : 0, reserved: (0, 0))
        try FlashAttnPrefillPacked.validate(p, mode: mode, packed: probe, pages: pages)
        _ = try FlashAttnPrefill.plan(device, &p, dtype: dtype, kvMode: mode)
        try FlashAttnPrefillPacked.checkTiles(p)
        params = p
        try super.init(device: device, workspaceBytes: 0)
        // Compiled now, so no run compiles.
        _ = try device.registry.pipeline(FlashAttnPrefill.kernel, constants: FlashAttnPrefill.prefillConstants(
            dtype: dtype, headDim: p.head_dim, blockQ: p.block_q, blockK: p.block_k, maskKind: nil,
            causal: p.causal != 0, window: p.window > 0, softcap: p.softcap > 0, blk: false, lse: returnLse,
            out: outDType, kvMode: mode))
    }

    public func run(_ encoder: CommandEncoder, args a: pyfa_varlen_prefill_run_args) throws {
        let p = params
        let lse = TensorRef(a.lse)
        try checkRun(encoder, lse: lse, returnLse: returnLse)
        let packed = pyfa_prefill_packed(total_q: a.total_q, total_k: a.total_k, reserved: (0, 0))
        try FlashAttnPrefillPacked.validate(p, mode: mode, packed: packed, pages: pages)
        let paged = mode == PYFA_PREFILL_KV_PAGED
        let B = Int(p.batch), D = p.head_dim
        let ext = FlashAttnPrefillPacked.packedExtent
        let kvElements: ((Int64, Int64, Int64)) throws -> Int = { s in
            paged ? try checkedProduct([Int(self.pages.num_pages), Int(self.pages.page_size), Int(p.num_kv_heads), Int(D)],
                                       what: "k_pages")
                  : try ext(s, p.num_kv_heads, a.total_k, D, "k")
        }
        try FlashAttnPrefillPacked.encode(
            encoder, p, mode: mode, packed: packed, pages: pages,
            q: bind(TensorRef(a.q), "q", dtype: dtype, elements: ext(p.q_strides, p.num_heads, a.total_q, D, "q")),
            k: bind(TensorRef(a.k), paged ? "k_pages" : "k", dtype: dtype, elements: kvElements(p.k_strides)),
            v: bind(TensorRef(a.v), paged ? "v_pages" : "v", dtype: dtype, elements: kvElements(p.v_strides)),
            cuSeqlensQ: bind(TensorRef(a.cu_seqlens_q), "cu_seqlens_q", dtype: .i32, elements: B + 1, perElement: true),
            seqK: bind(TensorRef(a.seq_k), paged ? "kv_len" : "cu_seqlens_k", dtype: .i32, elements: paged ? B : B + 1,
                       perElement: true),
            blockTable: paged ? bind(TensorRef(a.block_table), "block_table", dtype: .i32,
                                     elements: checkedProduct([B, Int(pages.pages_per_seq)], what: "block_table"),
                                     perElement: true) : nil,
            out: bind(TensorRef(a.out), "out", dtype: outDType, elements: ext(p.out_strides, p.num_heads, a.total_q, D, "out")),
            lse: bindOptional(lse, "lse", dtype: .f32, elements: checkedProduct([Int(p.num_heads), Int(a.total_q)], what: "lse"),
                              perElement: true))
    }
}
