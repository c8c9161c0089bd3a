import CPyfa
import PyfaShaderCommon

/// Memory a run binds (pyfa_tensor): the address kernels use and its size.
public struct TensorRef {
    public var address: UInt64
    public var nbytes: UInt64
    public init(address: UInt64, nbytes: UInt64) {
        self.address = address
        self.nbytes = nbytes
    }
    var isAbsent: Bool { address == 0 }
}

/// Per-sequence values a run binds (pyfa_seq_values).
public enum SequenceRef {
    case host([Int32])
    case device(TensorRef)
}

/// What every plan shares: a device, a workspace owned for the plan's life
/// (so runs allocate nothing), and the binding of a run's memory. The op
/// plans below check their options once and keep them; a run checks only
/// what changes from run to run (memory, lengths, kv_capacity) and records
/// the op through the same dispatcher the buffer-based ABI uses.
public class OpPlan {
    public let device: Device
    public let workspaceBytes: Int
    private let ownWorkspace: Buffer?
    /// u32 counters a split decode's workgroups take turns on (flash_attn_vec's tickets),
    /// zeroed once; every dispatch leaves them zero.
    let tickets: Buffer?
    private let lock = Lock()
    private var captured = false
    /// Views of caller memory that earlier runs wrapped, by argument name. A run passing the
    /// same memory again (a decode loop's cache; an allocator handing back the block it just
    /// freed) reuses that Buffer: wrapping costs a few allocations per argument, a large part
    /// of a tiny run. Only plain views are kept (BufferMemory.isPlainView: the CPU's); GPU
    /// backends check or copy at every wrap, so their memory is wrapped anew each run.
    private var wrapped: [(name: String, data: Bool, buffer: Buffer)] = []

    init(device: Device, workspaceBytes: Int, tickets: Int = 0) throws {
        self.device = device
        self.workspaceBytes = workspaceBytes
        ownWorkspace = workspaceBytes == 0 ? nil
            : try device.makeBuffer(dtype: .f32, shape: [workspaceBytes / 4], storage: .private)
        if tickets > 0 {
            let t = try device.makeBuffer(dtype: .u32, shape: [tickets], storage: .private)
            let zeros = [UInt32](repeating: 0, count: tickets)
            try zeros.withUnsafeBytes { try t.write(offset: 0, from: $0.baseAddress!, count: $0.count) }
            self.tickets = t
        } else {
            self.tickets = nil
        }
        pyfa_count(PYFA_COUNT_PLAN)
    }

    deinit {
        // A graph that captured a run may replay after the plan is gone: the
        // workspace and tickets it writes must outlive the plan.
        if captured {
            if let w = ownWorkspace { GraphRetained.keep(w) }
            if let t = tickets { GraphRetained.keep(t) }
        }
    }

    /// Caller memory of `elements` values of `dtype` for one run: an op's rows,
    /// or with `perElement` values its kernels read one at a time (lengths,
    /// tables, masks, scales, lse), which need less alignment (BackendPlan.wrapAlignment).
    func bind(_ t: TensorRef, _ name: String, dtype: DType, elements: Int, perElement: Bool = false) throws -> Buffer {
        let needed = elements * dtype.size  // bounded by the op's validation
        try require(!t.isAbsent || needed == 0, "\(name): address is 0")
        try require(t.nbytes >= UInt64(needed),
                    "\(name): \(t.nbytes) bytes cannot hold \(elements) \(dtype.name) values (\(needed) bytes)")
        let data = !perElement
        if let kept = lock.withLock({ keptBuffer(name, data: data, address: t.address, nbytes: needed, dtype: dtype) }) {
            return kept
        }
        let buffer: Buffer
        do {
            buffer = try device.wrapBuffer(address: t.address, nbytes: needed, dtype: dtype, shape: [elements],
                                           data: data)
        } catch let e as PyfaError {
            throw PyfaError(e.status, "\(name): \(e.message)")  // the backend's refusal, for this argument
        }
        if buffer.memory.isPlainView { lock.withLock { keep(buffer, name, data: data) } }
        return buffer
    }

    /// The Buffer an earlier run wrapped for `name` over exactly this memory, if any (call under `lock`).
    private func keptBuffer(_ name: String, data: Bool, address: UInt64, nbytes: Int, dtype: DType) -> Buffer? {
        for entry in wrapped where entry.name == name {
            let b = entry.buffer
            return entry.data == data && b.deviceAddress == address && b.nbytes == nbytes && b.dtype == dtype
                ? b : nil
        }
        return nil
    }

    /// Keeps `buffer` as `name`'s, replacing the one kept before (call under `lock`).
    private func keep(_ buffer: Buffer, _ name: String, data: Bool) {
        if let i = wrapped.firstIndex(where: { $0.name == name }) {
            wrapped[i] = (name, data, buffer)
        } else {
            wrapped.append((name, data, buffer))
        }
    }

