import CPyfa
import PyfaShaderCommon

/// The rules of a paged plan's lengths hints (pyfa_paged_decode_plan_desc):
/// max_kv_len (0 = pages_per_seq * page_size) and split_batch (0 = batch),
/// which size the split as Paged.splitBatch explains.
private func pagedHints(maxKvLen: UInt32, splitBatch: UInt32, capacity: UInt32,
                        batch: UInt32) throws -> (UInt32, UInt32) {
    try require(maxKvLen <= capacity, "max_kv_len: \(maxKvLen) exceeds pages_per_seq * page_size (\(capacity))")
    try require(splitBatch <= batch, "split_batch: \(splitBatch) exceeds batch (\(batch))")
    return (maxKvLen == 0 ? capacity : maxKvLen, splitBatch == 0 ? batch : splitBatch)
}

/// Paged decode over dense pools, prepared (pyfa_paged_decode_plan_desc).
public final class PagedDecodePlan: OpPlan {
    let params: pyfa_flash_attn_vec_params
    let pages: pyfa_kv_pages
    let poolRows: Int
    let qDType: DType, kvDType: DType, outDType: DType
    let returnLse: Bool

    public init(device: Device, desc: pyfa_paged_decode_plan_desc) throws {
        var p = try Paged.params(desc.attn, desc.pages)
        qDType = try DType(code: desc.q_dtype)
        kvDType = try DType(code: desc.kv_dtype)
        outDType = try DType(code: desc.out_dtype)
        try require(FlashAttnVec.floatTypes.contains(qDType), "q_dtype: \(qDType) is not one of f32, f16, bf16")
        try require(FlashAttnVec.floatTypes.contains(outDType), "out_dtype: \(outDType) is not one of f32, f16, bf16")
        try require(desc.return_lse <= 1, "return_lse: \(desc.return_lse) must be 0 or 1")
        returnLse = desc.return_lse == 1
        poolRows = try Paged.validate(desc.pages, numKvHeads: p.num_kv_heads).rows
        let (maxLen, split) = try pagedHints(maxKvLen: desc.max_kv_len, splitBatch: desc.split_batch,
                                             capacity: p.kv_capacity, batch: p.batch)
        let (geometry, tmp) = try FlashAttnVec.plan(device, &p, kvDType: kvDType, maxKvLen: maxLen, splitBatch: split,
                                                    paged: true)
        params = p
        pages = desc.pages
        // As the dense plan: where the backend allows it, the split's last workgroup of each row
        // merges it (one launch; tickets in the plan's memory).
        let merge = FlashAttnVec.mergesLast(device, p, geometry)
        try super.init(device: device, workspaceBytes: tmp, tickets: merge ? Int(p.batch) * Int(p.num_heads) : 0)
        // Compiled now, so no run compiles.
        _ = try device.registry.pipeline(FlashAttnVec.kernel, constants: FlashAttnVec.vecConstants(
            q: qDType, kv: kvDType, headDim: p.head_dim, softcap: p.softcap > 0, direct: p.nwg == 1,
            variant: geometry.variant, out: outDType, lse: returnLse, paged: true, merge: merge))
    }

    public func run(_ encoder: CommandEncoder, q: TensorRef, kPages: TensorRef, vPages: TensorRef, out: TensorRef,
                    lse: TensorRef, workspace: TensorRef, kvLen: SequenceRef, blockTable: SequenceRef) throws {
        let p = params
        try checkRun(encoder, lse: lse, returnLse: returnLse)
        let B = Int(p.batch), H = Int(p.num_heads), D = Int(p.head_dim)
        let pool = try checkedProduct([poolRows, D], what: "k_pages")
        let table = try sequence(blockTable, "block_table", count: Paged.tableCount(batch: p.batch, pages))
        try FlashAttnVec.encode(
            encoder, p, q: bind(q, "q", dtype: qDType, elements: B * H * D),
            k: bind(kPages, "k_pages", dtype: kvDType, elements: pool),
            v: bind(vPages, "v_pages", dtype: kvDType, elements: pool),
            kvLen: sequence(kvLen, "kv_len", count: B), ringStart: nil,
            tmp: self.workspace(workspace, encoder), out: bind(out, "out", dtype: outDType, elements: B * H * D),
            lse: bindOptional(lse, "lse", dtype: .f32, elements: B * H, perElement: true),
            paged: PagedKV(pages: pages, blockTable: table), tickets: tickets(for: workspace))
    }
}

