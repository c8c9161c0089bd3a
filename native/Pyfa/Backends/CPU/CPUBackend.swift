import CPyfa
import PyfaCPUKernels
import PyfaShaderCommon
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Host memory, 64-byte aligned; owned (freed on deinit) or wrapped.
final class HostMemory: BufferMemory {
    let pointer: UnsafeMutableRawPointer?
    let owned: Bool

    init(bytes: Int) throws {
        var p: UnsafeMutableRawPointer? = nil
        let rounded = max(64, (bytes + 63) & ~63)
        pyfa_count(PYFA_COUNT_HOST_ALLOCATION)
        guard posix_memalign(&p, 64, rounded) == 0, let p else {
            throw PyfaError.outOfMemory("buffer: could not allocate \(bytes) bytes of host memory")
        }
        pointer = p
        owned = true
    }

    init(wrapping p: UnsafeMutableRawPointer?) {
        pointer = p
        owned = false
    }

    deinit { if owned { free(pointer) } }

    var isPlainView: Bool { !owned }

    var hostPointer: UnsafeMutableRawPointer? { pointer }
    var deviceAddress: UInt64 { UInt64(UInt(bitPattern: pointer)) }

    func write(offset: Int, from: UnsafeRawPointer, count: Int) throws {
        if count > 0 { memcpy(pointer! + offset, from, count) }
    }

    func read(offset: Int, into: UnsafeMutableRawPointer, count: Int) throws {
        if count > 0 { memcpy(into, pointer! + offset, count) }
    }
}

/// A CPU kernel with its function-constant values baked in.
final class CPUPipeline: Pipeline {
    let name: String
    let kernel: pyfa_cpu_kernel
    let constants: FunctionConstants

    init(name: String, kernel: @escaping pyfa_cpu_kernel, constants: FunctionConstants) {
        self.name = name
        self.kernel = kernel
        self.constants = constants
    }
}

/// The embedded default backend: runs every dispatch's threadgroups on a
/// thread pool, calling the kernel's C implementation once per threadgroup.
final class CPUBackend: Backend {
    let name = "cpu"
    let plan: BackendPlan

    init() throws {
        plan = CPUPlan(threads: pyfa_cpu_thread_count())
    }

    var info: pyfa_device_info {
        var i = pyfa_device_info()
        copyCString("cpu", into: &i.backend)
        copyCString("CPU (\(pyfa_cpu_thread_count()) threads, \(String(cString: pyfa_cpu_isa())) kernels)", into: &i.name)
        i.compute_units = pyfa_cpu_thread_count()
        i.max_threads_per_threadgroup = 1
        i.max_threadgroup_memory = 1 << 30
        i.memory_bytes = UInt64(sysconf(Int32(_SC_PHYS_PAGES))) &* UInt64(sysconf(Int32(_SC_PAGESIZE)))
        i.host_visible = 1
        i.simd_width = 1
        i.is_gpu = 0
        return i
    }

    func allocate(bytes: Int, storage: Storage) throws -> BufferMemory {
        // Private storage on the CPU is host memory too; its contents stay
        // reachable only through read/write copies, as on a GPU.
        try HostMemory(bytes: bytes)
    }

    func wrap(address: UInt64, bytes: Int) throws -> BufferMemory {
        HostMemory(wrapping: UnsafeMutableRawPointer(bitPattern: UInt(address)))
    }

    func compile(name: String, constants: FunctionConstants) throws -> Pipeline {
        guard let k = pyfa_cpu_find_kernel(name) else {
            throw PyfaError.internal("kernel '\(name)': no CPU implementation")
        }
        try require(constants.values.count <= Int(PYFA_CPU_MAX_CONSTANTS), "kernel '\(name)': too many function constants")
        return CPUPipeline(name: name, kernel: k, constants: constants)
    }

    func makeQueue() throws -> CommandQueue { CPUQueue(stress: try BarrierStress.fromEnvironment()) }
}