    func bindOptional(_ t: TensorRef, _ name: String, dtype: DType, elements: Int, perElement: Bool = false) throws -> Buffer? {
        t.isAbsent ? nil : try bind(t, name, dtype: dtype, elements: elements, perElement: perElement)
    }

    func sequence(_ s: SequenceRef, _ name: String, count: Int) throws -> SequenceValues {
        switch s {
        case .host(let values):
            return .host(values)
        case .device(let t):
            return .buffer(try bind(t, name, dtype: .i32, elements: count, perElement: true))
        }
    }

    /// What every run checks first: the encoder is the plan's device's, and
    /// lse memory is given exactly when the plan was made with return_lse.
    func checkRun(_ encoder: CommandEncoder, lse: TensorRef, returnLse: Bool) throws {
        try require(encoder.device === device, "encoder: belongs to another device than the plan")
        try require(lse.isAbsent || returnLse, "lse: the plan was made without return_lse")
        try require(!lse.isAbsent || !returnLse, "lse: the plan was made with return_lse; pass its memory")
    }

    /// Marks the plan when `encoder` is being captured: the graph may replay after the plan is
    /// gone, so its workspace and tickets are kept then.
    func noteCapture(_ encoder: CommandEncoder) {
        if encoder.isCapturing { lock.withLock { captured = true } }
    }

    /// The plan's tickets for a run that uses its own workspace; none for a run given a workspace.
    /// The tickets count one run's workgroups at a time, and a caller passes a workspace to run
    /// the plan on several streams at once (pyfa.h): such a run merges without them (a split
    /// decode ends with its reduce dispatch, a prefill runs its blocks whole).
    func tickets(for workspace: TensorRef) -> Buffer? { workspace.isAbsent ? tickets : nil }

    /// The caller's workspace when given, else the plan's own. A run that uses the plan's own
    /// memory (its workspace, and with it its tickets: tickets(for:)) notes a capture.
    func workspace(_ t: TensorRef, _ encoder: CommandEncoder) throws -> Buffer? {
        guard workspaceBytes > 0 else { return nil }
        if t.isAbsent { noteCapture(encoder) }
        if !t.isAbsent { return try bind(t, "workspace", dtype: .f32, elements: workspaceBytes / 4) }
        return ownWorkspace
    }
}

/// Workspaces of freed plans that a graph captured: kept for the process's life.
enum GraphRetained {
    private static let lock = Lock()
    nonisolated(unsafe) private static var kept: [Buffer] = []
    static func keep(_ b: Buffer) { lock.withLock { kept.append(b) } }
}

/// Decode over a dense cache, prepared (pyfa_decode_plan_desc).
public final class DecodePlan: OpPlan {
    let params: pyfa_flash_attn_vec_params
    let qDType: DType, kvDType: DType, outDType: DType
    let returnLse: Bool
    let prepared: FlashAttnVec.Prepared

    public init(device: Device, desc: pyfa_decode_plan_desc) throws {
        var p = desc.attn
        qDType = try DType(code: desc.q_dtype)
        kvDType = try DType(code: desc.kv_dtype)
        outDType = try DType(code: desc.out_dtype)
        try require(FlashAttnVec.floatTypes.contains(qDType), "q_dtype: \(qDType) is not one of f32, f16, bf16")
        try require(FlashAttnVec.floatTypes.contains(outDType), "out_dtype: \(outDType) is not one of f32, f16, bf16")
        try require(desc.return_lse <= 1, "return_lse: \(desc.return_lse) must be 0 or 1")
        try require(desc.reserved == 0, "reserved: must be 0")
        returnLse = desc.return_lse == 1
        let (geometry, tmp) = try FlashAttnVec.plan(device, &p, kvDType: kvDType,
                                                    maxKvLen: desc.max_kv_len == 0 ? p.kv_capacity : desc.max_kv_len)
        params = p
        prepared = try FlashAttnVec.Prepared(device, p, geometry: geometry, tmpBytes: tmp, q: qDType, kv: kvDType,
                                             out: outDType, lse: returnLse)
        try super.init(device: device, workspaceBytes: tmp,
                       tickets: prepared.merges ? Int(p.batch) * Int(p.num_heads) : 0)
    }

