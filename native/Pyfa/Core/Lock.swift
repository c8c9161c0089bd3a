#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A pthread mutex. Used instead of Foundation/Synchronization so the core
/// depends on the standard library and libc only.
final class Lock: @unchecked Sendable {
    fileprivate let mutex: UnsafeMutablePointer<pthread_mutex_t>

    init() {
        mutex = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }

    func withLock<T>(_ body: () throws -> T) rethrows -> T {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body()
    }
}

/// A value published once by one thread and awaited by others.
final class Condition: @unchecked Sendable {
    private let lock = Lock()
    private let cond: UnsafeMutablePointer<pthread_cond_t>

    init() {
        cond = UnsafeMutablePointer<pthread_cond_t>.allocate(capacity: 1)
        pthread_cond_init(cond, nil)
    }

    deinit {
        pthread_cond_destroy(cond)
        cond.deallocate()
    }

    /// Runs `update` under the lock, then wakes every waiter.
    func broadcast(_ update: () -> Void) {
        lock.withLock {
            update()
            pthread_cond_broadcast(cond)
        }
    }

    /// Blocks until `ready` returns a value (evaluated under the lock).
    func wait<T>(until ready: () -> T?) -> T {
        pthread_mutex_lock(lock.mutex)
        defer { pthread_mutex_unlock(lock.mutex) }
        while true {
            if let v = ready() { return v }
            pthread_cond_wait(cond, lock.mutex)
        }
    }
}