/// How a CPU queue orders the dispatches between two barriers (a segment).
/// The queue runs everything on the host, so a barrier an op forgot to record
/// is invisible in `.off`; the stress modes break exactly what a missing
/// barrier would break on a GPU that overlaps dispatches (a Metal concurrent
/// encoder, a CUDA graph): a dispatch may only rely on writes that a barrier
/// separates from it. Segments always run in order.
public enum BarrierStress: Equatable, Sendable {
    /// Every dispatch in recorded order (the default).
    case off
    /// The dispatches of each segment in reverse order.
    case reverse
    /// The threadgroups of a segment's dispatches interleaved over the pool
    /// (pyfa_cpu_run_many), so they overlap.
    case concurrent

    public static let variable = "PYFA_CPU_BARRIER_STRESS"

    /// From PYFA_CPU_BARRIER_STRESS: unset, empty or "off", "reverse",
    /// "concurrent"; any other value is an error rather than a silent default.
    public static func fromEnvironment() throws -> BarrierStress {
        guard let raw = getenv(variable) else { return .off }
        switch String(cString: raw) {
        case "", "off": return .off
        case "reverse": return .reverse
        case "concurrent": return .concurrent
        case let other:
            throw PyfaError.invalid("\(variable): '\(other)' is not one of off, reverse, concurrent")
        }
    }
}

/// Executes commands synchronously at submit, one barrier-delimited segment
/// after another (in order, so barriers hold by construction; within a
/// segment as `stress` says); `wait` reports the first failure, after which
/// the rest of that submission is skipped.
final class CPUQueue: CommandQueue {
    private var failure: PyfaError?
    let stress: BarrierStress

    /// `stress` is read once per queue (CPUBackend.makeQueue passes the
    /// environment's choice); tests pass a mode directly.
    init(stress: BarrierStress = .off) {
        self.stress = stress
    }

    func submit(_ commands: [EncodedCommand]) throws {
        var segment: [EncodedDispatch] = []
        do {
            if stress == .off {  // every dispatch in order: barriers hold without gathering segments
                for case .dispatch(let d) in commands { try PreparedDispatch.run(d) }
                return
            }
            for command in commands {
                switch command {
                case .dispatch(let d): segment.append(d)
                case .barrier:
                    try runSegment(segment)
                    segment.removeAll()
                }
            }
            try runSegment(segment)
        } catch let e as PyfaError {
            failure = e
        }
    }

    func wait() throws {
        if let f = failure {
            failure = nil
            throw f
        }
    }

    private func runSegment(_ segment: [EncodedDispatch]) throws {
        switch stress {
        case .off:
            for d in segment { try PreparedDispatch.run(d) }
        case .reverse:
            for d in segment.reversed() { try PreparedDispatch.run(d) }
        case .concurrent:
            if segment.count == 1 {
                try PreparedDispatch.run(segment[0])
            } else if !segment.isEmpty {
                try PreparedDispatch.runTogether(segment.map(PreparedDispatch.init))
            }
        }
    }
}

extension Device {
    /// A CPU queue in the given stress mode, whatever the environment says
    /// (tests and tools pair it with CommandEncoder(device:queue:)); other
    /// backends refuse.
    public func makeQueue(barrierStress: BarrierStress) throws -> CommandQueue {
        guard backend is CPUBackend else {
            throw PyfaError.unsupported("barrier stress: only the cpu backend has it, not \(backend.name)")
        }
        return CPUQueue(stress: barrierStress)
    }
}

/// One dispatch in the C kernels' form: the pyfa_cpu_dispatch (heap-allocated,
/// so its address is stable while several run together) and the inline
/// argument bytes it points into, both alive as long as this object. The
/// in-order path (`run(_:)`) keeps both on the stack instead.
private final class PreparedDispatch {
    let name: String
    let kernel: pyfa_cpu_kernel
    let dispatch: UnsafeMutablePointer<pyfa_cpu_dispatch>
    private let inlineStorage: UnsafeMutableRawPointer

    init(_ d: EncodedDispatch) throws {
        let p = try Self.pipeline(d)
        name = p.name
        kernel = p.kernel
        inlineStorage = UnsafeMutableRawPointer.allocate(byteCount: Self.inlineBytes(d), alignment: 16)
        dispatch = UnsafeMutablePointer<pyfa_cpu_dispatch>.allocate(capacity: 1)
        dispatch.initialize(to: pyfa_cpu_dispatch())
        dispatch.pointee = try Self.fill(d, p, inline: inlineStorage)
    }

