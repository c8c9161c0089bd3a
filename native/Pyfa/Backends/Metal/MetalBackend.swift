import CPyfa
import Metal
import PyfaMetalSources
import PyfaShaderCommon
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A specialised kernel: its compute pipeline.
final class MetalPipeline: Pipeline {
    let name: String
    let state: MTLComputePipelineState

    init(name: String, state: MTLComputePipelineState) {
        self.name = name
        self.state = state
    }
}

/// Apple GPUs through the Metal API. On Linux the same code runs over the
/// package's own `Metal` module, whose device is an MSL executor on the CPU
/// (it reports no physical location, so it is not a GPU and "auto" skips it).
final class MetalBackend: Backend {
    let name = "metal"
    let device: MTLDevice
    let plan: BackendPlan
    /// One queue per device: queues are costly, and command buffers from any
    /// thread may share one.
    let commandQueue: MTLCommandQueue
    private let lock = Lock()
    /// One library per kernel source file, made on first use.
    private var libraries: [String: MTLLibrary] = [:]

    /// The SIMD-group width every pyfa Metal kernel is written for; a pipeline
    /// whose threadExecutionWidth differs is refused.
    static let simdWidth = Int(PYFA_METAL_VEC_THREADS)

    init() throws {
        guard let device = MTLCreateSystemDefaultDevice() else {
            throw PyfaError.unavailable("backend 'metal': no Metal device on this machine")
        }
        guard let queue = device.makeCommandQueue() else {
            throw PyfaError.unavailable("backend 'metal': could not make a command queue on \(device.name)")
        }
        self.device = device
        commandQueue = queue
        plan = MetalPlan()
    }

    var info: pyfa_device_info {
        var i = pyfa_device_info()
        copyCString("metal", into: &i.backend)
        let isGPU = MetalBackend.isGPU(device)
        copyCString(isGPU ? device.name : "\(device.name) (runs on the CPU; not a GPU)", into: &i.name)
        i.compute_units = 0 // Metal does not report GPU cores
        i.max_threads_per_threadgroup = UInt32(device.maxThreadsPerThreadgroup.width)
        i.max_threadgroup_memory = UInt64(device.maxThreadgroupMemoryLength)
        i.memory_bytes = device.recommendedMaxWorkingSetSize
        i.host_visible = device.hasUnifiedMemory ? 1 : 0
        i.simd_width = UInt32(MetalBackend.simdWidth)
        i.is_gpu = isGPU ? 1 : 0
        return i
    }

    /// Both storage kinds are shared-mode buffers: on unified memory a private
    /// buffer gains nothing, and shared keeps `read` / `write` plain copies.
    func allocate(bytes: Int, storage: Storage) throws -> BufferMemory {
        try require(bytes <= device.maxBufferLength, "buffer: \(bytes) bytes exceed the device's largest buffer (\(device.maxBufferLength))")
        pyfa_count(PYFA_COUNT_DEVICE_ALLOCATION)
        guard let buffer = device.makeBuffer(length: max(bytes, 16), options: .storageModeShared) else {
            throw PyfaError.outOfMemory("buffer: Metal could not allocate \(bytes) bytes")
        }
        return MetalBufferMemory(buffer: buffer)
    }

    /// Caller memory: used in place where page-aligned (Metal's rule for
    /// bytesNoCopy), else mirrored by a copy the queue syncs around each use.
    func wrap(address: UInt64, bytes: Int) throws -> BufferMemory {
        guard let pointer = UnsafeMutableRawPointer(bitPattern: UInt(address)) else {
            return try allocate(bytes: 0, storage: .shared)
        }
        try require(bytes <= device.maxBufferLength, "nbytes: \(bytes) bytes exceed the device's largest buffer (\(device.maxBufferLength))")
        let page = Int(getpagesize())
        if UInt(address) % UInt(page) == 0, bytes > 0,
           let buffer = device.makeBuffer(bytesNoCopy: pointer, length: (bytes + page - 1) / page * page,
                                          options: .storageModeShared, deallocator: nil) {
            return MetalBufferMemory(buffer: buffer)
        }
        pyfa_count(PYFA_COUNT_DEVICE_ALLOCATION)
        guard let buffer = device.makeBuffer(length: max(bytes, 16), options: .storageModeShared) else {
            throw PyfaError.outOfMemory("buffer: Metal could not allocate a \(bytes)-byte copy of caller memory")
        }
        return MetalCopiedMemory(buffer: buffer, host: pointer, bytes: bytes)
    }