    public func run(_ encoder: CommandEncoder, q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef,
                    lse: TensorRef, workspace: TensorRef, kvLen: SequenceRef, ringStart: SequenceRef,
                    kvCapacity: UInt32) throws {
        var p = params
        if kvCapacity != 0 { p.kv_capacity = kvCapacity }
        try FlashAttnVec.validate(p)
        try checkRun(encoder, lse: lse, returnLse: returnLse)
        let B = Int(p.batch), H = Int(p.num_heads), D = Int(p.head_dim)
        let cache = B * Int(p.num_kv_heads) * Int(p.kv_capacity) * D
        try FlashAttnVec.encode(
            encoder, p, q: bind(q, "q", dtype: qDType, elements: B * H * D),
            k: bind(k, "k_cache", dtype: kvDType, elements: cache), v: bind(v, "v_cache", dtype: kvDType, elements: cache),
            kvLen: sequence(kvLen, "kv_len", count: B), ringStart: sequence(ringStart, "ring_start", count: B),
            tmp: self.workspace(workspace, encoder), out: bind(out, "out", dtype: outDType, elements: B * H * D),
            lse: bindOptional(lse, "lse", dtype: .f32, elements: B * H, perElement: true), tickets: tickets(for: workspace),
            prepared: prepared)
    }
}

/// Decode over a TurboQuant cache, prepared (pyfa_tq_decode_plan_desc).
public final class TQDecodePlan: OpPlan {
    let params: pyfa_flash_attn_vec_tq_params
    let qDType: DType, outDType: DType
    let returnLse: Bool
    let prepared: FlashAttnVecTQ.Prepared

    public init(device: Device, desc: pyfa_tq_decode_plan_desc) throws {
        var p = desc.tq
        qDType = try DType(code: desc.q_dtype)
        outDType = try DType(code: desc.out_dtype)
        try require(TurboQuant.floatTypes.contains(qDType), "q_dtype: \(qDType) is not one of f32, f16, bf16")
        try require(TurboQuant.floatTypes.contains(outDType), "out_dtype: \(outDType) is not one of f32, f16, bf16")
        try require(desc.return_lse <= 1, "return_lse: \(desc.return_lse) must be 0 or 1")
        returnLse = desc.return_lse == 1
        let (geometry, layout) = try FlashAttnVecTQ.plan(device, &p,
                                                         maxKvLen: desc.max_kv_len == 0 ? p.attn.kv_capacity : desc.max_kv_len)
        params = p
        prepared = try FlashAttnVecTQ.Prepared(device, p, geometry: geometry, layout: layout, out: outDType,
                                               lse: returnLse)
        try super.init(device: device, workspaceBytes: layout.total,
                       tickets: prepared.merges ? Int(p.attn.batch) * Int(p.attn.num_heads) : 0)
    }

    public func run(_ encoder: CommandEncoder, q: TensorRef, kCodes: TensorRef, kScales: TensorRef, vCodes: TensorRef,
                    vScales: TensorRef, out: TensorRef, lse: TensorRef, workspace: TensorRef, kvLen: SequenceRef,
                    ringStart: SequenceRef, kvCapacity: UInt32) throws {
        var p = params
        if kvCapacity != 0 { p.attn.kv_capacity = kvCapacity }
        try FlashAttnVecTQ.validate(p)
        try checkRun(encoder, lse: lse, returnLse: returnLse)
        let a = p.attn
        let B = Int(a.batch), H = Int(a.num_heads), D = Int(a.head_dim)
        let rows = B * Int(a.num_kv_heads) * Int(a.kv_capacity)
        let kRow = TurboQuant.rowBytes(a.head_dim, p.k_bits), vRow = TurboQuant.rowBytes(a.head_dim, p.v_bits)
        try FlashAttnVecTQ.encode(
            encoder, p, q: bind(q, "q", dtype: qDType, elements: B * H * D),
            kCodes: bind(kCodes, "k_codes", dtype: .u8, elements: try checkedProduct([rows, kRow], what: "k_codes")),
            kScales: bind(kScales, "k_scales", dtype: .f32, elements: rows, perElement: true),
            vCodes: bind(vCodes, "v_codes", dtype: .u8, elements: try checkedProduct([rows, vRow], what: "v_codes")),
            vScales: bind(vScales, "v_scales", dtype: .f32, elements: rows, perElement: true),
            kvLen: sequence(kvLen, "kv_len", count: B), ringStart: sequence(ringStart, "ring_start", count: B),
            tmp: self.workspace(workspace, encoder), out: bind(out, "out", dtype: outDType, elements: B * H * D),
            lse: bindOptional(lse, "lse", dtype: .f32, elements: B * H, perElement: true), tickets: tickets(for: workspace),
            prepared: prepared)
    }
}

/// Prefill, prepared (pyfa_prefill_plan_desc): shapes, strides, options, the
/// mask's kind and whether the blk tile-skip pre-pass runs are the plan's; a
/// run binds q, k, v, the mask, out and lse. The plan's workspace holds blk,
/// or where the backend splits the blocks' keys (BackendPlan.prefillSplit)
/// their parts' states, and the plan's tickets the split's; a run that binds
/// its own workspace runs its blocks whole.
public final class PrefillPlan: OpPlan {
    let params: pyfa_flash_attn_prefill_params
    let dtype: DType, outDType: DType
    let maskDType: DType?
    let useBlk: Bool, returnLse: Bool
    let split: pyfa_prefill_split?

