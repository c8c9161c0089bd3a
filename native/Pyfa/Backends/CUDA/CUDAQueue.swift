import CPyfa
import PyfaCUDADriver
import PyfaShaderCommon
#if canImport(Glibc)
import Glibc
#endif

/// An encoder's CUDA stream. Stream order is the barrier between dispatches;
/// `commit` launches, `wait` synchronises and reports faults. The stream is
/// the queue's own (blocking, so it orders after synchronous copies) unless
/// the caller binds one (a torch / cupy stream) with `useStream`.
final class CUDAQueue: CommandQueue {
    let context: CUDAContext
    let maxShared: Int
    /// Launch with programmatic stream serialisation (Hopper and later, a
    /// driver with cuLaunchKernelEx): a kernel may be scheduled while the one
    /// before it in the stream finishes, and waits in its prologue
    /// (CUDACompiler's entry) until that one has completed and its writes are
    /// visible, so the gap between dependent kernels closes. Opt-in
    /// (PYFA_CUDA_PDL=1, CUDABackend says why); a queue whose driver refused
    /// such a launch once launches without it from then on (the refused
    /// launch is retried at once).
    private(set) var dependentLaunch: Bool
    private let ownStream: CUstream
    private var stream: CUstream?
    /// Shared buffers used since the last wait: copied back after it.
    private var touchedShared: [ObjectIdentifier: CUDASharedMemory] = [:]
    /// Device rings for inline arguments too large for a launch's parameter
    /// space, one per stream (stream order makes reusing a ring's bytes safe).
    private var uploadRings: [UInt: CUDAUploadRing] = [:]

    init(context: CUDAContext, maxShared: Int, dependentLaunch: Bool) throws {
        self.context = context
        self.maxShared = maxShared
        self.dependentLaunch = dependentLaunch && pyfa_cu.cuLaunchKernelEx != nil
        try context.makeCurrent()
        var s: CUstream? = nil
        try CU.check(pyfa_cu.cuStreamCreate(&s, 0), "encoder: cuStreamCreate")
        guard let s else { throw PyfaError.execution("encoder: cuStreamCreate returned no stream") }
        ownStream = s
        stream = s
    }

    deinit {
        if (try? context.makeCurrent()) != nil {
            // Shared buffers still queued on a caller's stream are released here:
            // let their copies finish first.
            if !touchedShared.isEmpty { _ = pyfa_cu.cuStreamSynchronize(stream) }
            _ = pyfa_cu.cuStreamSynchronize(ownStream)
            _ = pyfa_cu.cuStreamDestroy(ownStream)
        }
    }

    func useStream(_ handle: UInt64) throws {
        stream = handle == 0 ? ownStream : CUstream(bitPattern: UInt(handle))
    }

    /// Whether the current stream is being captured into a CUDA graph.
    var isCapturing: Bool {
        guard (try? context.makeCurrent()) != nil else { return false }
        var status: Int32 = 0
        return pyfa_cu.cuStreamIsCapturing(stream, &status) == 0 && status != PYFA_CU_STREAM_CAPTURE_STATUS_NONE
    }

    func submit(_ commands: [EncodedCommand]) throws {
        try context.makeCurrent()
        var uploaded = Set<ObjectIdentifier>()
        for command in commands {
            guard case .dispatch(let d) = command else { continue } // stream order already serialises
            for a in d.args {
                if case .buffer(let b, _) = a.arg, let shared = b.memory as? CUDASharedMemory {
                    let id = ObjectIdentifier(shared)
                    if uploaded.insert(id).inserted {
                        try shared.upload(on: stream)
                        touchedShared[id] = shared
                    }
                }
            }
            try launch(d)
        }
    }

    func wait() throws {
        try context.makeCurrent()
        pyfa_count(PYFA_COUNT_SYNCHRONIZATION)
        try CU.check(pyfa_cu.cuStreamSynchronize(stream), "encoder wait (a kernel faulted or the device failed)")
        guard !touchedShared.isEmpty else { return }
        let pending = touchedShared.values
        touchedShared.removeAll()
        for shared in pending { try shared.download(on: stream) }
        try CU.check(pyfa_cu.cuStreamSynchronize(stream), "encoder wait: copying shared buffers back")
    }

    /// Copies `bytes` into the stream's upload ring and returns their device
    /// address. The source is pageable memory, so the driver stages it before
    /// returning and nothing waits; a graph capture cannot record such a copy.
    private func upload(_ bytes: [UInt8], for name: String) throws -> UInt64 {
        try require(!isCapturing,
                    "dispatch \(name): \(bytes.count) bytes of per-call values (e.g. kv_len for a large batch) exceed what a launch carries inline; a CUDA graph cannot capture their upload: pass them as a device array")
        let key = UInt(bitPattern: stream)
        let ring = try uploadRings[key] ?? CUDAUploadRing(context: context)
        uploadRings[key] = ring
        let address = try ring.reserve(bytes.count)
        pyfa_count(PYFA_COUNT_HOST_TO_DEVICE)
        try bytes.withUnsafeBytes {
            try CU.check(pyfa_cu.cuMemcpyHtoDAsync(CUdeviceptr(address), $0.baseAddress, bytes.count, stream),
                         "dispatch \(name): uploading per-call values")
        }
        return address
    }

