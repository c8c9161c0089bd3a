import CPyfa

/// One backend's device with its kernel registry.
public final class Device {
    public let backend: Backend
    public let registry: KernelRegistry

    init(backend: Backend) {
        self.backend = backend
        self.registry = KernelRegistry(compile: { [unowned backend] name, constants in
            try backend.compile(name: name, constants: constants)
        })
    }

    /// Backends compiled into this library, best first; "auto" tries them in
    /// this order. Each GPU backend registers itself in Backends/<name>/.
    public static let compiledBackends: [String] = gpuBackendNames + ["cpu"]

    /// Opens "auto", "cpu", "cuda" or "metal". "auto" takes the first backend
    /// whose device opens, ending with the CPU.
    public static func open(_ name: String) throws -> Device {
        switch name {
        case "cpu":
            return Device(backend: try CPUBackend())
        case "auto":
            // Only a backend that runs on a GPU beats the CPU (the Metal
            // executor on Linux opens, but runs on the CPU).
            for candidate in gpuBackendNames {
                if let d = try? open(candidate), d.backend.info.is_gpu != 0 { return d }
            }
            return try open("cpu")
        case "cuda", "metal":
            guard gpuBackendNames.contains(name), let opener = gpuBackendOpeners[name] else {
                throw PyfaError.unavailable("backend '\(name)': not compiled into this library (compiled: \(compiledBackends.joined(separator: ", ")))")
            }
            return Device(backend: try opener())
        default:
            throw PyfaError.invalid("backend: unknown backend '\(name)' (expected auto, cpu, cuda or metal)")
        }
    }

    public func makeBuffer(dtype: DType, shape: [Int], storage: Storage = .shared) throws -> Buffer {
        let bytes = try Buffer.byteCount(dtype: dtype, shape: shape)
        let memory = try backend.allocate(bytes: bytes, storage: storage)
        return Buffer(device: self, dtype: dtype, shape: shape, storage: storage, nbytes: bytes, memory: memory)
    }

    /// Wraps caller-owned memory; it must outlive the buffer and any work using it.
    /// `data`: the memory holds an op's rows, aligned as BackendPlan.wrapAlignment says.
    public func wrapBuffer(address: UInt64, nbytes: Int, dtype: DType, shape: [Int], data: Bool = false) throws -> Buffer {
        let needed = try Buffer.byteCount(dtype: dtype, shape: shape)
        try require(address != 0 || needed == 0, "data: NULL pointer for a non-empty buffer")
        try require(nbytes >= needed, "nbytes: \(nbytes) bytes cannot hold shape \(shape) of \(dtype.name) (\(needed) bytes)")
        if needed > 0 { try requireAligned(address, dtype: dtype, data: data) }
        let memory = try backend.wrap(address: address, bytes: needed)
        let storage: Storage = memory.hostPointer != nil ? .shared : .private
        return Buffer(device: self, dtype: dtype, shape: shape, storage: storage, nbytes: needed, memory: memory)
    }

    /// The backend's alignment rule for memory at `address` (BackendPlan.wrapAlignment).
    func requireAligned(_ address: UInt64, dtype: DType, data: Bool) throws {
        let alignment = backend.plan.wrapAlignment(dtype: dtype, data: data)
        try require(address % UInt64(alignment) == 0,
                    "data: 0x\(String(address, radix: 16)) is not \(alignment)-byte aligned: the \(backend.name) kernels read "
                        + "\(dtype.name) memory in \(alignment)-byte pieces (a view that starts at an element offset; pass a copy)")
    }

    public func makeEncoder() throws -> CommandEncoder {
        CommandEncoder(device: self, queue: try backend.makeQueue())
    }
}
