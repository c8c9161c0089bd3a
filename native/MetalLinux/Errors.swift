// Apple's Metal error types. On Apple they are NSError-bridged structs with a
// nested Code enum, matched as `catch MTLLibraryError.compileFailure` or by
// `(error as? MTLLibraryError)?.code`; both forms work here. The message
// (Apple's localizedDescription) is what String(describing:) prints.

public struct MTLLibraryError: Error, CustomStringConvertible, Sendable {
    public enum Code: UInt, Sendable {
        case unsupported = 1, `internal` = 2, compileFailure = 3, compileWarning = 4
        case functionNotFound = 5, fileNotFound = 6
    }

    public let code: Code
    /// The compiler's or executor's message.
    public let message: String

    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var localizedDescription: String { message }
    public var description: String { "MTLLibraryError.\(code): \(message)" }

    public static var unsupported: Code { .unsupported }
    public static var `internal`: Code { .internal }
    public static var compileFailure: Code { .compileFailure }
    public static var compileWarning: Code { .compileWarning }
    public static var functionNotFound: Code { .functionNotFound }
    public static var fileNotFound: Code { .fileNotFound }
}

public struct MTLCommandBufferError: Error, CustomStringConvertible, Sendable {
    public enum Code: UInt, Sendable {
        case none = 0, `internal` = 1, timeout = 2, pageFault = 3, accessRevoked = 4
        case notPermitted = 7, outOfMemory = 8, invalidResource = 9, memoryless = 10
        case deviceRemoved = 11, stackOverflow = 12
    }

    public let code: Code
    /// What failed: the executor's message, or the API misuse that Apple's
    /// validation layer would have trapped on.
    public let message: String

    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var localizedDescription: String { message }
    public var description: String { "MTLCommandBufferError.\(code): \(message)" }

    public static var `internal`: Code { .internal }
    public static var timeout: Code { .timeout }
    public static var pageFault: Code { .pageFault }
    public static var accessRevoked: Code { .accessRevoked }
    public static var notPermitted: Code { .notPermitted }
    public static var outOfMemory: Code { .outOfMemory }
    public static var invalidResource: Code { .invalidResource }
    public static var memoryless: Code { .memoryless }
    public static var deviceRemoved: Code { .deviceRemoved }
    public static var stackOverflow: Code { .stackOverflow }
}

/// `catch MTLLibraryError.compileFailure { ... }`
public func ~= (code: MTLLibraryError.Code, error: any Error) -> Bool {
    (error as? MTLLibraryError)?.code == code
}

/// `catch MTLCommandBufferError.pageFault { ... }`
public func ~= (code: MTLCommandBufferError.Code, error: any Error) -> Bool {
    (error as? MTLCommandBufferError)?.code == code
}

/// Turns an executor error buffer (NUL-terminated) into a String.
func executorMessage(_ buffer: [CChar], status: Int32) -> String {
    let text = buffer.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
    return text.isEmpty ? "MSL executor error \(status)" : text
}