    private func launch(_ d: EncodedDispatch) throws {
        guard let p = d.pipeline as? CUDAPipeline else {
            throw PyfaError.internal("dispatch \(d.pipeline.name): pipeline is not a CUDA pipeline")
        }
        var args = try arguments(d, p)
        let smem = d.threadgroupMemory
        // A cluster needs cuLaunchKernelEx (the loop below); without it, or where the driver refused
        // this function's clusters, the blocks run alone (the kernels allow both).
        var cluster = d.cluster.0 != 1 || d.cluster.1 != 1 || d.cluster.2 != 1
        try p.lock.withLock {
            if cluster && p.clustersRefused { cluster = false }
            if smem > p.dynamicSharedLimit {
                try require(smem <= maxShared, "dispatch \(p.name): \(smem) bytes of shared memory exceed the device's \(maxShared)")
                try CU.check(pyfa_cu.cuFuncSetAttribute(p.function, PYFA_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, Int32(smem)),
                             "dispatch \(p.name): raising the shared-memory limit")
                p.dynamicSharedLimit = smem
            }
        }
        pyfa_count(PYFA_COUNT_KERNEL_LAUNCH)
        while dependentLaunch || cluster {  // (without cuLaunchKernelEx each try is refused, and the flags fall)
            if launchExtended(d, p, &args, smem, cluster: cluster) == 0 {
                if cluster { pyfa_count(PYFA_COUNT_CLUSTER_LAUNCH) }
                return
            }
            // Refused: a pipeline whose cluster the driver refused launches its blocks alone from
            // now on (retried at once without the cluster); a queue whose programmatic
            // serialisation was refused launches plainly from now on.
            if cluster {
                cluster = false
                p.lock.withLock { p.clustersRefused = true }
            } else {
                dependentLaunch = false
            }
        }
        try withUnsafeMutablePointer(to: &args) { argsPtr in
            var param: UnsafeMutableRawPointer? = UnsafeMutableRawPointer(argsPtr)
            try withUnsafeMutablePointer(to: &param) { pp in
                try CU.check(pyfa_cu.cuLaunchKernel(p.function, d.grid.0, d.grid.1, d.grid.2,
                                                    d.threads.0, d.threads.1, d.threads.2,
                                                    UInt32(smem), stream, pp, nil),
                             "dispatch \(p.name): cuLaunchKernel grid \(d.grid) threads \(d.threads)")
            }
        }
    }

    /// cuLaunchKernelEx with programmatic serialisation (dependentLaunch) and,
    /// with `cluster`, the dispatch's cluster shape; the driver's status
    /// (nonzero, without a launch, where the driver lacks cuLaunchKernelEx).
    private func launchExtended(_ d: EncodedDispatch, _ p: CUDAPipeline, _ args: inout pyfa_cuda_args, _ smem: Int,
                                cluster: Bool) -> CUresult {
        guard let launchEx = pyfa_cu.cuLaunchKernelEx else { return CUresult(1) }
        return withUnsafeMutablePointer(to: &args) { argsPtr -> CUresult in
            // The kernel's one parameter (the argument block), on the stack: no allocation per launch.
            var param: UnsafeMutableRawPointer? = UnsafeMutableRawPointer(argsPtr)
            return withUnsafeMutablePointer(to: &param) { pp in
                withUnsafeTemporaryAllocation(of: pyfa_cu_launch_attribute.self, capacity: 2) { attrs in
                    var n = 0
                    if dependentLaunch {
                        attrs[n] = pyfa_cu_launch_attribute()
                        attrs[n].id = PYFA_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                        attrs[n].value.programmatic_stream_serialization_allowed = 1
                        n += 1
                    }
                    if cluster {
                        attrs[n] = pyfa_cu_launch_attribute()
                        attrs[n].id = PYFA_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                        attrs[n].value.cluster_dim.x = d.cluster.0
                        attrs[n].value.cluster_dim.y = d.cluster.1
                        attrs[n].value.cluster_dim.z = d.cluster.2
                        n += 1
                    }
                    var config = pyfa_cu_launch_config(grid_x: d.grid.0, grid_y: d.grid.1, grid_z: d.grid.2,
                                                       block_x: d.threads.0, block_y: d.threads.1,
                                                       block_z: d.threads.2, shared_bytes: UInt32(smem),
                                                       stream: stream, attrs: attrs.baseAddress, num_attrs: UInt32(n))
                    return launchEx(&config, p.function, pp, nil)
                }
            }
        }
    }