    deinit {
        dispatch.deinitialize(count: 1)
        dispatch.deallocate()
        inlineStorage.deallocate()
    }

    /// Runs `d` with its pyfa_cpu_dispatch and inline bytes on the stack.
    static func run(_ d: EncodedDispatch) throws {
        let p = try pipeline(d)
        try withUnsafeTemporaryAllocation(byteCount: inlineBytes(d), alignment: 16) { inline in
            var c = try fill(d, p, inline: inline.baseAddress!)
            try run(&c, p.kernel, p.name)
        }
    }

    static func runTogether(_ all: [PreparedDispatch]) throws {
        let dispatches: [UnsafePointer<pyfa_cpu_dispatch>?] = all.map { UnsafePointer($0.dispatch) }
        let kernels: [pyfa_cpu_kernel?] = all.map { $0.kernel }
        if pyfa_cpu_run_many(dispatches, kernels, UInt32(all.count)) != 0 {
            throw PyfaError.outOfMemory("dispatches \(all.map(\.name).joined(separator: ", ")): could not allocate threadgroup scratch")
        }
        for p in all { try checkKernel(p.dispatch, p.name) }
    }

    private static func pipeline(_ d: EncodedDispatch) throws -> CPUPipeline {
        guard let p = d.pipeline as? CPUPipeline else {
            throw PyfaError.internal("dispatch \(d.pipeline.name): pipeline is not a CPU pipeline")
        }
        return p
    }

    /// Bytes of `d`'s inline arguments, each at a 16-byte aligned offset.
    private static func inlineBytes(_ d: EncodedDispatch) -> Int {
        max(16, d.args.reduce(0) { total, a in
            if case .bytes(let b) = a.arg { return total + ((b.count + 15) & ~15) }
            return total
        })
    }

    /// `d` in the kernels' form, its inline bytes copied to `inline` (inlineBytes(d) bytes).
    private static func fill(_ d: EncodedDispatch, _ p: CPUPipeline,
                             inline: UnsafeMutableRawPointer) throws -> pyfa_cpu_dispatch {
        var c = pyfa_cpu_dispatch()
        c.grid = d.grid
        c.threads = d.threads
        c.threadgroup_memory = UInt64(d.threadgroupMemory)
        withUnsafeMutableBytes(of: &c.constants) { raw in
            for (i, v) in p.constants.values.enumerated() { raw.storeBytes(of: v, toByteOffset: i * 4, as: Int32.self) }
        }
        var cursor = 0
        for a in d.args {
            let slot = a.slot
            guard slot >= 0 && slot < Int(PYFA_CPU_MAX_ARGS) else {
                throw PyfaError.internal("dispatch \(p.name): argument slot \(slot) out of range")
            }
            let address: UnsafeMutableRawPointer
            let size: Int
            switch a.arg {
            case .buffer(let b, let offset):
                guard let base = b.contents else {
                    throw PyfaError.internal("dispatch \(p.name): buffer without host memory")
                }
                address = base + offset
                size = b.nbytes - offset
            case .bytes(let bytes):
                address = inline + cursor
                bytes.withUnsafeBytes { src in
                    if let from = src.baseAddress { address.copyMemory(from: from, byteCount: src.count) }
                }
                size = bytes.count
                cursor += (bytes.count + 15) & ~15
            }
            withUnsafeMutableBytes(of: &c.args) { $0.storeBytes(of: address, toByteOffset: slot * MemoryLayout<UnsafeMutableRawPointer>.stride, as: UnsafeMutableRawPointer.self) }
            withUnsafeMutableBytes(of: &c.arg_bytes) { $0.storeBytes(of: UInt64(size), toByteOffset: slot * 8, as: UInt64.self) }
        }
        return c
    }

    private static func run(_ dispatch: UnsafeMutablePointer<pyfa_cpu_dispatch>, _ kernel: pyfa_cpu_kernel,
                            _ name: String) throws {
        if pyfa_cpu_run(dispatch, kernel) != 0 {
            throw PyfaError.outOfMemory("dispatch \(name): could not allocate \(dispatch.pointee.threadgroup_memory) bytes of threadgroup scratch")
        }
        try checkKernel(dispatch, name)
    }

