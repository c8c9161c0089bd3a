/// Kernels by name, compiled on first use and cached per function-constant
/// values. Thread-safe: the lock guards the cache; a miss compiles outside it,
/// so one slow compile does not stall lookups of other kernels, and threads
/// that miss on the same key while it compiles wait for that one compile
/// instead of compiling it again.
public final class KernelRegistry {
    public struct Key: Hashable, CustomStringConvertible {
        public let name: String
        public let constants: FunctionConstants
        public var description: String { name + constants.description }
    }

    /// A compile in progress or done; its waiters block on `done`.
    private final class Entry {
        var result: Result<Pipeline, Error>? = nil
        let done = Condition()
    }

    private let lock = Lock()
    private var entries: [Key: Entry] = [:]
    private let compile: (String, FunctionConstants) throws -> Pipeline
    private var compiles = 0

    public init(compile: @escaping (String, FunctionConstants) throws -> Pipeline) {
        self.compile = compile
    }

    public func pipeline(_ name: String, constants: FunctionConstants = .none) throws -> Pipeline {
        let key = Key(name: name, constants: constants)
        let (entry, owner) = lock.withLock { () -> (Entry, Bool) in
            if let e = entries[key] { return (e, false) }
            let e = Entry()
            entries[key] = e
            compiles += 1
            return (e, true)
        }
        if owner {
            let result = Result { try compile(name, constants) }
            entry.done.broadcast { entry.result = result }
            if case .failure = result {
                // A failed compile is not cached: a later call may succeed
                // (a missing toolchain installed, a transient error).
                lock.withLock { if entries[key] === entry { entries[key] = nil } }
            }
            return try result.get()
        }
        return try entry.done.wait(until: { entry.result }).get()
    }

    /// Specialisations held (compiled or compiling).
    public var cachedCount: Int { lock.withLock { entries.count } }

    /// Compiles started since the registry was made (a test's race check).
    public var compileCount: Int { lock.withLock { compiles } }
}