    /// The launch's argument block: buffer addresses and inline values by
    /// slot, then the pipeline's tensor maps.
    private func arguments(_ d: EncodedDispatch, _ p: CUDAPipeline) throws -> pyfa_cuda_args {
        var args = pyfa_cuda_args()
        var cursor = 0
        try withUnsafeMutableBytes(of: &args) { raw in
            for a in d.args {
                let slot = a.slot
                guard slot >= 0 && slot < Int(PYFA_CUDA_MAX_ARGS) else {
                    throw PyfaError.internal("dispatch \(p.name): argument slot \(slot) out of range")
                }
                let value: UInt64
                switch a.arg {
                case .buffer(let b, let offset):
                    value = b.deviceAddress + UInt64(offset)
                case .bytes(let bytes) where cursor + bytes.count <= Int(PYFA_CUDA_INLINE_BYTES):
                    let base = MemoryLayout<UInt64>.stride * Int(PYFA_CUDA_MAX_ARGS)
                    bytes.withUnsafeBytes { raw.baseAddress!.advanced(by: base + cursor).copyMemory(from: $0.baseAddress!, byteCount: $0.count) }
                    value = UInt64(cursor) | PYFA_CUDA_INLINE_TAG
                    cursor += (bytes.count + 15) & ~15
                case .bytes(let bytes):
                    // Per-sequence values of a large batch: uploaded on the stream.
                    value = try upload(bytes, for: p.name)
                }
                raw.storeBytes(of: value, toByteOffset: slot * 8, as: UInt64.self)
            }
            if let maps = p.tensorMaps { cursor = maps.encode(into: raw, cursor: cursor, args: d.args) }
        }
        return args
    }
}

/// A device ring of per-call values for one stream. Bytes are handed out in
/// order and reused after the ring wraps: every use is stream-ordered after
/// the kernels that read the earlier bytes, so no wait is needed. A request
/// larger than the ring replaces it with a larger one (the old one is freed
/// once the stream's pending work no longer needs it: cuMemFree waits).
final class CUDAUploadRing {
    private let context: CUDAContext
    private var memory: CUDADeviceMemory
    private var cursor = 0

    init(context: CUDAContext) throws {
        self.context = context
        memory = try CUDADeviceMemory(context: context, bytes: 1 << 16)
    }

    func reserve(_ count: Int) throws -> UInt64 {
        let size = (count + 255) & ~255
        if size > memory.bytes {
            memory = try CUDADeviceMemory(context: context, bytes: max(size, 2 * memory.bytes))
            cursor = 0
        }
        if cursor + size > memory.bytes { cursor = 0 }
        defer { cursor += size }
        return UInt64(memory.address) + UInt64(cursor)
    }
}

/// CUDA geometry. Decode: one full wave of resident blocks (SMs x blocks
/// per SM at the kernel's occupancy), so no partial second wave idles most
/// SMs, and never fewer than ~128 positions per workgroup.
struct CUDAPlan: BackendPlan {
    let smCount: UInt32
    /// Resident blocks per SM of (kernel, function constants) at a dynamic
    /// shared-memory size, 0 if unknown.
    let residentBlocks: (String, FunctionConstants, Int) -> UInt32
    /// Kernels compile for sm_90a (Hopper): warpgroup MMA is available.
    var sm90a = false
    /// The knob of the warpgroup-MMA prefill (prefillWgmmaKnob): 0 off, 1 forced, -1 the rule.
    var prefillWgmma = CUDAPlan.prefillWgmmaKnob
    /// Dynamic shared memory one block may use (the device's opt-in limit):
    /// a tensor-core decode whose block needs more runs the vector kernel.
    var maxShared = CUDAPlan.hopperShared
    /// The head dims at which flash_attn_vec_tq runs turboquant_mma.cuh (tqMmaDims).
    var tqMmaDims = CUDAPlan.tqMmaDims(maxShared: CUDAPlan.hopperShared)

    /// Shared memory per block of sm_90 / sm_100 (227 KB), sm_80 / sm_87 (163 KB)
    /// and the rest (sm_86, sm_89, sm_120: 99 KB), for builds without a device.
    static let hopperShared = 232_448
    static func sharedLimit(arch: String) -> Int {
        arch.hasPrefix("sm_90") || arch.hasPrefix("sm_100") ? hopperShared
            : arch == "sm_80" || arch == "sm_87" ? 166_912 : 101_376
    }

