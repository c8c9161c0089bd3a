import Glibc

/// Submits command buffers; a queue runs its committed command buffers one
/// after another, in commit order, on its own thread.
public protocol MTLCommandQueue: AnyObject {
    var label: String? { get set }
    var device: MTLDevice { get }
    func makeCommandBuffer() -> MTLCommandBuffer?
    func makeCommandBufferWithUnretainedReferences() -> MTLCommandBuffer?
}

final class ExecutorCommandQueue: MTLCommandQueue, @unchecked Sendable {
    let executorDevice: ExecutorDevice
    let worker = QueueWorker()
    private let maxCommandBufferCount: Int
    private let state = Monitor()
    private var outstanding = 0
    private var labelValue: String?

    init(device: ExecutorDevice, maxCommandBufferCount: Int) {
        executorDevice = device
        self.maxCommandBufferCount = maxCommandBufferCount
    }

    deinit { worker.stop() }

    var device: MTLDevice { executorDevice }
    var label: String? {
        get { state.withLock { labelValue } }
        set { state.withLock { labelValue = newValue } }
    }

    /// Blocks while maxCommandBufferCount command buffers of this queue are
    /// neither completed nor released, as Apple's queue does.
    func makeCommandBuffer() -> MTLCommandBuffer? {
        state.withLock {
            while outstanding >= maxCommandBufferCount { state.wait() }
            outstanding += 1
        }
        return ExecutorCommandBuffer(queue: self)
    }

    /// Command buffers always retain what they reference here.
    func makeCommandBufferWithUnretainedReferences() -> MTLCommandBuffer? { makeCommandBuffer() }

    func releaseSlot() {
        state.withLock {
            outstanding -= 1
            state.broadcast()
        }
    }
}

/// The thread that runs a queue's command buffers in submission order.
/// Started on the first submission; ends when its queue is gone and nothing
/// is pending (pending command buffers keep their queue alive).
final class QueueWorker: @unchecked Sendable {
    private let state = Monitor()
    private var pending: [ExecutorCommandBuffer] = []
    private var head = 0
    private var running = false
    private var stopping = false
    /// The process whose thread runs the queue: a forked child has no such
    /// thread (and none of the parent's pending work), so it starts afresh.
    private var owner = getpid()

    func submit(_ commandBuffer: ExecutorCommandBuffer) {
        let start: Bool = state.withLock {
            if owner != getpid() {
                owner = getpid()
                running = false
                pending.removeAll()
                head = 0
            }
            pending.append(commandBuffer)
            state.broadcast()
            if running { return false }
            running = true
            return true
        }
        if start && !startThread() {
            // No thread to be had: run on the caller's thread, still in order.
            state.withLock { running = false }
            while let next = take(waiting: false) { next.execute() }
        }
    }

    func stop() {
        state.withLock {
            stopping = true
            state.broadcast()
        }
    }

    private func startThread() -> Bool {
        let context = Unmanaged.passRetained(self).toOpaque()
        var thread = pthread_t()
        let status = pthread_create(&thread, nil, { context in
            let worker = Unmanaged<QueueWorker>.fromOpaque(context!).takeRetainedValue()
            worker.run()
            return nil
        }, context)
        if status != 0 {
            Unmanaged<QueueWorker>.fromOpaque(context).release()
            return false
        }
        pthread_detach(thread)
        return true
    }

    private func run() {
        while let next = take(waiting: true) { next.execute() }
    }

    private func take(waiting: Bool) -> ExecutorCommandBuffer? {
        state.withLock {
            while waiting && head == pending.count && !stopping { state.wait() }
            guard head < pending.count else {
                if waiting { running = false }
                return nil
            }
            let next = pending[head]
            head += 1
            if head == pending.count {
                pending.removeAll(keepingCapacity: true)
                head = 0
            }
            return next
        }
    }
}
