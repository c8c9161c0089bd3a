/// Kernels by name, compiled on first use and cached per function-constant
/// values. Thread-safe: the lock guards the cache, and a miss compiles outside
/// it, so one slow compile does not stall lookups of other kernels; when two
/// threads race on the same key the first stored pipeline wins.
public final class KernelRegistry {
    public struct Key: Hashable, CustomStringConvertible {
        public let name: String
        public let constants: [Int32]
        public var description: String {
            constants.isEmpty ? name : name + "_fc" + constants.map { String($0) }.joined(separator: "_")
        }
    }

    private let lock = Lock()
    private var pipelines: [Key: Pipeline] = [:]
    private let compile: (String, [Int32]) throws -> Pipeline

    init(compile: @escaping (String, [Int32]) throws -> Pipeline) {
        self.compile = compile
    }

    public func pipeline(_ name: String, constants: [Int32] = []) throws -> Pipeline {
        let key = Key(name: name, constants: constants)
        if let p = lock.withLock({ pipelines[key] }) { return p }
        let fresh = try compile(name, constants)
        return lock.withLock {
            if let p = pipelines[key] { return p }
            pipelines[key] = fresh
            return fresh
        }
    }

    public var cachedCount: Int { lock.withLock { pipelines.count } }
}