    static let warps = UInt32(PYFA_CUDA_DECODE_WARPS)
    /// A positive integer knob; unset, not an integer or not positive: `fallback`.
    static func envInt(_ name: String, _ fallback: Int) -> Int {
        guard let v = getenv(name), let i = Int(String(cString: v)), i > 0 else { return fallback }
        return i
    }
    /// An on / off knob: 0 / off / false / no turn it off, 1 / on / true / yes on (any case,
    /// blanks ignored); unset or anything else: `fallback`.
    static func envFlag(_ name: String, _ fallback: Bool) -> Bool {
        guard let v = getenv(name) else { return fallback }
        let value = String(String(cString: v).filter { !$0.isWhitespace }).lowercased()
        if ["0", "off", "false", "no"].contains(value) { return false }
        if ["1", "on", "true", "yes"].contains(value) { return true }
        return fallback
    }
    /// attn_vec.cu's tuning knobs, passed to NVRTC as -D options: floats of q
    /// and of the accumulators a lane holds per pass (rows in one warp / split
    /// over warps) and positions per step.
    static let vecHeadBudget = envInt("PYFA_CUDA_VEC_GT_BUDGET", 32)
    static let vecHeadBudgetWide = envInt("PYFA_CUDA_VEC_GT_BUDGET_WIDE", 64)
    static let vecRowsPerStep = envInt("PYFA_CUDA_VEC_ROWS_PER_STEP", 4)
    static let vecStages = envInt("PYFA_CUDA_VEC_STAGES", 3)
    /// Overrides the occupancy query when set.
    static let vecBlocksPerSM = envInt("PYFA_CUDA_VEC_BLOCKS_PER_SM", 0)
    static let vecMinRows = envInt("PYFA_CUDA_VEC_MIN_ROWS", 128)
    /// 0: split decodes end with the reduce dispatch even where a plan holds tickets.
    static let vecMergeLast = envFlag("PYFA_CUDA_VEC_MERGE_LAST", true)
    /// The most workgroups per row whose last one merges: the merge is a chain of loads over
    /// the partials in one block, where the reduce dispatch spreads rows over blocks; past
    /// 16 it measured slower on the H200 (B 1, 32K: 49 workgroups, 2-3 µs more GPU time).
    static let vecMergeLastMaxNwg = envInt("PYFA_CUDA_VEC_MERGE_LAST_MAX_NWG", 16)
    /// The last workgroup of a row merges it (a launch less per decode; the same bits).
    func lastWorkgroupMerges(nwg: UInt32) -> Bool { CUDAPlan.vecMergeLast && Int(nwg) <= CUDAPlan.vecMergeLastMaxNwg }
    /// 0: appends dispatch kv_advance, K and V apart.
    static let appendOneDispatch = envFlag("PYFA_CUDA_APPEND_ONE_DISPATCH", true)
    /// K and V (and the state's advance) in one launch.
    var appendsInOneDispatch: Bool { CUDAPlan.appendOneDispatch }
    /// The tensor-core decode (attn_vec_mma.cuh) for 16-bit caches:
    /// PYFA_CUDA_VEC_MMA=1 always, 0 never; unset, where it measured faster
    /// (vecVariant). Its ring depth in tiles (D <= 256, D = 512).
    static let vecMma: Int? = getenv("PYFA_CUDA_VEC_MMA").flatMap { Int(String(cString: $0)) }
    static let vecMmaStages = max(2, envInt("PYFA_CUDA_VEC_MMA_STAGES", 4))          /* D <= 128 */
    static let vecMmaStagesMid = max(2, envInt("PYFA_CUDA_VEC_MMA_STAGES_MID", 3))   /* D = 192, 256 */
    static let vecMmaStagesWide = max(2, envInt("PYFA_CUDA_VEC_MMA_STAGES_WIDE", 2)) /* D = 512 */
    static let vecMmaWideSplit = envInt("PYFA_CUDA_VEC_MMA_WIDE_SPLIT", 2) == 4 ? 4 : 2 /* D = 512 */

    /// attn_prefill.cu's terms of P in the I/O dtype for P V: 1 (default)
    /// rounds P to f16 / bf16 before P V as FlashAttention does (its accuracy
    /// rule, half the P V tensor-core work); 2 keeps P exact to ~2^-17.
    static let prefillPTerms = min(envInt("PYFA_CUDA_PREFILL_P_TERMS", 1), 2)
    /// Clusters of the blocks of two heads of one KV head in the warpgroup-MMA
    /// prefill (cuda_layout.h, pyfa_cuda_prefill_wgmma_cluster_heads): on
    /// unless PYFA_CUDA_PREFILL_CLUSTER=0, which launches every block alone.
    static let prefillCluster = envFlag("PYFA_CUDA_PREFILL_CLUSTER", true)
    /// The warpgroup-MMA prefill (attn_prefill_wgmma.cuh, and
    /// attn_prefill_wgmma_split.cuh at D = 512) on sm_90a for f16 / bf16 up
    /// to D = 256 and at 512 (cuda_layout.h): unset or empty, the rule (-1: every D it serves);
    /// PYFA_CUDA_PREFILL_WGMMA = 0 / off / false / no keeps the mma.sync path
    /// everywhere (0), any other value forces it at every head dim it serves (1).
    static let prefillWgmmaKnob: Int = {
        guard let raw = getenv("PYFA_CUDA_PREFILL_WGMMA") else { return -1 }
        let value = String(cString: raw).lowercased()
        if value.isEmpty { return -1 }  // set but empty: as if unset
        return ["0", "off", "false", "no"].contains(value) ? 0 : 1
    }()
    /// turboquant.cu's decode knobs: query heads per pass, row loads per lane
    /// and step (even), cp.async ring depth, blocks per SM (register cap).
    static let tqVecHeads = envInt("PYFA_CUDA_TQ_VEC_HEADS", 2)
    static let tqVecRowsPerStep = (envInt("PYFA_CUDA_TQ_VEC_ROWS_PER_STEP", 2) + 1) / 2 * 2
    static let tqVecStages = max(2, envInt("PYFA_CUDA_TQ_VEC_STAGES", 4))
    static let tqVecMinBlocks = envInt("PYFA_CUDA_TQ_VEC_MIN_BLOCKS", 4)
    /// The tensor-core TurboQuant decode (turboquant_mma.cuh) at 4-bit K and V:
    /// on unless PYFA_CUDA_TQ_VEC_MMA=0; its ring depth in tiles (0: by head dim, cuda_layout.h).
    static let tqVecMma = getenv("PYFA_CUDA_TQ_VEC_MMA").flatMap { Int(String(cString: $0)) } ?? 1
    static let tqMmaStages = { (n: Int) in n > 0 ? max(2, n) : 0 }(envInt("PYFA_CUDA_TQ_MMA_STAGES", 0))
    static let tqMmaMinBlocks = max(1, envInt("PYFA_CUDA_TQ_MMA_MIN_BLOCKS", 3))

