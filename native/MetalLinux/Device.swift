import Glibc
import MSLExecutor

/// The GPU, as Apple's Metal API presents it. On Linux there is exactly one:
/// the MSL CPU executor. Its limits are the executor's (mslx.h).
public protocol MTLDevice: AnyObject {
    var name: String { get }
    var registryID: UInt64 { get }
    var location: MTLDeviceLocation { get }
    var locationNumber: Int { get }
    var isLowPower: Bool { get }
    var isHeadless: Bool { get }
    var isRemovable: Bool { get }
    var hasUnifiedMemory: Bool { get }
    var recommendedMaxWorkingSetSize: UInt64 { get }
    var currentAllocatedSize: Int { get }
    var maxBufferLength: Int { get }
    var maxThreadgroupMemoryLength: Int { get }
    var maxThreadsPerThreadgroup: MTLSize { get }
    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool

    func makeBuffer(length: Int, options: MTLResourceOptions) -> MTLBuffer?
    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer?
    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer?

    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary
    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState

    func makeCommandQueue() -> MTLCommandQueue?
    func makeCommandQueue(maxCommandBufferCount: Int) -> MTLCommandQueue?
}

// Apple's default arguments, as overloads (requirements cannot have defaults).
extension MTLDevice {
    public func makeBuffer(length: Int) -> MTLBuffer? {
        makeBuffer(length: length, options: [])
    }
    public func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int) -> MTLBuffer? {
        makeBuffer(bytes: pointer, length: length, options: [])
    }
    public func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int) -> MTLBuffer? {
        makeBuffer(bytesNoCopy: pointer, length: length, options: [], deallocator: nil)
    }
    public func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int,
                           options: MTLResourceOptions) -> MTLBuffer? {
        makeBuffer(bytesNoCopy: pointer, length: length, options: options, deallocator: nil)
    }
    public func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int,
                           deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer? {
        makeBuffer(bytesNoCopy: pointer, length: length, options: [], deallocator: deallocator)
    }
}

/// The system's default device: the executor, or nil when it cannot run
/// kernels here (no clang, no cache directory, no fiber support).
public func MTLCreateSystemDefaultDevice() -> MTLDevice? {
    ExecutorDevice.shared
}

public func MTLCopyAllDevices() -> [MTLDevice] {
    ExecutorDevice.shared.map { [$0] } ?? []
}

final class ExecutorDevice: MTLDevice, @unchecked Sendable {
    /// Created once, on first use, after a probe compile shows the executor
    /// works (the probe is cached on disk like every kernel).
    static let shared: ExecutorDevice? = ExecutorDevice.probe() ? ExecutorDevice() : nil

    /// Why MTLCreateSystemDefaultDevice returned nil, if it did.
    nonisolated(unsafe) static var unavailableReason = ""

    let name = "MSL CPU executor"
    let registryID: UInt64 = 0x4D53_4C58  // "MSLX"
    let location = MTLDeviceLocation.unspecified
    let locationNumber = 0
    let isLowPower = false
    let isHeadless = false
    let isRemovable = false
    let hasUnifiedMemory = true
    let maxThreadgroupMemoryLength = Int(MSLX_MAX_THREADGROUP_MEMORY)
    let maxThreadsPerThreadgroup = MTLSize(width: Int(MSLX_MAX_THREADS_PER_THREADGROUP),
                                           height: Int(MSLX_MAX_THREADS_PER_THREADGROUP),
                                           depth: Int(MSLX_MAX_THREADS_PER_THREADGROUP))
    let recommendedMaxWorkingSetSize: UInt64
    let maxBufferLength: Int

    private let allocation = Monitor()
    private var allocated = 0

    private init() {
        let pages = UInt64(max(sysconf(Int32(_SC_PHYS_PAGES)), 0))
        let pageSize = UInt64(max(sysconf(Int32(_SC_PAGESIZE)), 0))
        recommendedMaxWorkingSetSize = pages * pageSize
        maxBufferLength = Int(clamping: recommendedMaxWorkingSetSize)
    }

    private static func probe() -> Bool {
        let source = "#include <metal_stdlib>\nusing namespace metal;\n"
            + "kernel void mslx_probe(device uint *out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = i; }\n"
        var error = [CChar](repeating: 0, count: 4096)
        var library: OpaquePointer?
        var status = source.withCString {
            mslx_library_create($0, strlen($0), nil, 0, &library, &error, error.count)
        }
        guard status == MSLX_OK, let library else {
            unavailableReason = executorMessage(error, status: status)
            return false
        }
        defer { mslx_library_release(library) }
        var function: OpaquePointer?
        status = mslx_function_create(library, "mslx_probe", nil, 0, &function, &error, error.count)
        guard status == MSLX_OK, let function else {
            unavailableReason = executorMessage(error, status: status)
            return false
        }
        mslx_function_release(function)
        return true
    }

    var currentAllocatedSize: Int { allocation.withLock { allocated } }

    func noteAllocation(_ bytes: Int) { allocation.withLock { allocated += bytes } }

    /// The executor compiles every feature of the Apple families it knows
    /// (SIMD-group functions and matrices, bfloat); it claims them all.
    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool {
        switch gpuFamily {
        case .mac1, .macCatalyst1, .macCatalyst2: return false
        default: return true
        }
    }

    func makeBuffer(length: Int, options: MTLResourceOptions) -> MTLBuffer? {
        ExecutorBuffer.allocate(device: self, length: length, options: options)
    }

    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer? {
        guard let buffer = ExecutorBuffer.allocate(device: self, length: length, options: options) else { return nil }
        buffer.contents().copyMemory(from: pointer, byteCount: length)
        return buffer
    }

    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer? {
        ExecutorBuffer.wrap(device: self, pointer: pointer, length: length, options: options,
                            deallocator: deallocator)
    }

    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary {
        try ExecutorLibrary(device: self, source: source)
    }

    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState {
        guard let function = computeFunction as? ExecutorFunction, function.device === self else {
            throw MTLLibraryError(.unsupported, "function \(computeFunction.name) was not made by this device")
        }
        return ExecutorPipelineState(device: self, function: try function.specialised())
    }

    func makeCommandQueue() -> MTLCommandQueue? {
        ExecutorCommandQueue(device: self, maxCommandBufferCount: 64)
    }

    func makeCommandQueue(maxCommandBufferCount: Int) -> MTLCommandQueue? {
        maxCommandBufferCount > 0 ? ExecutorCommandQueue(device: self, maxCommandBufferCount: maxCommandBufferCount) : nil
    }
}