    public init(device: Device, desc: pyfa_prefill_plan_desc) throws {
        var p = desc.attn
        dtype = try DType(code: desc.dtype)
        outDType = try DType(code: desc.out_dtype)
        try require(FlashAttnPrefill.outTypes(dtype).contains(outDType),
                    "out_dtype: \(outDType.name) must be the I/O dtype (\(dtype.name)) or f32")
        if desc.mask_dtype < 0 {
            maskDType = nil
        } else {
            let m = try DType(code: desc.mask_dtype)
            try require(m == .u8 || m == dtype,
                        "mask_dtype: \(m.name) not accepted (u8 for a boolean mask, or the I/O dtype \(dtype.name) for an additive one)")
            maskDType = m
        }
        try require(desc.use_blk <= 1 && desc.return_lse <= 1, "use_blk/return_lse: must be 0 or 1")
        try require(desc.use_blk == 0 || maskDType != nil, "use_blk: needs a mask (blk classifies the mask's tiles)")
        useBlk = desc.use_blk == 1
        returnLse = desc.return_lse == 1
        let (geometry, blkBytes) = try FlashAttnPrefill.plan(device, &p, dtype: dtype)
        if useBlk { _ = try FlashAttnPrefill.checkBlkTiles(p) }
        try FlashAttnPrefill.checkStrides(p, io: dtype, out: outDType, qAxes: (p.batch, p.num_heads, p.q_len),
                                          kvAxes: (p.batch, p.num_kv_heads, p.kv_len))
        params = p
        split = device.backend.plan.prefillSplit(p, dtype: dtype, geometry: geometry, masked: maskDType != nil)
        if let split {
            let (tickets, stateFloats) = try FlashAttnPrefill.SplitRun.sizes(split)
            try super.init(device: device, workspaceBytes: try checkedProduct([stateFloats, 4], what: "split states"),
                           tickets: tickets)
        } else {
            try super.init(device: device, workspaceBytes: useBlk ? (blkBytes + 3) / 4 * 4 : 0)
        }
    }

    public func run(_ encoder: CommandEncoder, q: TensorRef, k: TensorRef, v: TensorRef, mask: TensorRef,
                    out: TensorRef, lse: TensorRef, workspace: TensorRef) throws {
        let p = params
        try checkRun(encoder, lse: lse, returnLse: returnLse)
        try require(mask.isAbsent || maskDType != nil, "mask: the plan was made without a mask")
        try require(!mask.isAbsent || maskDType == nil, "mask: the plan was made with a mask; pass its memory")
        let D = Int(p.head_dim)
        let qRows = (p.batch, p.num_heads, p.q_len), kvRows = (p.batch, p.num_kv_heads, p.kv_len)
        let ext = FlashAttnPrefill.extent
        let qb = try bind(q, "q", dtype: dtype, elements: ext(p.q_strides, qRows, D, "q"))
        let kb = try bind(k, "k", dtype: dtype, elements: ext(p.k_strides, kvRows, D, "k"))
        let vb = try bind(v, "v", dtype: dtype, elements: ext(p.v_strides, kvRows, D, "v"))
        let ob = try bind(out, "out", dtype: outDType, elements: ext(p.out_strides, qRows, D, "out"))
        let mb = try maskDType.map { try bind(mask, "mask", dtype: $0, elements: ext(p.mask_strides, qRows, Int(p.kv_len), "mask"),
                                                 perElement: true) }
        let lb = try bindOptional(lse, "lse", dtype: .f32,
                                  elements: checkedProduct([Int(p.batch), Int(p.num_heads), Int(p.q_len)], what: "lse"),
                                  perElement: true)
        var blk: Buffer? = nil
        if useBlk, let w = try self.workspace(workspace, encoder) {
            blk = Buffer(device: device, dtype: .u8, shape: [w.nbytes], storage: w.storage, nbytes: w.nbytes, memory: w.memory)
            try FlashAttnPrefill.encodeBlk(encoder, p, dtype: dtype, mask: mb, blk: blk)
        }
        var splitRun: FlashAttnPrefill.SplitRun? = nil
        if let split, let tickets = tickets(for: workspace), let states = try self.workspace(workspace, encoder) {
            splitRun = .init(split: split, tickets: tickets, states: states)
        }
        try FlashAttnPrefill.encode(encoder, p, q: qb, k: kb, v: vb, mask: mb, blk: blk, out: ob, lse: lb, split: splitRun)
    }
}