    /// The head dims (pyfa_cuda_tq_uses_mma's bits) at which the tensor-core
    /// TurboQuant decode runs: where its knob allows and its block, a 32 KB
    /// table beside its ring, fits `maxShared` (99 KB devices keep D <= 256, A100
    /// all); the vector kernel runs at the others.
    static func tqMmaDims(maxShared: Int) -> Int32 {
        guard tqVecMma != 0 else { return 0 }
        return [64, 128, 256, 512].filter { tqMmaSharedBytes(headDim: $0) <= maxShared }
            .reduce(Int32(0)) { $0 | pyfa_cuda_tq_mma_dim_bit(Int32($1)) }
    }

    static func compileDefines(tqMmaDims: Int32) -> [String] {
        ["-DPYFA_VEC_GT_BUDGET=\(vecHeadBudget)", "-DPYFA_VEC_GT_BUDGET_WIDE=\(vecHeadBudgetWide)",
         "-DPYFA_VEC_ROWS_PER_STEP=\(vecRowsPerStep)", "-DPYFA_VEC_STAGES=\(vecStages)",
         "-DPYFA_VEC_MMA_STAGES=\(vecMmaStages)", "-DPYFA_VEC_MMA_STAGES_MID=\(vecMmaStagesMid)",
         "-DPYFA_VEC_MMA_STAGES_WIDE=\(vecMmaStagesWide)",
         "-DPYFA_VEC_MMA_WIDE_SPLIT=\(vecMmaWideSplit)",
         "-DPYFA_PREFILL_P_TERMS=\(prefillPTerms)",
         "-DPYFA_TQ_VEC_HEADS=\(tqVecHeads)", "-DPYFA_TQ_VEC_ROWS_PER_STEP=\(tqVecRowsPerStep)",
         "-DPYFA_TQ_VEC_STAGES=\(tqVecStages)", "-DPYFA_TQ_VEC_MIN_BLOCKS=\(tqVecMinBlocks)",
         "-DPYFA_TQ_VEC_MMA=\(tqMmaDims)", "-DPYFA_TQ_MMA_STAGES=\(tqMmaStages)",
         "-DPYFA_TQ_MMA_MIN_BLOCKS=\(tqMmaMinBlocks)"]
    }

    /// Dynamic shared memory of one turboquant.cu decode block (cuda_layout.h).
    static func tqVecSharedBytes(headDim: Int, kBits: Int, vBits: Int) -> Int {
        Int(pyfa_cuda_tq_vec_smem_bytes(Int32(headDim), Int32(kBits), Int32(vBits), Int32(tqVecRowsPerStep),
                                        Int32(tqVecStages), Int32(tqVecHeads)))
    }

    /// Shared bytes of one turboquant_mma.cuh block (cuda_layout.h).
    static func tqMmaSharedBytes(headDim D: Int) -> Int {
        Int(pyfa_cuda_tq_mma_smem_bytes(Int32(D), Int32(tqMmaStages)))
    }

    /// Whether flash_attn_vec_tq runs turboquant_mma.cuh (the kernel's own choice, cuda_layout.h).
    func tqUsesMma(_ p: pyfa_flash_attn_vec_tq_params) -> Bool {
        pyfa_cuda_tq_uses_mma(Int32(p.k_bits), Int32(p.v_bits), Int32(p.attn.head_dim), tqMmaDims) != 0
    }
    /// 0: the TurboQuant op rotates q in its own launch before every decode.
    static let tqRotateQ = envFlag("PYFA_CUDA_TQ_ROTATE_Q", true)
    /// Both TurboQuant decode kernels rotate q themselves: a launch less per decode, the same bits.
    func turboquantRotatesQ(_ p: pyfa_flash_attn_vec_tq_params) -> Bool { CUDAPlan.tqRotateQ }

    /// Shared bytes of one attn_vec.cu block (cuda_layout.h).
    static func vecSharedBytes(headDim: Int, elementSize: Int) -> Int {
        Int(pyfa_cuda_vec_smem_bytes(Int32(elementSize), Int32(headDim), Int32(vecHeadBudget), Int32(vecHeadBudgetWide),
                                     Int32(vecRowsPerStep), Int32(vecStages)))
    }

    /// Shared bytes of one attn_vec_mma.cuh block (cuda_layout.h).
    static func vecMmaSharedBytes(headDim D: Int) -> Int {
        Int(pyfa_cuda_vec_mma_smem_bytes(Int32(D), Int32(D > 256 ? vecMmaStagesWide
                                                         : D > 128 ? vecMmaStagesMid : vecMmaStages),
                                         Int32(D > 256 ? vecMmaWideSplit : 1)))
    }

