import CPyfa

/// A failure that crosses the C ABI as a status code plus a message.
/// Codes are the PYFA_ERR_* values of pyfa.h.
public struct PyfaError: Error, CustomStringConvertible {
    public let status: Int32
    public let message: String

    public init(_ status: Int32, _ message: String) {
        self.status = status
        self.message = message
    }

    public static func invalid(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_INVALID_ARGUMENT, message) }
    public static func unsupported(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_UNSUPPORTED, message) }
    public static func outOfMemory(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_OUT_OF_MEMORY, message) }
    public static func unavailable(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_BACKEND_UNAVAILABLE, message) }
    public static func compile(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_COMPILE, message) }
    public static func execution(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_EXECUTION, message) }
    public static func `internal`(_ message: String) -> PyfaError { PyfaError(PYFA_ERR_INTERNAL, message) }

    public var description: String { message }
}

/// Checks a rule about an argument; the message names the argument and the rule.
@inline(__always)
func require(_ condition: Bool, _ message: @autoclosure () -> String) throws {
    if !condition { throw PyfaError.invalid(message()) }
}

/// a * b for sizes, failing with a clear error instead of trapping on overflow.
/// Inlined so the array literal of a call site needs no heap allocation.
@inline(__always)
func checkedProduct(_ values: [Int], what: String) throws -> Int {
    var total = 1
    for v in values {
        let (r, overflow) = total.multipliedReportingOverflow(by: v)
        if overflow { throw PyfaError.invalid("\(what): size overflows 64 bits") }
        total = r
    }
    return total
}

/// a + b for sizes, failing with a clear error instead of trapping on overflow.
func checkedSum(_ a: Int, _ b: Int, what: String) throws -> Int {
    let (r, overflow) = a.addingReportingOverflow(b)
    if overflow { throw PyfaError.invalid("\(what): size overflows 64 bits") }
    return r
}

/// The product of 32-bit counts that a kernel holds in a 32-bit field (a row
/// count, a grid dimension): an error naming `what` when it does not fit.
@inline(__always)
func checkedCount32(_ values: [UInt32], what: String) throws -> UInt32 {
    var total: UInt64 = 1
    for v in values {
        let (r, overflow) = total.multipliedReportingOverflow(by: UInt64(v))
        if overflow || r > UInt64(UInt32.max) {
            throw PyfaError.invalid("\(what): \(values.map(String.init).joined(separator: " * ")) exceeds \(UInt32.max)")
        }
        total = r
    }
    return UInt32(total)
}
