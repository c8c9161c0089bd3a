import CPyfa
import PyfaShaderCommon

/// Combines two attentions of the same query rows over disjoint key sets from
/// their outputs and LSEs (chunked prefill, cascade and context-parallel
/// attention); the math of the decode reduce. out is in o_a's dtype or, on
/// request, f32. Contract: flash_attn_prefill_params.h.
public enum MergeAttentionStates {
    static let kernel = "merge_attention_states"

    static func constants(dtype: DType, hasLse: Bool, out: DType) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_MERGE_FC_COUNT, [
            PYFA_MERGE_FC_DTYPE: dtype.rawValue,
            PYFA_MERGE_FC_HAS_LSE: hasLse ? 1 : 0,
            PYFA_MERGE_FC_OUT_DTYPE: out.rawValue,
        ])
    }

    public static func encode(_ encoder: CommandEncoder, _ p: pyfa_merge_attn_params, oA: Buffer?, lseA: Buffer?,
                              oB: Buffer?, lseB: Buffer?, out: Buffer?, lseOut: Buffer?) throws {
        try require(p.batch > 0, "batch: must be > 0")
        try require(p.num_heads > 0, "num_heads: must be > 0")
        try require(p.seq_len > 0, "seq_len: must be > 0")
        try require(p.head_dim > 0 && p.head_dim % 8 == 0 && p.head_dim <= UInt32(PYFA_MAX_HEAD_DIM),
                    "head_dim: \(p.head_dim) must be a positive multiple of 8 up to \(PYFA_MAX_HEAD_DIM)")
        let s = p.o_strides
        try require(s.0 >= 0 && s.1 >= 0 && s.2 >= 0, "o_strides: strides must be >= 0, got \(s)")
        let rows = (p.batch, p.num_heads, p.seq_len)
        let elements = try FlashAttnPrefill.extent(s, rows, inner: Int(p.head_dim), "o")
        guard let oA else { throw PyfaError.invalid("o_a: buffer is NULL") }
        try Check.buffer(oA, "o_a", dtypes: FlashAttnPrefill.floatTypes, elements: elements, rows: true)
        let oB = try Check.buffer(oB, "o_b", dtypes: [oA.dtype], elements: elements, rows: true)
        let out = try Check.buffer(out, "out", dtypes: FlashAttnPrefill.outTypes(oA.dtype), elements: elements, rows: true)
        let nrows = try checkedProduct([Int(p.batch), Int(p.num_heads), Int(p.seq_len)], what: "lse_a")
        let lseA = try Check.buffer(lseA, "lse_a", dtypes: [.f32], elements: nrows)
        let lseB = try Check.buffer(lseB, "lse_b", dtypes: [.f32], elements: nrows)
        if let lseOut { try Check.buffer(lseOut, "lse_out", dtypes: [.f32], elements: nrows) }
        try Check.sameDevice([oA, lseA, oB, lseB, out, lseOut], encoder.device)

        let pipeline = try encoder.device.registry.pipeline(
            kernel, constants: constants(dtype: oA.dtype, hasLse: lseOut != nil, out: out.dtype))
        let args: [SlotArg] = [
            .at(PYFA_MERGE_ARG_PARAMS, .value(p)),
            .at(PYFA_MERGE_ARG_O_A, .buffer(oA)),
            .at(PYFA_MERGE_ARG_LSE_A, .buffer(lseA)),
            .at(PYFA_MERGE_ARG_O_B, .buffer(oB)),
            .at(PYFA_MERGE_ARG_LSE_B, .buffer(lseB)),
            .at(PYFA_MERGE_ARG_OUT, .buffer(out)),
            // Bound even when absent (Metal requires every declared argument):
            // lse_a stands in, and PYFA_MERGE_FC_HAS_LSE = 0 keeps it unwritten.
            .at(PYFA_MERGE_ARG_LSE_OUT, .buffer(lseOut ?? lseA)),
        ]
        let aux = encoder.device.backend.plan.prefillAux(headDim: p.head_dim)
        encoder.setOpKind(.reduce)
        try encoder.dispatch(pipeline, args: args, grid: (p.seq_len, p.num_heads, p.batch),
                             threads: (aux.threads, 1, 1), threadgroupMemory: aux.threadgroupMemory)
    }
}