    /// The tensor-core variant for 16-bit caches, except at D = 192 / 256 with
    /// fewer than 4 query heads per KV head, where the vector kernel keeps
    /// up with it (H200, f16, 16/8 heads, D = 256, 32K: 78.6 us both at B = 1,
    /// 507 vs 520 us at B = 8). Elsewhere the tensor-core kernel reads the
    /// cache at copy speed and the vector kernel does not (same run, D = 128,
    /// 32K, B = 8: 265 vs 487 us at 16/8 heads, 263 vs 402 at 8/8; D = 64:
    /// 145 vs 489). Nor where its block does not fit the device's shared
    /// memory (A100 at D = 256; RTX 30 / 40 from D = 80): the vector kernel's does.
    func vecVariant(_ p: pyfa_flash_attn_vec_params, kvDType: DType) -> Int32 {
        guard kvDType == .f16 || kvDType == .bf16 else { return PYFA_VEC_VARIANT_PORTABLE }
        if let forced = CUDAPlan.vecMma { return forced != 0 ? PYFA_VEC_VARIANT_MMA : PYFA_VEC_VARIANT_PORTABLE }
        if CUDAPlan.vecMmaSharedBytes(headDim: Int(p.head_dim)) > maxShared { return PYFA_VEC_VARIANT_PORTABLE }
        let group = p.num_heads / max(1, p.num_kv_heads)
        let vectorKeepsUp = group < 4 && p.head_dim > 128 && p.head_dim <= 256
        return vectorKeepsUp ? PYFA_VEC_VARIANT_PORTABLE : PYFA_VEC_VARIANT_MMA
    }

    func flashAttnVec(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        let D = Int(p.head_dim)
        let variant = vecVariant(p, kvDType: kvDType)
        let bytes = variant == PYFA_VEC_VARIANT_MMA ? CUDAPlan.vecMmaSharedBytes(headDim: D)
            : CUDAPlan.vecSharedBytes(headDim: D, elementSize: kvDType == .f32 ? 4 : 2)
        let groups = max(1, UInt64(p.batch) * UInt64(p.num_kv_heads))
        var perSM = UInt32(clamping: CUDAPlan.vecBlocksPerSM)
        if perSM == 0 {
            // Measured on the f16-cache specialisation (bf16 compiles alike; f32 is the rare case).
            let constants = try? FlashAttnVec.vecConstants(q: .f16, kv: .f16, headDim: p.head_dim, softcap: false,
                                                           direct: false, variant: variant, out: .f32, lse: false)
            perSM = constants.map {
                residentBlocks(FlashAttnVec.kernel, $0, variant == PYFA_VEC_VARIANT_MMA ? bytes
                                   : CUDAPlan.vecSharedBytes(headDim: D, elementSize: 2))
            } ?? 0
        }
        if perSM == 0 { perSM = 2 }
        let target = UInt64(smCount) * UInt64(perSM)
        let visible = p.window > 0 ? min(maxKvLen, p.window) : maxKvLen
        var nwg = UInt32(clamping: target / groups)
        nwg = max(1, min(nwg, visible / UInt32(clamping: CUDAPlan.vecMinRows), 1024))
        return VecGeometry(nwg: nwg, threads: CUDAPlan.warps * 32, threadgroupMemory: bytes, variant: variant)
    }

    /// An op's rows (caches, queries, outputs, TurboQuant codes) start on 16
    /// bytes: the kernels' cp.async, vector and TMA copies fault on less, and
    /// a fault poisons the context for the whole process. Values read one at a
    /// time (lengths, tables, masks, scales, lse) need their own alignment.
    func wrapAlignment(dtype: DType, data: Bool) -> Int { data ? 16 : dtype.size }

    /// One thread per output element (head dims are 64...512), so each
    /// thread's sum over the nwg partials is a single unrolled pass.
    func attnReduce(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) {
        (min(512, max(128, (headDim + 31) / 32 * 32)), 0)
    }

    /// Prefill tile, threads and shared memory (mirrors shaders/cuda/attn_prefill.cu).
    /// f16 / bf16 on sm_90a up to D = 256 and at 512, when on (prefillWgmma):
    /// the warpgroup-MMA paths (64 query rows a consumer warpgroup, two of
    /// them; at D = 512 two that split the head dim over 64 rows), sized by
    /// cuda_layout.h for the KV mode: in rectangular mode with TMA stages a
    /// producer warpgroup more, and at D = 64 three consumer warpgroups (192
    /// rows) with 128-key tiles, at D = 192 wider key tiles than the packed
    /// modes take.
    /// f16 / bf16 (mma path): 64 query rows (4 warps x 16), 64 keys (32 from
    /// D = 256: the score and output accumulators then fit the 255 registers;
    /// D = 512 runs two passes of 256 output columns); shared memory
    /// holds Q [64][D+8], K [BK][D+8] and V [BK][DO+8] in 16 bits.
    /// f32 (SIMT path): 16 query rows x 32 keys; Q [16][D+4], one K-or-V
    /// buffer [32][D+4] and P [16][32] in f32.
    func flashAttnPrefill(headDim: UInt32, dtype: DType, kvMode: Int32) -> PrefillGeometry {
        let D = Int(headDim)
        if pyfa_cuda_prefill_uses_wgmma(sm90a ? 1 : 0, Int32(clamping: prefillWgmma), Int32(dtype.size), Int32(D)) != 0 {
            let pairs = CUDAPlan.prefillCluster && pyfa_cu.cuLaunchKernelEx != nil
            return PrefillGeometry(blockQ: UInt32(pyfa_cuda_prefill_wgmma_block_q(Int32(D), kvMode)),
                                   blockK: UInt32(pyfa_cuda_prefill_wgmma_block_k(Int32(D), kvMode)),
                                   threads: UInt32(pyfa_cuda_prefill_wgmma_block_threads(Int32(D), kvMode)),
                                   threadgroupMemory: Int(pyfa_cuda_prefill_wgmma_smem_bytes(Int32(D), kvMode)),
                                   clusterHeads: pairs ? UInt32(pyfa_cuda_prefill_wgmma_cluster_heads(Int32(D), kvMode)) : 1)
        }
        if dtype == .f32 {
            let (bq, bk) = (16, 32)
            return PrefillGeometry(blockQ: UInt32(bq), blockK: UInt32(bk), threads: 128,
                                   threadgroupMemory: ((bq + bk) * (D + 4) + bq * bk) * 4)
        }
        let bq = 64, bk = D >= 256 ? 32 : 64, dOut = D > 256 ? D / 2 : D
        return PrefillGeometry(blockQ: UInt32(bq), blockK: UInt32(bk), threads: 128,
                               threadgroupMemory: ((bq + bk) * (D + 8) + bk * (dOut + 8)) * 2)
    }

