import CPyfa
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Facts about the library as built.
public enum Library {
    /// The C ABI's version (`PYFA_ABI_VERSION` of the library that is linked).
    public static var abiVersion: UInt32 { pyfa_abi_version() }

    /// Backends compiled into the library, best first (e.g. `["cuda", "cpu"]`).
    /// A listed backend may still fail to open (no GPU, no driver).
    public static var backends: [String] {
        String(cString: pyfa_backends()).split(separator: ",").map(String.init)
    }

    /// Head dims the attention kernels are built for (64, 80, 96, 128, 192, 256, 512).
    public static var headDims: [Int] { supported("head_dims") }

    /// Head dims the TurboQuant cache supports (powers of two: 64, 128, 256, 512).
    public static var turboQuantHeadDims: [Int] { supported("tq_head_dims") }

    /// Bit widths of TurboQuant codes (2, 3, 4, 8).
    public static var turboQuantBits: [Int] { supported("tq_bits") }

    static func supported(_ what: String) -> [Int] {
        guard let text = pyfa_supported(what) else { return [] }
        return String(cString: text).split(separator: ",").compactMap { Int($0) }
    }
}

/// One device of one backend ("cpu", "cuda" or "metal"). Buffers, caches and
/// ops belong to the device their buffers were made on.
///
/// Ops run synchronously: each records its dispatches on the device's
/// encoder, submits them and waits. Calls from several threads on one device
/// are serialised by a lock (a Device may be shared between threads; a
/// Buffer's contents are the caller's to guard).
public final class Device: @unchecked Sendable {
    let handle: OpaquePointer
    private let lock = Mutex()
    // Created on first use and reused: an encoder owns a stream on CUDA.
    private var encoder: OpaquePointer?

    /// The backend that runs the kernels: "cpu", "cuda" or "metal".
    public let backend: String
    /// The device's name as the backend reports it (a GPU model, or the CPU's).
    public let name: String
    /// True where the CPU reads and writes shared buffers' memory in place, the
    /// memory kernels use (CPU, Metal): `Buffer.withUnsafeMutableBytes` is
    /// zero-copy there. On CUDA, shared buffers are page-locked host memory.
    public let hostVisible: Bool
    /// True when a GPU runs the kernels (false for the CPU backend and for the
    /// Metal backend's executor on Linux).
    public let isGPU: Bool
    /// CPU threads, SMs or GPU cores.
    public let computeUnits: Int
    /// Device memory in bytes (0 if unknown).
    public let memoryBytes: UInt64

    /// Opens a device. `backend`: "auto" (the first GPU backend whose device
    /// opens, else the CPU), "cpu", "cuda" or "metal".
    /// Throws `.backendUnavailable` when the backend is not compiled in or
    /// has no device, `.invalidArgument` for an unknown name.
    public init(backend: String = "auto") throws {
        var h: OpaquePointer?
        try check(pyfa_device_new(&h, backend))
        guard let h else { throw PyfaError(.internal, "pyfa_device_new: returned no device") }
        handle = h
        var info = pyfa_device_info()
        let status = pyfa_device_info_get(h, &info)
        if status != PYFA_OK {
            let error = PyfaError(status: status)
            pyfa_device_free(h)
            throw error
        }
        self.backend = Self.string(info.backend)
        self.name = Self.string(info.name)
        hostVisible = info.host_visible != 0
        isGPU = info.is_gpu != 0
        computeUnits = Int(info.compute_units)
        memoryBytes = info.memory_bytes
    }

    deinit {
        if let encoder { pyfa_encoder_free(encoder) }
        pyfa_device_free(handle)
    }

    /// A NUL-terminated C char array field as a String (an unterminated
    /// field ends at its last byte).
    private static func string<T>(_ field: T) -> String {
        withUnsafeBytes(of: field) { raw in
            let bytes = raw.prefix { $0 != 0 }
            return String(decoding: bytes, as: UTF8.self)
        }
    }

    /// Records `body`'s dispatches on this device's encoder, submits them and
    /// waits for them, holding the device's lock. On a failure the encoder
    /// drops what was recorded, so the next call starts empty.
    func run(_ body: (OpaquePointer) throws -> Void) throws {
        try lock.withLock {
            if encoder == nil {
                var e: OpaquePointer?
                try check(pyfa_encoder_new(&e, handle))
                encoder = e
            }
            guard let e = encoder else { throw PyfaError(.internal, "pyfa_encoder_new: returned no encoder") }
            do {
                try body(e)
                try check(pyfa_encoder_commit(e))
                try check(pyfa_encoder_wait(e))
            } catch {
                _ = pyfa_encoder_reset(e)
                throw error
            }
        }
    }
}

/// A pthread mutex (the module depends on the standard library and libc only).
final class Mutex: @unchecked Sendable {
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>

    init() {
        mutex = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }

    func withLock<T>(_ body: () throws -> T) rethrows -> T {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body()
    }
}
