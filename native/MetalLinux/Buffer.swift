import Glibc
import MSLExecutor

public protocol MTLResource: AnyObject {
    var label: String? { get set }
    var device: MTLDevice { get }
    var cpuCacheMode: MTLCPUCacheMode { get }
    var storageMode: MTLStorageMode { get }
    var hazardTrackingMode: MTLHazardTrackingMode { get }
    var resourceOptions: MTLResourceOptions { get }
    var allocatedSize: Int { get }
    func setPurgeableState(_ state: MTLPurgeableState) -> MTLPurgeableState
}

/// Host memory a kernel reads and writes. Every storage mode is host memory
/// here (contents() works even for .storageModePrivate, where Apple's
/// pointer must not be used).
public protocol MTLBuffer: MTLResource {
    var length: Int { get }
    /// The address kernels see; here the host address of contents().
    var gpuAddress: UInt64 { get }
    func contents() -> UnsafeMutableRawPointer
    /// Managed-storage flush: nothing to do with unified memory.
    func didModifyRange(_ range: Range<Int>)
}

final class ExecutorBuffer: MTLBuffer, @unchecked Sendable {
    private enum Ownership {
        case executor                                          // mslx_alloc; mslx_free on deinit
        case caller(((UnsafeMutableRawPointer, Int) -> Void)?) // bytesNoCopy; deallocator on deinit
    }

    let executorDevice: ExecutorDevice
    let length: Int
    let resourceOptions: MTLResourceOptions
    let allocatedSize: Int
    private let base: UnsafeMutableRawPointer
    private let ownership: Ownership
    private let state = Monitor()
    private var labelValue: String?

    private init(device: ExecutorDevice, base: UnsafeMutableRawPointer, length: Int, allocatedSize: Int,
                 options: MTLResourceOptions, ownership: Ownership) {
        executorDevice = device
        self.base = base
        self.length = length
        self.allocatedSize = allocatedSize
        resourceOptions = options
        self.ownership = ownership
        device.noteAllocation(allocatedSize)
    }

    /// A buffer from mslx_alloc: fresh anonymous mappings, so zero-filled as
    /// Apple's are; in checking mode its end touches a guard page. nil for a
    /// zero or oversized length, as on Apple.
    static func allocate(device: ExecutorDevice, length: Int, options: MTLResourceOptions) -> ExecutorBuffer? {
        guard length > 0, length <= device.maxBufferLength, let memory = mslx_alloc(length) else { return nil }
        return ExecutorBuffer(device: device, base: memory, length: length, allocatedSize: roundUpToPage(length),
                              options: options, ownership: .executor)
    }

    /// Wraps caller memory. Apple requires a page-aligned pointer and returns
    /// nil otherwise; so does this.
    static func wrap(device: ExecutorDevice, pointer: UnsafeMutableRawPointer, length: Int,
                     options: MTLResourceOptions,
                     deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> ExecutorBuffer? {
        guard length > 0, length <= device.maxBufferLength, UInt(bitPattern: pointer) % pageSize == 0 else {
            return nil
        }
        return ExecutorBuffer(device: device, base: pointer, length: length, allocatedSize: roundUpToPage(length),
                              options: options, ownership: .caller(deallocator))
    }

    deinit {
        executorDevice.noteAllocation(-allocatedSize)
        switch ownership {
        case .executor: mslx_free(base, length)
        case .caller(let deallocator): deallocator?(base, length)
        }
    }

    var device: MTLDevice { executorDevice }
    var label: String? {
        get { state.withLock { labelValue } }
        set { state.withLock { labelValue = newValue } }
    }
    var storageMode: MTLStorageMode { resourceOptions.storageMode }
    var cpuCacheMode: MTLCPUCacheMode { resourceOptions.cpuCacheMode }
    var hazardTrackingMode: MTLHazardTrackingMode { resourceOptions.hazardTrackingMode }
    var gpuAddress: UInt64 { UInt64(UInt(bitPattern: base)) }

    func contents() -> UnsafeMutableRawPointer { base }
    func didModifyRange(_ range: Range<Int>) {}
    func setPurgeableState(_ state: MTLPurgeableState) -> MTLPurgeableState { .nonVolatile }
}

private let pageSize = UInt(max(sysconf(Int32(_SC_PAGESIZE)), 1))

private func roundUpToPage(_ length: Int) -> Int {
    let page = Int(pageSize)
    return (length + page - 1) / page * page
}
