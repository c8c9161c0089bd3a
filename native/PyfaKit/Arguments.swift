import CPyfa

/// Argument conversions shared by the ops: Swift Ints into the C structs'
/// fixed-width fields, each checked so no input traps.
enum Arg {
    static func u32(_ value: Int, _ name: String) throws -> UInt32 {
        guard let v = UInt32(exactly: value) else {
            throw PyfaError(.invalidArgument, "\(name): \(value) must be in 0...\(UInt32.max)")
        }
        return v
    }

    static func i32(_ value: Int, _ name: String) throws -> Int32 {
        guard let v = Int32(exactly: value) else {
            throw PyfaError(.invalidArgument, "\(name): \(value) must fit a 32-bit int")
        }
        return v
    }

    /// A sequence length: the prefill fields are u32, but positions are
    /// int32 there (q_offset may be negative), so lengths stay below 2^31.
    static func length(_ value: Int, _ name: String) throws -> UInt32 {
        try require(value >= 0 && value <= Int(Int32.max), "\(name): \(value) must be in 0...\(Int32.max)")
        return UInt32(value)
    }

    /// An optional window: nil is none (0); else >= 1, and a window wider
    /// than any cache is no window, so large values clamp to UInt32.max.
    static func window(_ value: Int?) throws -> UInt32 {
        guard let value else { return 0 }
        try require(value >= 1, "window: must be nil or >= 1, got \(value)")
        return UInt32(clamping: value)
    }

    /// `scale`, or 1/sqrt(head_dim) when nil (1 for a zero head dim, which
    /// the library then refuses by its own rule).
    static func scale(_ value: Float?, headDim: Int) -> Float {
        value ?? (headDim > 0 ? 1 / Float(headDim).squareRoot() : 1)
    }

    /// Per-sequence values as int32: `values` must hold one per sequence.
    static func perSequence(_ values: [Int], _ name: String, count: Int) throws -> [Int32] {
        try require(values.count == count, "\(name): \(values.count) values, expected one per sequence (\(count))")
        return try values.enumerated().map { try i32($0.element, "\(name)[\($0.offset)]") }
    }

    static func rank(_ b: Buffer, _ name: String, _ ranks: [Int], _ what: String) throws {
        try require(ranks.contains(b.shape.count), "\(name): expected \(what), got shape \(b.shape)")
    }
}

/// A new buffer for an op's result: shared storage where the host sees the
/// device's memory (readable in place), device memory otherwise.
func resultBuffer(_ device: Device, shape: [Int], dtype: DType) throws -> Buffer {
    try Buffer(device, shape: shape, dtype: dtype, storage: device.hostVisible ? .shared : .private)
}

/// An int32 buffer of per-sequence values (kv_len, ring_start). Shared
/// storage: the library reads and checks its values when the op is recorded.
func sequenceBuffer(_ device: Device, _ values: [Int32]) throws -> Buffer {
    let b = try Buffer(device, shape: [values.count], dtype: .int32, storage: .shared)
    try values.withUnsafeBytes { try check(pyfa_buffer_write(b.handle, 0, $0.baseAddress, UInt64($0.count))) }
    return b
}

/// A workspace of `bytes` bytes (rounded up to whole f32 elements), or nil for none.
func workspace(_ device: Device, bytes: UInt64) throws -> Buffer? {
    guard bytes > 0 else { return nil }
    let elements = Int(clamping: (bytes + 3) / 4)
    return try Buffer(device, shape: [elements], dtype: .float32, storage: device.hostVisible ? .shared : .private)
}