    func prefillAux(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (128, 0) }

    /// PYFA_CUDA_PREFILL_SPLIT: unset, the rule (prefillSplit); 0 / off never splits; an
    /// integer from 2 to 16 splits every block of any call the split serves into that many
    /// parts (for tests: the merge then runs everywhere).
    static let prefillSplitKnob: Int = {
        let name = "PYFA_CUDA_PREFILL_SPLIT"
        if !envFlag(name, true) { return 0 }
        let n = envInt(name, 0)
        return (2...16).contains(n) ? n : -1
    }()

    /// The key split of the kernels that take one (cuda_layout.h, pyfa_cuda_prefill_splits:
    /// rectangular mode, f16 / bf16, D 64 to 128 on sm_90a), whose blocks run one an SM: by
    /// pyfa_cuda_prefill_split_parts for unmasked calls whose blocks all visit as many key tiles:
    /// without causal masking or a window, or with one query tile (every block then sees the same
    /// keys; under causal masking with several tiles the longest start first and the short ones
    /// fill the last wave). The split launch is one-dimensional, so its blocks run without clusters.
    func prefillSplit(_ p: pyfa_flash_attn_prefill_params, dtype: DType, geometry: PrefillGeometry,
                      masked: Bool) -> pyfa_prefill_split? {
        let D = Int32(p.head_dim), rect = PYFA_PREFILL_KV_RECT
        guard CUDAPlan.prefillSplitKnob != 0, !masked,
              pyfa_cuda_prefill_uses_wgmma(sm90a ? 1 : 0, Int32(clamping: prefillWgmma), Int32(dtype.size), D) != 0,
              pyfa_cuda_prefill_splits(D, rect) != 0,
              geometry.blockQ == UInt32(pyfa_cuda_prefill_wgmma_block_q(D, rect)) else { return nil }
        let blocks = UInt64(p.num_q_blocks) * UInt64(p.num_heads) * UInt64(p.batch)
        var first: UInt64, parts: UInt64
        if CUDAPlan.prefillSplitKnob > 0 {
            (first, parts) = (0, UInt64(CUDAPlan.prefillSplitKnob))
        } else {
            let uniform = p.num_q_blocks == 1 || (p.causal == 0 && p.window == 0)
            guard uniform else { return nil }
            // The key tiles a block visits (attn_prefill.cu, block_info): with one query tile, the
            // causal bound and the window of its rows; else every tile.
            var kBegin: Int64 = 0, kEnd = Int64(p.kv_len)
            if p.causal != 0 { kEnd = min(kEnd, Int64(p.q_offset) + Int64(p.q_len)) }
            if p.window > 0 { kBegin = max(0, Int64(p.q_offset) - Int64(p.window) + 1) }
            let bk = Int64(p.block_k)
            let tiles = kEnd > kBegin ? (kEnd + bk - 1) / bk - kBegin / bk : 0
            parts = UInt64(pyfa_cuda_prefill_split_parts(blocks, UInt64(smCount), UInt32(clamping: tiles)))
            guard parts > 0 else { return nil }
            first = blocks / UInt64(smCount) * UInt64(smCount)
        }
        let total = first + parts * (blocks - first)
        guard total <= UInt64(Int32.max) else { return nil }
        return pyfa_prefill_split(first_rank: UInt32(first), parts: UInt32(parts), blocks: UInt32(total),
                                  state_floats: UInt32(pyfa_cuda_prefill_split_state_floats(D, rect)))
    }

    /// PYFA_CUDA_PREFILL_PERSIST: unset, 1 or on, the rule (prefillPersistent); 0 / off never (-1
    /// here); an integer from 2 runs every call the persistent kernel serves in that many blocks
    /// (for tests: each block then takes many ranks, also of small grids).
    static let prefillPersistKnob: Int = {
        let name = "PYFA_CUDA_PREFILL_PERSIST"
        if !envFlag(name, true) { return -1 }
        let n = envInt(name, 0)
        return n >= 2 ? n : 0
    }()

