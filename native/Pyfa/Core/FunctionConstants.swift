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
        var values = [Int32](repeating: 0, count: Int(max(0, count)))
        var set = [Bool](repeating: false, count: values.count)
        for (index, value) in pairs {
            guard index >= 0 && Int(index) < values.count else {
                throw PyfaError.internal("function constant index \(index) is outside 0..<\(count)")
            }
            guard !set[Int(index)] else {
                throw PyfaError.internal("function constant \(index) set twice")
            }
            values[Int(index)] = value
            set[Int(index)] = true
        }
        if let missing = set.firstIndex(of: false) {
            throw PyfaError.internal("function constant \(missing) of \(count) not set")
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
