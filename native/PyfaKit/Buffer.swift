import CPyfa

/// A typed, shaped span of memory on one device: row-major (C order)
/// elements of one `DType`. Ops read their inputs from buffers and return new
/// buffers; shapes are checked against each op's contract.
///
/// Host access: `withUnsafeMutableBytes` / `withUnsafeBytes` give the memory
/// itself for shared storage; `write(_:)` and `floats()` convert to and from
/// `[Float]` on any storage; `write(bytes:)` and `bytes()` copy raw bytes.
///
/// Sendable: its properties never change and the library's buffer calls are
/// thread-safe; ordering writes of the contents against other threads' reads
/// and ops is the caller's to do.
public final class Buffer: @unchecked Sendable {
    /// Where a buffer's bytes live.
    public enum Storage: Int32, Sendable {
        /// CPU-visible memory: host access needs no copy.
        case shared = 0
        /// Device-only memory (on a GPU); reached through copies.
        case `private` = 1
    }

    let handle: OpaquePointer
    /// The device the buffer belongs to (kept alive by the buffer).
    public let device: Device
    /// The element type.
    public let dtype: DType
    /// The dimensions, outermost first (at most 8; a 0-d buffer holds one element).
    public let shape: [Int]
    /// Where the bytes live.
    public let storage: Storage
    /// Elements: the product of `shape`.
    public let count: Int
    /// Bytes: `count * dtype.size`.
    public var nbytes: Int { count * dtype.size }

    /// Allocates a buffer of `shape` and `dtype` on `device` (contents
    /// unspecified). Throws `.invalidArgument` for more than 8 dimensions, a
    /// negative dimension or a byte size that overflows, `.outOfMemory` when
    /// the allocation fails.
    public init(_ device: Device, shape: [Int], dtype: DType, storage: Storage = .shared) throws {
        try require(shape.count <= Int(PYFA_MAX_DIMS), "shape: at most \(PYFA_MAX_DIMS) dimensions, got \(shape.count)")
        var count = 1
        for (i, n) in shape.enumerated() {
            try require(n >= 0, "shape[\(i)]: must be >= 0, got \(n)")
            let (product, overflow) = count.multipliedReportingOverflow(by: n)
            try require(!overflow, "shape: \(shape) has too many elements")
            count = product
        }
        try require(!count.multipliedReportingOverflow(by: dtype.size).overflow, "shape: \(shape) has too many bytes")
        let dims = shape.map { Int64($0) }
        var h: OpaquePointer?
        try check(pyfa_buffer_new(&h, device.handle, dtype.rawValue, UInt32(dims.count), dims, storage.rawValue))
        guard let h else { throw PyfaError(.internal, "pyfa_buffer_new: returned no buffer") }
        handle = h
        self.device = device
        self.shape = shape
        self.dtype = dtype
        self.storage = storage
        self.count = count
    }

    /// A buffer of `shape` and float `dtype` holding `values` (row-major),
    /// each rounded to `dtype` to nearest even. Throws `.invalidArgument`
    /// when `values.count` differs from the shape's element count or
    /// `dtype` is not a float type.
    public convenience init(_ device: Device, shape: [Int], dtype: DType, values: [Float],
                            storage: Storage = .shared) throws {
        try require(dtype.isFloat, "dtype: \(dtype) is not a float type (f32, f16 or bf16) for Float values")
        try self.init(device, shape: shape, dtype: dtype, storage: storage)
        try write(values)
    }

    deinit { pyfa_buffer_free(handle) }

    /// Calls `body` with the buffer's own memory (zero-copy) and returns its
    /// result. Throws `.invalidArgument` for private storage (use `bytes()` /
    /// `write(bytes:)`). The pointer is valid only inside `body`; no op may
    /// run on this buffer meanwhile.
    public func withUnsafeMutableBytes<R>(_ body: (UnsafeMutableRawBufferPointer) throws -> R) throws -> R {
        try body(UnsafeMutableRawBufferPointer(start: try contents(), count: nbytes))
    }

    /// Read-only `withUnsafeMutableBytes`.
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) throws -> R {
        try body(UnsafeRawBufferPointer(start: try contents(), count: nbytes))
    }

    private func contents() throws -> UnsafeMutableRawPointer? {
        try require(storage == .shared, "buffer: private storage has no host view; use bytes() or write(bytes:)")
        if nbytes == 0 { return nil }
        guard let p = pyfa_buffer_contents(handle) else {
            throw PyfaError(.internal, "pyfa_buffer_contents: no host memory for a shared buffer")
        }
        return p
    }

    /// Copies `bytes` into the buffer from its first byte (any storage).
    /// Throws `.invalidArgument` unless `bytes.count == nbytes`.
    public func write(bytes: [UInt8]) throws {
        try require(bytes.count == nbytes, "bytes: \(bytes.count) bytes, the buffer holds \(nbytes)")
        try writeElements(bytes)
    }

    /// A copy of the buffer's bytes (any storage).
    public func bytes() throws -> [UInt8] {
        try readElements(UInt8.self)
    }

    /// Stores `values` (row-major, one per element) converted to the buffer's
    /// float dtype, rounded to nearest even (any storage). Throws
    /// `.invalidArgument` when the dtype is not f32/f16/bf16 or
    /// `values.count != count`.
    public func write(_ values: [Float]) throws {
        try require(dtype.isFloat, "buffer: dtype \(dtype) is not a float type (f32, f16 or bf16)")
        try require(values.count == count, "values: \(values.count) values, the buffer of shape \(shape) holds \(count)")
        switch dtype {
        case .float16: try writeElements(values.map(HalfBits.toFloat16))
        case .bfloat16: try writeElements(values.map(HalfBits.toBFloat16))
        default: try writeElements(values)
        }
    }

    /// The elements as Float (exact for every float dtype), row-major (any
    /// storage). Throws `.invalidArgument` when the dtype is not f32/f16/bf16.
    public func floats() throws -> [Float] {
        try require(dtype.isFloat, "buffer: dtype \(dtype) is not a float type (f32, f16 or bf16)")
        switch dtype {
        case .float16: return try readElements(UInt16.self).map(HalfBits.fromFloat16)
        case .bfloat16: return try readElements(UInt16.self).map(HalfBits.fromBFloat16)
        default: return try readElements(Float.self)
        }
    }

    /// Copies `elements` (nbytes in all) to the buffer; a 0-byte buffer has nothing to copy.
    private func writeElements<T>(_ elements: [T]) throws {
        guard nbytes > 0 else { return }
        try elements.withUnsafeBytes { try check(pyfa_buffer_write(handle, 0, $0.baseAddress, UInt64($0.count))) }
    }

    /// The buffer's nbytes as elements of T.
    private func readElements<T: Numeric>(_: T.Type) throws -> [T] {
        var result = [T](repeating: 0, count: nbytes / MemoryLayout<T>.stride)
        guard nbytes > 0 else { return result }
        try result.withUnsafeMutableBytes { try check(pyfa_buffer_read(handle, 0, $0.baseAddress, UInt64($0.count))) }
        return result
    }

    /// Throws unless the buffer belongs to `device` (ops take one device).
    func requireDevice(_ device: Device, _ name: String) throws {
        try require(self.device === device, "\(name): belongs to another device than the op's first buffer")
    }
}
