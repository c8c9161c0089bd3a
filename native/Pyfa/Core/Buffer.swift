/// Where a buffer's bytes live.
public enum Storage: Int32, Sendable {
    /// CPU-visible: `contents` points at the bytes.
    case shared = 0
    /// Device-only (GPU memory); reached through `read`/`write` copies.
    case `private` = 1
}

/// Backend-owned memory behind a buffer.
public protocol BufferMemory: AnyObject {
    /// CPU address of the bytes, or nil for device-only memory.
    var hostPointer: UnsafeMutableRawPointer? { get }
    /// Address kernels use (a host address on the CPU, a device address on a GPU).
    var deviceAddress: UInt64 { get }
    func write(offset: Int, from: UnsafeRawPointer, count: Int) throws
    func read(offset: Int, into: UnsafeMutableRawPointer, count: Int) throws
    /// True for a view of caller memory made without a copy or a check, so wrapping the
    /// same memory again would give an equal view (a plan's runs may reuse it).
    var isPlainView: Bool { get }
}

extension BufferMemory {
    public var isPlainView: Bool { false }
}

/// A typed, shaped span of memory on one device.
public final class Buffer {
    public let device: Device
    public let dtype: DType
    public let shape: [Int]
    public let storage: Storage
    public let nbytes: Int
    public let memory: BufferMemory
    /// memory's host and device addresses, read once: a memory's addresses are fixed for its
    /// life, and every dispatch reads them (a stored field, not a call through the protocol).
    public let contents: UnsafeMutableRawPointer?
    public let deviceAddress: UInt64

    public var count: Int { nbytes / dtype.size }

    /// The addresses its bytes occupy (empty for a 0-byte buffer): what
    /// hazard and aliasing checks compare.
    public var addressRange: Range<UInt64> {
        let start = deviceAddress
        return start..<max(start, start &+ UInt64(nbytes))
    }

    init(device: Device, dtype: DType, shape: [Int], storage: Storage, nbytes: Int, memory: BufferMemory) {
        self.device = device
        self.dtype = dtype
        self.shape = shape
        self.storage = storage
        self.nbytes = nbytes
        self.memory = memory
        contents = memory.hostPointer
        deviceAddress = memory.deviceAddress
    }

    /// Bytes a shape of this dtype needs, with the rules every buffer follows.
    static func byteCount(dtype: DType, shape: [Int]) throws -> Int {
        try require(shape.count <= 8, "shape: at most 8 dimensions, got \(shape.count)")
        var total = 1
        for (i, n) in shape.enumerated() {
            try require(n >= 0, "shape[\(i)]: must be >= 0, got \(n)")
            total = try checkedProduct([total, n], what: "shape")
        }
        return try checkedProduct([total, dtype.size], what: "shape")
    }

    public func write(offset: Int, from source: UnsafeRawPointer, count: Int) throws {
        try require(offset >= 0 && count >= 0 && offset <= nbytes && count <= nbytes - offset,
                     "write: range [\(offset), \(offset)+\(count)) is outside the buffer's \(nbytes) bytes")
        try memory.write(offset: offset, from: source, count: count)
    }

    public func read(offset: Int, into destination: UnsafeMutableRawPointer, count: Int) throws {
        try require(offset >= 0 && count >= 0 && offset <= nbytes && count <= nbytes - offset,
                     "read: range [\(offset), \(offset)+\(count)) is outside the buffer's \(nbytes) bytes")
        try memory.read(offset: offset, into: destination, count: count)
    }
}
