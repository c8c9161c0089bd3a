import CPyfa
import PyfaCUDADriver
import PyfaShaderCommon
#if canImport(Glibc)
import Glibc
#endif

/// A compiled specialisation: its module and entry function on one device.
final class CUDAPipeline: Pipeline {
    let name: String
    let module: CUmodule
    let function: CUfunction
    let context: CUDAContext
    /// Dynamic shared memory the function has been allowed: none until a launch
    /// sets it. The driver's default is not 48 KB for every function (on an
    /// H200 a D 64 prefill with 2 KB of static shared memory failed to launch
    /// with 48 KB dynamic, CUDA_ERROR_INVALID_VALUE), so the first launch that
    /// takes dynamic shared memory sets the limit to what it takes.
    var dynamicSharedLimit = 0
    /// The driver refused a launch of this function in clusters (e.g. too few
    /// SMs free for one): its dispatches launch their blocks alone from then on.
    var clustersRefused = false
    let lock = Lock()
    /// TMA tensor maps the kernel takes inline, built at each launch (nil: none).
    let tensorMaps: CUDATensorMaps?

    init(name: String, module: CUmodule, function: CUfunction, context: CUDAContext, tensorMaps: CUDATensorMaps? = nil) {
        self.name = name
        self.module = module
        self.function = function
        self.context = context
        self.tensorMaps = tensorMaps
    }

    deinit {
        if (try? context.makeCurrent()) != nil { _ = pyfa_cu.cuModuleUnload(module) }
    }
}

/// NVIDIA GPUs through the driver API (primary context of device 0) and
/// NVRTC, both loaded at run time.
final class CUDABackend: Backend {
    let name = "cuda"
    let context: CUDAContext
    let compiler: CUDACompiler
    let plan: BackendPlan
    let deviceName: String
    let smCount: UInt32
    let maxSharedOptin: Int
    /// Programmatic dependent launch (CUDAQueue.dependentLaunch): opt-in,
    /// PYFA_CUDA_PDL=1 on compute capability 9.0 and later. Off by default: it
    /// saves ~1.5 µs of GPU time per decode, but inside a transformers model's
    /// step (pyfa's kernels between the framework's) a batch-8, 32K-position
    /// step took 16.5 ms with it and 11-13 ms without (H200, docs/cuda/NOTES.md).
    let dependentLaunch: Bool
    let totalMemory: UInt64
    /// Device allocations the driver confirmed recently, so wrapping memory
    /// inside one again (a framework's pool hands out the same blocks call
    /// after call) needs no driver query.
    private let knownRanges = KnownRanges()