    func prefillPersistentServes(headDim: UInt32, dtype: DType) -> Bool {
        let D = Int32(headDim)
        return pyfa_cuda_prefill_uses_wgmma(sm90a ? 1 : 0, Int32(clamping: prefillWgmma), Int32(dtype.size), D) != 0
            && pyfa_cuda_prefill_persists(D, PYFA_PREFILL_KV_RECT) != 0
    }

    /// Persistent blocks (cuda_layout.h, pyfa_cuda_prefill_persists), one an SM, for unmasked
    /// calls where pyfa_cuda_prefill_persistent_pays and the launch can expect all three tensor
    /// maps (the kernel's body without them copies every tile with the threads, untimed): each
    /// block then runs a rank of each wave in turn, its start and end under its neighbours' work.
    /// A grid of a wave or less launches as it is. A plan asks prefillSplit first, which may split
    /// a grid whose last wave leaves SMs idle.
    func prefillPersistent(_ p: pyfa_flash_attn_prefill_params, dtype: DType, geometry: PrefillGeometry,
                           masked: Bool) -> (blocks: UInt32, threadgroupMemory: Int)? {
        let D = Int32(p.head_dim), rect = PYFA_PREFILL_KV_RECT
        guard CUDAPlan.prefillPersistKnob >= 0, !masked, prefillPersistentServes(headDim: p.head_dim, dtype: dtype),
              geometry.blockQ == UInt32(pyfa_cuda_prefill_wgmma_block_q(D, rect)) else { return nil }
        let ranks = UInt64(p.num_q_blocks) * UInt64(p.num_heads) * UInt64(p.batch)
        let forced = CUDAPlan.prefillPersistKnob > 0
        let blocks = forced ? UInt64(CUDAPlan.prefillPersistKnob) : UInt64(smCount)
        guard ranks <= UInt64(Int32.max),
              forced || (pyfa_cuda_prefill_persistent_pays(D, ranks, UInt64(smCount)) != 0 &&
                         CUDATensorMaps.allPrefillMapsExpected(p)) else { return nil }
        return (UInt32(min(blocks, ranks)), Int(pyfa_cuda_prefill_persistent_smem_bytes(D, rect)))
    }

    /// Whole warps covering a row, 32 to 128 (kv_append.cu's launch bound);
    /// the kernel strides over longer rows.
    func kvAppend(headDim: UInt32) -> UInt32 { min(128, max(32, (headDim + 31) / 32 * 32)) }

    /// One warp per row of the TurboQuant row kernels (turboquant.cu; static shared memory).
    func turboquantRows(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (32, 0) }

    /// The fused reduce + undo merges with 4 warps, as flash_attn_vec_reduce does.
    func turboquantReduceUndo(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (128, 0) }

    /// TurboQuant decode (turboquant.cu): 4 warps; as many workgroups per
    /// sequence as fill the resident block slots (tqVecMinBlocks per SM) in
    /// whole waves (a second, partial wave would run on an idle GPU), never
    /// fewer than vecMinRows positions each.
    func flashAttnVecTQ(_ p: pyfa_flash_attn_vec_tq_params, maxKvLen: UInt32) -> VecGeometry {
        let a = p.attn
        // 64-bit: batch * num_kv_heads may exceed 32 bits before validation bounds it.
        let groups = max(1, UInt64(a.batch) * UInt64(a.num_kv_heads))
        if tqUsesMma(p) {
            let bytes = CUDAPlan.tqMmaSharedBytes(headDim: Int(a.head_dim))
            let constants = try? FlashAttnVecTQ.vecConstants(kBits: 4, vBits: 4, headDim: a.head_dim, softcap: false,
                                                             direct: false, lse: false)
            var perSM = constants.map { residentBlocks(FlashAttnVecTQ.kernel, $0, bytes) } ?? 0
            if perSM == 0 { perSM = 1 }
            let visible = a.window > 0 ? min(maxKvLen, a.window) : maxKvLen
            var nwg = max(1, UInt32(clamping: UInt64(smCount) * UInt64(perSM) / groups))
            nwg = max(1, min(nwg, visible / UInt32(clamping: CUDAPlan.vecMinRows), 1024))
            return VecGeometry(nwg: nwg, threads: CUDAPlan.warps * 32, threadgroupMemory: bytes)
        }
        let slots = UInt64(smCount) * UInt64(clamping: CUDAPlan.tqVecMinBlocks)
        let visible = a.window > 0 ? min(maxKvLen, a.window) : maxKvLen
        var nwg = UInt32(clamping: groups >= slots ? 1 : slots / groups)
        nwg = max(1, min(nwg, visible / UInt32(clamping: CUDAPlan.vecMinRows), 1024))
        return VecGeometry(nwg: nwg, threads: CUDAPlan.warps * 32,
                           threadgroupMemory: CUDAPlan.tqVecSharedBytes(headDim: Int(a.head_dim), kBits: Int(p.k_bits),
                                                                        vBits: Int(p.v_bits)))
    }
}
