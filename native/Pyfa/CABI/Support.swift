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

/// The live handles of the C ABI. A handle is an id, never an address: ids
/// count up from 1 and are never reused, so a freed handle stays dead (a later
/// object never takes its value) and every use is checked against the
/// registry: a NULL, freed, double-freed, forged or wrong-type handle is an
/// error naming the argument, never a stray read. One lock-protected
/// dictionary; a lookup returns a strong reference, so an object freed by
/// another thread during a call lives until the call returns.
final class HandleRegistry: @unchecked Sendable {
    static let shared = HandleRegistry()

    private let lock = Lock()
    private var live: [UInt: AnyObject] = [:]
    private var next: UInt = 0

    /// Ids are (counter << 4) | 8: non-NULL, 16-aligned-plus-8 so that a
    /// pointer to real memory (16-aligned) is never mistaken for one.
    func insert(_ object: AnyObject) -> OpaquePointer {
        lock.withLock {
            next += 1
            let id = next << 4 | 8
            live[id] = object
            return OpaquePointer(bitPattern: id)!
        }
    }

    func lookup(_ handle: OpaquePointer) -> AnyObject? {
        let id = UInt(bitPattern: handle)
        return lock.withLock { live[id] }
    }

    /// Removes `handle` if it is live and holds a T; returns whether it did.
    func remove<T: AnyObject>(_ handle: OpaquePointer, as: T.Type) -> Bool {
        let id = UInt(bitPattern: handle)
        let removed: AnyObject? = lock.withLock {
            guard live[id] is T else { return nil }
            return live.removeValue(forKey: id)
        }
        return removed != nil  // the object is released here, outside the lock
    }
}

/// The kind a handle error reports ("a buffer", "an encoder", "a device").
private func handleKind<T>(_ type: T.Type) -> String {
    switch type {
    case is Buffer.Type: return "a buffer"
    case is CommandEncoder.Type: return "an encoder"
    case is Device.Type: return "a device"
    case is OpPlan.Type, is DecodePlan.Type, is TQDecodePlan.Type, is PrefillPlan.Type: return "a plan"
    default: return "a \(type)"
    }
}

/// A new handle holding `object` (the registry's reference keeps it alive).
func retainHandle<T: AnyObject>(_ object: T) -> OpaquePointer {
    HandleRegistry.shared.insert(object)
}

/// The live T behind `handle`; an error naming `what` for NULL, freed or
/// another type's handles.
func object<T: AnyObject>(_ handle: OpaquePointer?, _ what: String) throws -> T {
    guard let handle else { throw PyfaError.invalid("\(what): handle is NULL") }
    guard let o = HandleRegistry.shared.lookup(handle) else {
        throw PyfaError.invalid("\(what): not a live handle (freed, or never returned by pyfa)")
    }
    guard let t = o as? T else {
        throw PyfaError.invalid("\(what): handle is not \(handleKind(T.self)) (another type's handle)")
    }
    return t
}

/// nil for NULL; otherwise as `object`.
func optionalObject<T: AnyObject>(_ handle: OpaquePointer?, _ what: String) throws -> T? {
    guard handle != nil else { return nil }
    return try object(handle, what) as T
}

/// Frees a handle of type T. NULL is a no-op; a freed, unknown or other-type
/// handle changes nothing and leaves a message in pyfa_last_error.
func releaseHandle<T: AnyObject>(_ handle: OpaquePointer?, as type: T.Type) {
    guard let handle else { return }
    if !HandleRegistry.shared.remove(handle, as: type) {
        pyfa_set_last_error("free: handle is not a live handle of \(handleKind(type)) (already freed, or another type's)")
    }
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

/// A buffer handle as per-sequence values (nil for NULL).
func sequenceValues(_ handle: OpaquePointer?, _ what: String) throws -> SequenceValues? {
    try optionalObject(handle, what).map { (b: Buffer) in .buffer(b) }
}