/// Paged decode over TurboQuant pools, prepared (pyfa_paged_tq_decode_plan_desc).
public final class PagedTQDecodePlan: OpPlan {
    let params: pyfa_flash_attn_vec_tq_params
    let pages: pyfa_kv_pages
    let poolRows: Int
    let qDType: DType, outDType: DType
    let returnLse: Bool

    public init(device: Device, desc: pyfa_paged_tq_decode_plan_desc) throws {
        var p = desc.tq
        p.attn = try Paged.params(p.attn, desc.pages)
        qDType = try DType(code: desc.q_dtype)
        outDType = try DType(code: desc.out_dtype)
        try require(TurboQuant.floatTypes.contains(qDType), "q_dtype: \(qDType) is not one of f32, f16, bf16")
        try require(TurboQuant.floatTypes.contains(outDType), "out_dtype: \(outDType) is not one of f32, f16, bf16")
        try require(desc.return_lse <= 1, "return_lse: \(desc.return_lse) must be 0 or 1")
        try require(desc.reserved == 0, "reserved: must be 0")
        returnLse = desc.return_lse == 1
        poolRows = try Paged.validate(desc.pages, numKvHeads: p.attn.num_kv_heads).rows
        let (maxLen, split) = try pagedHints(maxKvLen: desc.max_kv_len, splitBatch: desc.split_batch,
                                             capacity: p.attn.kv_capacity, batch: p.attn.batch)
        let (_, layout) = try FlashAttnVecTQ.plan(device, &p, maxKvLen: maxLen, splitBatch: split)
        params = p
        pages = desc.pages
        try super.init(device: device, workspaceBytes: layout.total)
    }

    public func run(_ encoder: CommandEncoder, q: TensorRef, kCodes: TensorRef, kScales: TensorRef, vCodes: TensorRef,
                    vScales: TensorRef, out: TensorRef, lse: TensorRef, workspace: TensorRef, kvLen: SequenceRef,
                    blockTable: SequenceRef) throws {
        let p = params
        try checkRun(encoder, lse: lse, returnLse: returnLse)
        let a = p.attn
        let B = Int(a.batch), H = Int(a.num_heads), D = Int(a.head_dim)
        let kRow = TurboQuant.rowBytes(a.head_dim, p.k_bits), vRow = TurboQuant.rowBytes(a.head_dim, p.v_bits)
        let table = try sequence(blockTable, "block_table", count: Paged.tableCount(batch: a.batch, pages))
        try FlashAttnVecTQ.encode(
            encoder, p, q: bind(q, "q", dtype: qDType, elements: B * H * D),
            kCodes: bind(kCodes, "k_codes", dtype: .u8, elements: try checkedProduct([poolRows, kRow], what: "k_codes")),
            kScales: bind(kScales, "k_scales", dtype: .f32, elements: poolRows, perElement: true),
            vCodes: bind(vCodes, "v_codes", dtype: .u8, elements: try checkedProduct([poolRows, vRow], what: "v_codes")),
            vScales: bind(vScales, "v_scales", dtype: .f32, elements: poolRows, perElement: true),
            kvLen: sequence(kvLen, "kv_len", count: B), ringStart: nil,
            tmp: self.workspace(workspace, encoder), out: bind(out, "out", dtype: outDType, elements: B * H * D),
            lse: bindOptional(lse, "lse", dtype: .f32, elements: B * H, perElement: true),
            paged: PagedKV(pages: pages, blockTable: table))
    }
}
