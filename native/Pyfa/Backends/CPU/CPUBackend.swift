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

    func makeQueue() throws -> CommandQueue { CPUQueue() }
}

/// Executes commands synchronously at submit, in order (so barriers hold by
/// construction); `wait` reports the first failure.
final class CPUQueue: CommandQueue {
    private var failure: PyfaError?

    func submit(_ commands: [EncodedCommand]) throws {
        for command in commands {
            guard case .dispatch(let d) = command else { continue }
            do {
                try run(d)
            } catch let e as PyfaError {
                failure = e
                return
            }
        }
    }

    func wait() throws {
        if let f = failure {
            failure = nil
            throw f
        }
    }

    private func run(_ d: EncodedDispatch) throws {
        guard let p = d.pipeline as? CPUPipeline else {
            throw PyfaError.internal("dispatch \(d.pipeline.name): pipeline is not a CPU pipeline")
        }
        var c = pyfa_cpu_dispatch()
        c.grid = d.grid
        c.threads = d.threads
        c.threadgroup_memory = UInt64(d.threadgroupMemory)
        withUnsafeMutableBytes(of: &c.constants) { raw in
            for (i, v) in p.constants.values.enumerated() { raw.storeBytes(of: v, toByteOffset: i * 4, as: Int32.self) }
        }
        // Inline bytes get stable, aligned addresses for the duration of the run.
        let inlineTotal = d.args.reduce(0) { total, a in
            if case .bytes(let b) = a.arg { return total + ((b.count + 15) & ~15) }
            return total
        }
        let inlineStorage = UnsafeMutableRawPointer.allocate(byteCount: max(16, inlineTotal), alignment: 16)
        defer { inlineStorage.deallocate() }
        var cursor = 0
        for (slot, arg) in d.args {
            guard slot >= 0 && slot < Int(PYFA_CPU_MAX_ARGS) else {
                throw PyfaError.internal("dispatch \(p.name): argument slot \(slot) out of range")
            }
            let address: UnsafeMutableRawPointer
            let size: Int
            switch arg {
            case .buffer(let b, let offset):
                guard let base = b.memory.hostPointer else {
                    throw PyfaError.internal("dispatch \(p.name): buffer without host memory")
                }
                address = base + offset
                size = b.nbytes - offset
            case .bytes(let bytes):
                address = inlineStorage + cursor
                bytes.withUnsafeBytes { src in
                    if let from = src.baseAddress { address.copyMemory(from: from, byteCount: src.count) }
                }
                size = bytes.count
                cursor += (bytes.count + 15) & ~15
            }
            withUnsafeMutableBytes(of: &c.args) { $0.storeBytes(of: address, toByteOffset: slot * MemoryLayout<UnsafeMutableRawPointer>.stride, as: UnsafeMutableRawPointer.self) }
            withUnsafeMutableBytes(of: &c.arg_bytes) { $0.storeBytes(of: UInt64(size), toByteOffset: slot * 8, as: UInt64.self) }
        }
        if pyfa_cpu_run(&c, p.kernel) != 0 {
            throw PyfaError.outOfMemory("dispatch \(p.name): could not allocate \(d.threadgroupMemory) bytes of threadgroup scratch")
        }
    }
}

/// The CPU's geometry: enough workgroups to keep every thread busy, never so
/// many that a workgroup's share of the cache is tiny.
struct CPUPlan: BackendPlan {
    let threads: UInt32

    func flashAttnVec(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        let groups = max(1, p.batch * p.num_kv_heads)
        let target = threads * 4
        var nwg: UInt32 = groups >= target ? 1 : (target + groups - 1) / groups
        let visible = p.window > 0 ? min(maxKvLen, p.window) : maxKvLen
        nwg = max(1, min(nwg, visible / 256, 64))
        let group = p.num_heads / max(1, p.num_kv_heads)
        return VecGeometry(nwg: nwg, threads: 1,
                           threadgroupMemory: Int(pyfa_cpu_vec_scratch_bytes(group, p.head_dim)))
    }

    func attnReduce(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (1, 0) }

    /// The CPU prefill kernel is built for one tile shape (pyfa_cpu_prefill_tile).
    func flashAttnPrefill(headDim: UInt32, dtype: DType) -> PrefillGeometry {
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