    /// A kernel that reached a case its build does not handle (pyfa_cpu_fail)
    /// wrote nothing: that is an error of the library, never a result.
    private static func checkKernel(_ dispatch: UnsafeMutablePointer<pyfa_cpu_dispatch>, _ name: String) throws {
        guard dispatch.pointee.failed != 0 else { return }
        let message = withUnsafeBytes(of: &dispatch.pointee.failure) { raw in
            String(decoding: raw.prefix { $0 != 0 }, as: UTF8.self)
        }
        throw PyfaError.internal("kernel \(name): \(message)")
    }
}

/// The CPU's geometry: enough workgroups to keep every thread busy, never so
/// many that a workgroup's share of the cache is tiny.
struct CPUPlan: BackendPlan {
    let threads: UInt32

    func flashAttnVec(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        // 64-bit: batch * num_kv_heads may exceed 32 bits before validation bounds it.
        let group = p.num_heads / max(1, p.num_kv_heads)
        return VecGeometry(nwg: split(units: UInt64(p.batch) * UInt64(p.num_kv_heads), p, maxKvLen: maxKvLen),
                           threads: 1, threadgroupMemory: Int(pyfa_cpu_vec_scratch_bytes(group, p.head_dim)))
    }

    /// Over a paged pool (either layout) a threadgroup walks every KV head of
    /// its (sequence, split) (PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS; attn_vec_body.h
    /// says why), so the work comes in batch * nwg units, not batch *
    /// num_kv_heads * nwg: the split is sized for batch units, so a short
    /// batch (B = 1) still gives every thread work. One KV head, or states
    /// beyond PYFA_CPU_VEC_ALL_KV_HEADS_MAX_SCRATCH, keep the per-head
    /// threadgroups of the dense decode.
    func flashAttnVecPaged(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        let scratch = pyfa_cpu_vec_scratch_bytes(p.num_heads, p.head_dim)
        guard p.num_kv_heads > 1, scratch <= UInt64(PYFA_CPU_VEC_ALL_KV_HEADS_MAX_SCRATCH) else {
            return flashAttnVec(p, kvDType: kvDType, maxKvLen: maxKvLen)
        }
        return VecGeometry(nwg: split(units: UInt64(p.batch), p, maxKvLen: maxKvLen), threads: 1,
                           threadgroupMemory: Int(scratch), variant: Int32(PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS))
    }

    /// Workgroups per sequence: about 4 units of work per thread (units
    /// finish unevenly; the pool balances them), each at least 256 visible
    /// positions, at most 64.
    private func split(units: UInt64, _ p: pyfa_flash_attn_vec_params, maxKvLen: UInt32) -> UInt32 {
        let groups = max(1, units)
        let target = UInt64(threads) * 4
        let nwg = UInt32(clamping: groups >= target ? 1 : (target + groups - 1) / groups)
        let visible = p.window > 0 ? min(maxKvLen, p.window) : maxKvLen
        return max(1, min(nwg, visible / 256, 64))
    }

    func attnReduce(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (1, 0) }

    func kvAppend(headDim: UInt32) -> UInt32 { 1 }

    /// The CPU prefill kernel is built for one tile shape (pyfa_cpu_prefill_tile).
    func flashAttnPrefill(headDim: UInt32, dtype: DType, kvMode: Int32) -> PrefillGeometry {
        var bq: UInt32 = 0, bk: UInt32 = 0
        pyfa_cpu_prefill_tile(&bq, &bk)
        return PrefillGeometry(blockQ: bq, blockK: bk, threads: 1,
                               threadgroupMemory: Int(pyfa_cpu_prefill_scratch_bytes(headDim)))
    }

    func prefillAux(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (1, 0) }
    /// Row kernels keep their rows on the stack.
    func turboquantRows(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (1, 0) }

    func turboquantReduceUndo(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (1, 0) }
}

/// Copies a Swift string into a fixed C char array, NUL-terminated.
func copyCString<T>(_ s: String, into field: inout T) {
    withUnsafeMutableBytes(of: &field) { raw in
        let bytes = Array(s.utf8.prefix(raw.count - 1))
        for (i, c) in bytes.enumerated() { raw[i] = c }
        raw[bytes.count] = 0
    }
}
