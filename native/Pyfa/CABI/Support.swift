import CPyfa
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Runs an ABI entry point's body: a PyfaError becomes its status and the
/// thread's last-error message; success clears the message.
@inline(__always)
func abiCall(_ body: () throws -> Void) -> Int32 {
    do {
        try body()
        pyfa_set_last_error(nil)
        return PYFA_OK
    } catch let e as PyfaError {
        pyfa_set_last_error(e.message)
        return e.status
    } catch {
        pyfa_set_last_error("internal error: \(error)")
        return PYFA_ERR_INTERNAL
    }
}

/// Opaque handles are retained Swift objects.
func retainHandle<T: AnyObject>(_ object: T) -> OpaquePointer {
    OpaquePointer(Unmanaged.passRetained(object).toOpaque())
}

func object<T: AnyObject>(_ handle: OpaquePointer?, _ what: String) throws -> T {
    guard let handle else { throw PyfaError.invalid("\(what): handle is NULL") }
    return Unmanaged<T>.fromOpaque(UnsafeRawPointer(handle)).takeUnretainedValue()
}

func optionalObject<T: AnyObject>(_ handle: OpaquePointer?) -> T? {
    guard let handle else { return nil }
    return Unmanaged<T>.fromOpaque(UnsafeRawPointer(handle)).takeUnretainedValue()
}

func releaseHandle<T: AnyObject>(_ handle: OpaquePointer?, as: T.Type) {
    guard let handle else { return }
    Unmanaged<T>.fromOpaque(UnsafeRawPointer(handle)).release()
}

/// The struct a const pointer argument points at.
func value<T>(_ p: UnsafePointer<T>?, _ what: String) throws -> T {
    guard let p else { throw PyfaError.invalid("\(what): NULL") }
    return p.pointee
}

func string(_ p: UnsafePointer<CChar>?, _ what: String) throws -> String {
    guard let p else { throw PyfaError.invalid("\(what): NULL string") }
    return String(cString: p)
}

func writeOut<T>(_ out: UnsafeMutablePointer<T>?, _ value: T, _ what: String) throws {
    guard let out else { throw PyfaError.invalid("\(what): out-pointer is NULL") }
    out.pointee = value
}

func shapeArray(_ ndim: UInt32, _ shape: UnsafePointer<Int64>?) throws -> [Int] {
    try require(ndim <= UInt32(PYFA_MAX_DIMS), "ndim: at most \(PYFA_MAX_DIMS) dimensions, got \(ndim)")
    if ndim == 0 { return [] }
    guard let shape else { throw PyfaError.invalid("shape: NULL with ndim \(ndim)") }
    return (0..<Int(ndim)).map { Int(shape[$0]) }
}
