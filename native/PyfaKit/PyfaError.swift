import CPyfa

/// An error of a pyfa call: the C ABI's status code and the message it left
/// in its error slot (`pyfa_last_error`), or a rule this Swift layer checks
/// before calling the library (then `code` is `.invalidArgument`). Messages
/// name the argument and the rule it breaks, e.g.
/// `"kv_len[0]: 9 must be in 1...kv_capacity (8)"`.
public struct PyfaError: Error, Equatable, CustomStringConvertible, Sendable {
    /// The kinds of failure, one per `PYFA_ERR_*` status of pyfa.h.
    public enum Code: Int32, Sendable {
        /// An argument breaks a documented rule (shape, dtype, range).
        case invalidArgument = 1
        /// Valid, but not implemented for this input or backend (e.g. a head dim).
        case unsupported = 2
        /// An allocation failed.
        case outOfMemory = 3
        /// The backend is not compiled in or has no device.
        case backendUnavailable = 4
        /// A kernel failed to compile; the message holds the log.
        case compile = 5
        /// A kernel faulted or the device reported an error.
        case execution = 6
        /// A bug in pyfa (also any status this version does not know).
        case `internal` = 7
    }

    /// What kind of failure this is.
    public let code: Code
    /// The raw status the C call returned (equal to `code.rawValue` unless
    /// the library returned a status this version does not know).
    public let status: Int32
    /// The library's message (or this layer's), naming the argument and the rule.
    public let message: String

    /// An error of the given kind; `status` is the kind's status code.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.status = code.rawValue
        self.message = message
    }

    /// The error of a failed C call: its status and the calling thread's error slot.
    init(status: Int32) {
        self.code = Code(rawValue: status) ?? .internal
        self.status = status
        self.message = pyfa_last_error().map { String(cString: $0) } ?? ""
    }

    /// "PyfaError.<code> (status <n>): <message>".
    public var description: String { "PyfaError.\(code) (status \(status)): \(message)" }
}

/// Throws the error of a C call's status unless it is PYFA_OK. Must run on
/// the thread that made the call, before its next pyfa call (the error slot
/// is per thread and overwritten by the next call).
@inline(__always)
func check(_ status: Int32) throws {
    if status != PYFA_OK { throw PyfaError(status: status) }
}

/// Throws `.invalidArgument` with `message` unless `condition` holds.
@inline(__always)
func require(_ condition: Bool, _ message: @autoclosure () -> String) throws {
    if !condition { throw PyfaError(.invalidArgument, message()) }
}
