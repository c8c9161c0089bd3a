import CPyfa
import PyfaShaderCommon

/// A list of pyfa_supported() (the shader headers' X-macros), in header order.
func supportedList(_ what: String) -> [UInt32] {
    guard let text = pyfa_supported(what) else { return [] }
    return String(cString: text).split(separator: ",").compactMap { UInt32($0) }
}

/// Element types the attention kernels read and write.
let attentionFloatTypes: [DType] = supportedList("attn_dtypes").compactMap { DType(rawValue: Int32($0)) }

/// Head dims every attention kernel is built for.
let supportedHeadDims: Set<UInt32> = Set(supportedList("head_dims"))

/// Shared argument checks of the attention dispatchers. Each names the
/// argument and the rule it breaks.
enum Check {
    static func headDim(_ d: UInt32) throws {
        try require(supportedHeadDims.contains(d),
                    "head_dim: \(d) is not supported (supported: \(supportedHeadDims.sorted().map(String.init).joined(separator: ", ")))")
    }

    static func heads(_ numHeads: UInt32, _ numKvHeads: UInt32) throws {
        try require(numHeads > 0, "num_heads: must be > 0")
        try require(numKvHeads > 0, "num_kv_heads: must be > 0")
        try require(numHeads % numKvHeads == 0,
                    "num_heads: \(numHeads) must be a multiple of num_kv_heads (\(numKvHeads))")
    }

    static func scale(_ s: Float) throws {
        try require(s.isFinite, "scale: must be finite, got \(s)")
    }

    static func softcap(_ c: Float) throws {
        try require(c.isFinite && c >= 0, "softcap: must be finite and >= 0 (0 disables it), got \(c)")
    }

    /// A buffer argument: present, of an allowed dtype, holding at least `elements`.
    /// `rows`: it holds an op's rows (queries, caches, codes, outputs, workspaces),
    /// which kernels may copy in wide pieces, so its start follows the backend's
    /// rule for rows (BackendPlan.wrapAlignment with data), whoever wrapped it.
    @discardableResult
    static func buffer(_ b: Buffer?, _ name: String, dtypes: [DType], elements: Int, rows: Bool = false) throws -> Buffer {
        guard let b else { throw PyfaError.invalid("\(name): buffer is NULL") }
        try require(dtypes.contains(b.dtype),
                    "\(name): dtype \(b.dtype.name) not accepted (expected \(dtypes.map(\.name).joined(separator: " or ")))")
        try require(b.count >= elements,
                    "\(name): buffer holds \(b.count) elements, needs \(elements)")
        if rows && b.nbytes > 0 {
            do {
                try b.device.requireAligned(b.deviceAddress, dtype: b.dtype, data: true)
            } catch let e as PyfaError {
                throw PyfaError(e.status, "\(name): \(e.message)")
            }
        }
        return b
    }

    /// An output whose memory overlaps an input's would be written while the
    /// kernel still reads that input: refused, naming both. `more` and `last`:
    /// further named inputs beside `inputs`, so a caller checking one output
    /// against a few more buffers builds no second array on every call.
    static func noOverlap(_ out: Buffer?, _ name: String, inputs: [(String, Buffer?)],
                          _ more: (String, Buffer?)? = nil, _ last: (String, Buffer?)? = nil) throws {
        guard let out else { return }
        func check(_ inputName: String, _ input: Buffer?) throws {
            guard let input else { return }
            try require(!out.addressRange.overlaps(input.addressRange),
                        "\(name): overlaps \(inputName) in memory (an output must not alias an input the kernel reads)")
        }
        for (inputName, input) in inputs { try check(inputName, input) }
        if let (inputName, input) = more { try check(inputName, input) }
        if let (inputName, input) = last { try check(inputName, input) }
    }

    static func sameDevice(_ buffers: [Buffer?], _ device: Device) throws {
        for case let b? in buffers {
            try require(b.device === device, "buffers: every buffer must belong to the encoder's device")
        }
    }
}
