import CPyfa

/// The function-constant values of one kernel specialisation, set by index:
/// the PYFA_<FAMILY>_FC_* names of the op family's header. Every index below
/// the family's PYFA_<FAMILY>_FC_COUNT is set exactly once, so a kernel never
/// reads a constant the dispatcher forgot; backends read `values` by index
/// (CPU: the dispatch's constants array; CUDA: template arguments in index
/// order; Metal: MTLFunctionConstantValues at each index, type int).
public struct FunctionConstants: Hashable, CustomStringConvertible, Sendable {
    /// values[i] is the constant at index i.
    public let values: [Int32]

    public static let none = FunctionConstants(values: [])

    private init(values: [Int32]) { self.values = values }

    /// Builds the constants of a family with `count` indices from
    /// (index, value) pairs, e.g. `[PYFA_VEC_FC_HEAD_DIM: 128, ...]`.
    public init(count: Int32, _ pairs: KeyValuePairs<Int32, Int32>) throws {
        // Families have at most 64 constants: which are set is a bit mask, not a
        // second array (ops build constants on every dispatch).
        guard count >= 0 && count <= 64 else {
            throw PyfaError.internal("function constant count \(count) is outside 0...64")
        }
        var values = [Int32](repeating: 0, count: Int(count))
        var set: UInt64 = 0
        for (index, value) in pairs {
            guard index >= 0 && index < count else {
                throw PyfaError.internal("function constant index \(index) is outside 0..<\(count)")
            }
            let bit: UInt64 = 1 << UInt64(index)
            guard set & bit == 0 else {
                throw PyfaError.internal("function constant \(index) set twice")
            }
            values[Int(index)] = value
            set |= bit
        }
        let all: UInt64 = count == 64 ? ~0 : (1 << UInt64(count)) - 1
        if set != all {
            throw PyfaError.internal("function constant \((~set & all).trailingZeroBitCount) of \(count) not set")
        }
        self.init(values: values)
    }

    /// (index, value) pairs in index order.
    public var entries: [(index: Int, value: Int32)] {
        values.enumerated().map { (index: $0.offset, value: $0.element) }
    }

    /// `_fc` + values joined by `_` (empty when there are none): part of cache keys and names.
    public var description: String {
        values.isEmpty ? "" : "_fc" + values.map { String($0) }.joined(separator: "_")
    }
}
