import CPyfa
import PyfaCUDADriver

/// Device memory (`private` storage), owned or wrapped (a torch/cupy tensor's
/// address, which its producer keeps alive).
final class CUDADeviceMemory: BufferMemory {
    let context: CUDAContext
    let address: CUdeviceptr
    let bytes: Int
    let owned: Bool

    init(context: CUDAContext, bytes: Int) throws {
        self.context = context
        self.bytes = bytes
        owned = true
        try context.makeCurrent()
        var p: CUdeviceptr = 0
        pyfa_count(PYFA_COUNT_DEVICE_ALLOCATION)
        try CU.checkAlloc(pyfa_cu.cuMemAlloc(&p, max(bytes, 16)), "buffer: cuMemAlloc of \(bytes) bytes")
        address = p
    }

    init(context: CUDAContext, wrapping address: CUdeviceptr, bytes: Int) {
        self.context = context
        self.address = address
        self.bytes = bytes
        owned = false
    }

    deinit {
        if owned, (try? context.makeCurrent()) != nil { _ = pyfa_cu.cuMemFree(address) }
    }

    var hostPointer: UnsafeMutableRawPointer? { nil }
    var deviceAddress: UInt64 { UInt64(address) }

    func write(offset: Int, from: UnsafeRawPointer, count: Int) throws {
        guard count > 0 else { return }
        try context.makeCurrent()
        pyfa_count(PYFA_COUNT_HOST_TO_DEVICE)
        try CU.check(pyfa_cu.cuMemcpyHtoD(address + CUdeviceptr(offset), from, count), "buffer write: cuMemcpyHtoD")
    }

    func read(offset: Int, into: UnsafeMutableRawPointer, count: Int) throws {
        guard count > 0 else { return }
        try context.makeCurrent()
        pyfa_count(PYFA_COUNT_DEVICE_TO_HOST)
        try CU.check(pyfa_cu.cuMemcpyDtoH(into, address + CUdeviceptr(offset), count), "buffer read: cuMemcpyDtoH")
    }
}

/// `shared` storage: pinned host memory (the CPU view) mirrored by device
/// memory (what kernels read). A queue copies the host bytes to the device
/// before the first dispatch of a submission that uses the buffer, and the
/// device bytes back after `wait`. Managed memory is avoided on purpose: its
/// page migration is slow for streaming kernels, and oversubscribing it can
/// hang a shared GPU. Host writes between commit and wait are overwritten.
final class CUDASharedMemory: BufferMemory {
    let device: CUDADeviceMemory
    let host: UnsafeMutableRawPointer

    init(context: CUDAContext, bytes: Int) throws {
        device = try CUDADeviceMemory(context: context, bytes: bytes)
        var p: UnsafeMutableRawPointer? = nil
        pyfa_count(PYFA_COUNT_PINNED_ALLOCATION)
        try CU.checkAlloc(pyfa_cu.cuMemHostAlloc(&p, max(bytes, 16), UInt32(PYFA_CU_MEMHOSTALLOC_PORTABLE)),
                          "buffer: cuMemHostAlloc of \(bytes) bytes")
        guard let p else { throw PyfaError.outOfMemory("buffer: cuMemHostAlloc returned NULL") }
        host = p
    }

    deinit {
        if (try? device.context.makeCurrent()) != nil { _ = pyfa_cu.cuMemFreeHost(host) }
    }

    var hostPointer: UnsafeMutableRawPointer? { host }
    var deviceAddress: UInt64 { device.deviceAddress }

    func write(offset: Int, from: UnsafeRawPointer, count: Int) throws {
        if count > 0 { (host + offset).copyMemory(from: from, byteCount: count) }
    }

    func read(offset: Int, into: UnsafeMutableRawPointer, count: Int) throws {
        if count > 0 { into.copyMemory(from: host + offset, byteCount: count) }
    }

    func upload(on stream: CUstream?) throws {
        pyfa_count(PYFA_COUNT_HOST_TO_DEVICE)
        try CU.check(pyfa_cu.cuMemcpyHtoDAsync(device.address, host, device.bytes, stream), "shared buffer upload")
    }

    func download(on stream: CUstream?) throws {
        pyfa_count(PYFA_COUNT_DEVICE_TO_HOST)
        try CU.check(pyfa_cu.cuMemcpyDtoHAsync(host, device.address, device.bytes, stream), "shared buffer download")
    }
}