    func compile(name: String, constants: FunctionConstants) throws -> Pipeline {
        guard let file = pyfa_metal_kernel_file(name) else {
            throw PyfaError.unsupported("kernel '\(name)': no Metal implementation yet (shaders/metal/kernel_list.h)")
        }
        let library = try self.library(String(cString: file))
        let values = MTLFunctionConstantValues()
        for (index, value) in constants.entries {
            var v = value
            values.setConstantValue(&v, type: .int, index: index)
        }
        let function: MTLFunction
        let state: MTLComputePipelineState
        do {
            function = try library.makeFunction(name: name, constantValues: values)
            state = try device.makeComputePipelineState(function: function)
        } catch {
            throw PyfaError.compile("kernel '\(name)\(constants)': \(error)")
        }
        guard state.threadExecutionWidth == MetalBackend.simdWidth else {
            throw PyfaError.unsupported("kernel '\(name)': this device runs SIMD-groups of \(state.threadExecutionWidth) threads; pyfa's Metal kernels need \(MetalBackend.simdWidth)")
        }
        return MetalPipeline(name: name, state: state)
    }

    func makeQueue() throws -> CommandQueue { MetalQueue(queue: commandQueue) }

    /// Whether the device is a GPU: one with no physical location is not (the
    /// MSL executor on Linux). Every Metal device of the other Apple
    /// platforms, which have no `location`, is a GPU.
    static func isGPU(_ device: MTLDevice) -> Bool {
        #if os(macOS) || os(Linux)
        return device.location != .unspecified
        #else
        return true
        #endif
    }

    /// Options of one source's library: fast math off for the files
    /// kernel_list.h marks PYFA_METAL_SAFE_MATH_FILE (results that must be
    /// the CPU's bits), Metal's defaults (fast math) for the rest.
    static func compileOptions(_ file: String) -> MTLCompileOptions? {
        guard pyfa_metal_file_safe_math(file) != 0 else { return nil }
        let options = MTLCompileOptions()
        if #available(macOS 15.0, iOS 18.0, *) {
            options.mathMode = .safe
            options.mathFloatingPointFunctions = .precise
        } else {
            options.fastMathEnabled = false
        }
        return options
    }

    /// The library of one source file; compiled once, also when threads race
    /// (the lock is held while it compiles).
    private func library(_ file: String) throws -> MTLLibrary {
        try lock.withLock {
            if let l = libraries[file] { return l }
            let source = try MetalSource.expanded(file)
            let library: MTLLibrary
            do {
                library = try device.makeLibrary(source: source, options: MetalBackend.compileOptions(file))
            } catch {
                throw PyfaError.compile("Metal source \(file): \(error)")
            }
            libraries[file] = library
            return library
        }
    }
}

/// Embedded kernel sources with their quoted includes inlined (each header
/// once), since a library compiled from a string has no include path.
enum MetalSource {
    static func text(_ file: String) throws -> String {
        var length = 0
        guard let raw = pyfa_metal_source(file, &length) else {
            throw PyfaError.internal("Metal source \(file): not embedded (native/MetalSources/sources.c)")
        }
        return String(decoding: UnsafeRawBufferPointer(start: raw, count: length), as: UTF8.self)
    }

    static func expanded(_ file: String) throws -> String {
        var included: Set<String> = []
        return try expand(file, &included)
    }

    private static func expand(_ file: String, _ included: inout Set<String>) throws -> String {
        included.insert(file)
        var out = ""
        for line in try text(file).split(separator: "\n", omittingEmptySubsequences: false) {
            let trimmed = line.drop { $0 == " " || $0 == "\t" }
            if trimmed.hasPrefix("#pragma once") { continue }
            if trimmed.hasPrefix("#include \""), let header = trimmed.dropFirst(10).split(separator: "\"").first {
                let name = String(header)
                if !included.contains(name) { out += try expand(name, &included) }
                continue
            }
            out += line
            out += "\n"
        }
        return out
    }
}
