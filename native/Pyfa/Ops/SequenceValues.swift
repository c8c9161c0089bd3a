/// Per-sequence int32 values of a decode dispatch (kv_len, ring_start).
public enum SequenceValues {
    /// Values on the host: checked when the dispatch is recorded and sent
    /// with it as inline bytes (no buffer, no copy the caller did not ask for).
    case host([Int32])
    /// Memory the kernels read when the dispatch runs (a GPU array the caller
    /// updates in place, e.g. between CUDA graph replays); checked at record
    /// time only where the library can read it (host-visible memory), and
    /// clamped by the kernels (pyfa_params.h says how).
    case buffer(Buffer)

    static let dtypes: [DType] = [.i32, .u32]

    /// `v` present and of the batch's length and an index dtype.
    static func check(_ v: SequenceValues?, _ name: String, count: Int) throws -> SequenceValues {
        guard let v else { throw PyfaError.invalid("\(name): buffer is NULL") }
        switch v {
        case .host(let values):
            try require(values.count == count, "\(name): \(values.count) values, expected one per sequence (\(count))")
        case .buffer(let b):
            try Check.buffer(b, name, dtypes: dtypes, elements: count)
        }
        return v
    }

    /// The values where the host can read them, else nil.
    func hostValues(count: Int, _ name: String) throws -> [Int32]? {
        switch self {
        case .host(let values):
            return values
        case .buffer(let b):
            guard let p = b.contents else { return nil }
            return (0..<count).map { p.load(fromByteOffset: $0 * 4, as: Int32.self) }
        }
    }

    var buffer: Buffer? {
        if case .buffer(let b) = self { return b }
        return nil
    }

    /// The kernel argument: the buffer, or the values as inline bytes.
    var argument: KernelArg {
        switch self {
        case .host(let values): return values.withUnsafeBytes { .bytes(Array($0)) }
        case .buffer(let b): return .buffer(b)
        }
    }
}