    init() throws {
        var err = [CChar](repeating: 0, count: 512)
        if pyfa_cuda_driver_load(&err, err.count) != 0 {
            throw PyfaError.unavailable("backend 'cuda': \(String(cString: err))")
        }
        var count: Int32 = 0
        try CU.check(pyfa_cu.cuDeviceGetCount(&count), "backend 'cuda': cuDeviceGetCount", PyfaError.unavailable)
        guard count > 0 else { throw PyfaError.unavailable("backend 'cuda': the driver reports no CUDA device") }
        var dev: CUdevice = 0
        try CU.check(pyfa_cu.cuDeviceGet(&dev, 0), "backend 'cuda': cuDeviceGet(0)", PyfaError.unavailable)
        func attribute(_ a: Int32) throws -> Int32 {
            var v: Int32 = 0
            try CU.check(pyfa_cu.cuDeviceGetAttribute(&v, a, dev), "cuDeviceGetAttribute(\(a))", PyfaError.unavailable)
            return v
        }
        let major = try attribute(PYFA_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        let minor = try attribute(PYFA_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        guard major >= 8 else {
            throw PyfaError.unavailable("backend 'cuda': compute capability \(major).\(minor) is below the 8.0 pyfa needs")
        }
        smCount = UInt32(try attribute(PYFA_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
        dependentLaunch = major >= 9 && getenv("PYFA_CUDA_PDL").map { String(cString: $0) == "1" } ?? false
        maxSharedOptin = Int(try attribute(PYFA_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
        var nameBytes = [CChar](repeating: 0, count: 128)
        _ = pyfa_cu.cuDeviceGetName(&nameBytes, 127, dev)
        deviceName = String(cString: nameBytes)
        var mem = 0
        _ = pyfa_cu.cuDeviceTotalMem(&mem, dev)
        totalMemory = UInt64(mem)
        context = try CUDAContext(device: dev)
        // PYFA_CUDA_MAX_SHARED lowers the limit the plan chooses kernels by (a large GPU then
        // takes the choices of a smaller one: tests/test_cuda_small_shared.py).
        let planShared = min(maxSharedOptin, CUDAPlan.envInt("PYFA_CUDA_MAX_SHARED", maxSharedOptin))
        let tqMmaDims = CUDAPlan.tqMmaDims(maxShared: planShared)
        compiler = try CUDACompiler(arch: CUDABackend.arch(major: major, minor: minor),
                                    extraOptions: CUDAPlan.compileDefines(tqMmaDims: tqMmaDims))
        let occupancy = Occupancy()
        plan = CUDAPlan(smCount: smCount, residentBlocks: { [unowned occupancy] name, constants, bytes in
            occupancy.blocks(name, constants: constants, sharedBytes: bytes)
        }, sm90a: compiler.arch == "sm_90a", maxShared: planShared, tqMmaDims: tqMmaDims)
        occupancy.backend = self
        self.occupancy = occupancy
    }

    private var occupancy: Occupancy? = nil

    /// NVRTC's -arch for a compute capability: the arch-specific "a" target on
    /// Hopper so wgmma / TMA are available.
    static func arch(major: Int32, minor: Int32) -> String {
        major == 9 && minor == 0 ? "sm_90a" : "sm_\(major)\(minor)"
    }

    var info: pyfa_device_info {
        var i = pyfa_device_info()
        copyCString("cuda", into: &i.backend)
        copyCString("\(deviceName) (\(compiler.arch), \(smCount) SMs)", into: &i.name)
        i.compute_units = smCount
        i.max_threads_per_threadgroup = 1024
        i.max_threadgroup_memory = UInt64(maxSharedOptin)
        i.memory_bytes = totalMemory
        i.host_visible = 0
        i.simd_width = 32
        i.is_gpu = 1
        return i
    }

    func allocate(bytes: Int, storage: Storage) throws -> BufferMemory {
        switch storage {
        case .private: return try CUDADeviceMemory(context: context, bytes: bytes)
        case .shared: return try CUDASharedMemory(context: context, bytes: bytes)
        }
    }

    /// Wraps a device address (a torch / cupy tensor's memory). Host memory is
    /// refused: kernels could not read it.
    /// Device memory the caller owns. The driver's view of the address is
    /// checked: it must be device (or managed) memory, and [address,
    /// address + bytes) must lie inside the one allocation that holds it, so
    /// a kernel can neither reach host memory nor run off the allocation's end.
    func wrap(address: UInt64, bytes: Int) throws -> BufferMemory {
        try context.makeCurrent()
        try require(address <= UInt64.max - UInt64(bytes), "nbytes: address + nbytes overflows")
        if bytes > 0 && !knownRanges.contains(address, bytes) {
            var kind: UInt32 = 0
            var start: CUdeviceptr = 0
            var size: Int = 0
            var attributes: [Int32] = [PYFA_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, PYFA_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                       PYFA_CU_POINTER_ATTRIBUTE_RANGE_SIZE]
            let r = withUnsafeMutablePointer(to: &kind) { k in
                withUnsafeMutablePointer(to: &start) { s in
                    withUnsafeMutablePointer(to: &size) { n in
                        var data: [UnsafeMutableRawPointer?] = [UnsafeMutableRawPointer(k), UnsafeMutableRawPointer(s),
                                                                UnsafeMutableRawPointer(n)]
                        return pyfa_cu.cuPointerGetAttributes(3, &attributes, &data, CUdeviceptr(address))
                    }
                }
            }
            try require(r == 0 && (kind == UInt32(PYFA_CU_MEMORYTYPE_DEVICE) || kind == UInt32(PYFA_CU_MEMORYTYPE_UNIFIED)),
                        "data: 0x\(String(address, radix: 16)) is not CUDA device memory (the cuda backend wraps device pointers only; copy host arrays into a buffer)")
            let end = UInt64(start) &+ UInt64(size)
            if address >= UInt64(start) && UInt64(bytes) <= end &- address {
                knownRanges.insert(UInt64(start), UInt64(size))
            } else {
                // Virtual-memory-mapped pools (torch's expandable segments)
                // map an allocation in pieces: then its last byte must be
                // device memory too.
                var lastKind: UInt32 = 0
                let last = CUdeviceptr(address &+ UInt64(bytes) &- 1)
                let r2 = pyfa_cu.cuPointerGetAttribute(&lastKind, PYFA_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, last)
                try require(r2 == 0 && lastKind == kind,
                            "nbytes: \(bytes) bytes from 0x\(String(address, radix: 16)) run past the end of its allocation (\(end &- address) bytes left)")
            }
        }
        return CUDADeviceMemory(context: context, wrapping: CUdeviceptr(address), bytes: bytes)
    }

    func compile(name: String, constants: FunctionConstants) throws -> Pipeline {
        let image = try compiler.cubin(name: name, specialisations: [constants.values])
        try context.makeCurrent()
        var module: CUmodule? = nil
        try image.withUnsafeBytes {
            try CU.check(pyfa_cu.cuModuleLoadData(&module, $0.baseAddress), "kernel '\(name)': cuModuleLoadData", PyfaError.compile)
        }
        guard let module else { throw PyfaError.compile("kernel '\(name)': no module") }
        var function: CUfunction? = nil
        let entry = CUDACompiler.entryName(name, constants.values)
        let r = pyfa_cu.cuModuleGetFunction(&function, module, entry)
        guard r == 0, let function else {
            _ = pyfa_cu.cuModuleUnload(module)
            throw PyfaError.compile("kernel '\(name)': entry \(entry) missing: \(CU.errorText(r))")
        }
        return CUDAPipeline(name: name, module: module, function: function, context: context,
                            tensorMaps: CUDATensorMaps.recipe(kernel: name, constants: constants))
    }

    func makeQueue() throws -> CommandQueue {
        try CUDAQueue(context: context, maxShared: maxSharedOptin, dependentLaunch: dependentLaunch)
    }

    /// Resident blocks per SM of one compiled function at a block size and
    /// dynamic shared memory (0 if the query fails).
    func residentBlocks(_ pipeline: Pipeline, threads: Int, sharedBytes: Int) -> UInt32 {
        guard let p = pipeline as? CUDAPipeline, (try? context.makeCurrent()) != nil else { return 0 }
        if sharedBytes > p.dynamicSharedLimit {
            _ = pyfa_cu.cuFuncSetAttribute(p.function, PYFA_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, Int32(sharedBytes))
            p.dynamicSharedLimit = sharedBytes
        }
        var blocks: Int32 = 0
        guard pyfa_cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, p.function, Int32(threads), sharedBytes) == 0 else {
            return 0
        }
        return UInt32(max(0, blocks))
    }
}

/// Resident blocks per SM of a decode kernel specialisation at its shared
/// memory, measured once per process (the plans size nwg from it).
final class Occupancy {
    weak var backend: CUDABackend?
    private let lock = Lock()
    /// Hashed as values, not formatted into a string: plans ask on every run.
    private struct Key: Hashable {
        let name: String
        let constants: FunctionConstants
        let sharedBytes: Int
    }
    private var cache: [Key: UInt32] = [:]

    func blocks(_ name: String, constants: FunctionConstants, sharedBytes: Int) -> UInt32 {
        let key = Key(name: name, constants: constants, sharedBytes: sharedBytes)
        if let b = lock.withLock({ cache[key] }) { return b }
        guard let backend, let pipeline = try? backend.compile(name: name, constants: constants) else { return 0 }
        let b = backend.residentBlocks(pipeline, threads: Int(CUDAPlan.warps) * 32, sharedBytes: sharedBytes)
        lock.withLock { cache[key] = b }
        return b
    }
}

/// Device allocation ranges [start, start + size) the driver reported, sorted
/// by start and disjoint. An allocation freed and its addresses reused by
/// another device allocation is still device memory; a range is only trusted
/// for addresses the driver once said were device memory of that extent. Room
/// for a model's working set (each layer's K, V, query and output can be an
/// allocation of its own: a 32-layer step cycles through well over a hundred),
/// so a steady decode loop never asks the driver; when full, it starts over.
public final class KnownRanges: @unchecked Sendable {
    private let lock = Lock()
    private var starts: [UInt64] = []
    private var ends: [UInt64] = []
    public let capacity: Int

    public init(capacity: Int = 1024) {
        self.capacity = max(1, capacity)
    }

    /// Index of the last range starting at or below `address`, or nil.
    private func floor(_ address: UInt64) -> Int? {
        var lo = 0, hi = starts.count
        while lo < hi {
            let mid = (lo + hi) / 2
            if starts[mid] <= address { lo = mid + 1 } else { hi = mid }
        }
        return lo > 0 ? lo - 1 : nil
    }

    /// Whether [address, address + bytes) lies inside one known range.
    public func contains(_ address: UInt64, _ bytes: Int) -> Bool {
        lock.withLock {
            guard let i = floor(address), address <= ends[i] else { return false }
            return UInt64(bytes) <= ends[i] - address
        }
    }

    /// Records [start, start + size), dropping the known ranges it overlaps.
    public func insert(_ start: UInt64, _ size: UInt64) {
        let end = start &+ size
        guard end >= start else { return }
        lock.withLock {
            // The driver's answer replaces every known range it overlaps (stale ones).
            var first = floor(start).map { ends[$0] > start ? $0 : $0 + 1 } ?? 0
            var last = first
            while last < starts.count && starts[last] < end { last += 1 }
            starts.removeSubrange(first..<last)
            ends.removeSubrange(first..<last)
            if starts.count >= capacity {
                starts.removeAll(keepingCapacity: true)
                ends.removeAll(keepingCapacity: true)
                first = 0
            }
            starts.insert(start, at: first)
            ends.insert(end, at: first)
        }
    }
}
