import Glibc

public typealias MTLCommandBufferHandler = @Sendable (MTLCommandBuffer) -> Void

/// Encoded work. commit() hands it to its queue's thread, which runs its
/// encoders' dispatches (Execution.swift); the first failing dispatch sets
/// status .error and error, and the rest are skipped. Misuse that Apple's
/// validation layer traps on (an encoder left open, a bad binding) fails the
/// command buffer with a MTLCommandBufferError saying what it was.
public protocol MTLCommandBuffer: AnyObject {
    var device: MTLDevice { get }
    var commandQueue: MTLCommandQueue { get }
    var label: String? { get set }
    var retainedReferences: Bool { get }
    var status: MTLCommandBufferStatus { get }
    var error: Error? { get }
    /// Monotonic-clock seconds around the execution (0 until it ran).
    var gpuStartTime: CFTimeInterval { get }
    var gpuEndTime: CFTimeInterval { get }
    var kernelStartTime: CFTimeInterval { get }
    var kernelEndTime: CFTimeInterval { get }

    func makeComputeCommandEncoder() -> MTLComputeCommandEncoder?
    func makeComputeCommandEncoder(dispatchType: MTLDispatchType) -> MTLComputeCommandEncoder?

    func enqueue()
    func commit()
    func waitUntilScheduled()
    func waitUntilCompleted()
    func addScheduledHandler(_ block: @escaping MTLCommandBufferHandler)
    func addCompletedHandler(_ block: @escaping MTLCommandBufferHandler)

    func pushDebugGroup(_ string: String)
    func popDebugGroup()
}

final class ExecutorCommandBuffer: MTLCommandBuffer, @unchecked Sendable {
    let queue: ExecutorCommandQueue
    private let state = Monitor()
    private var labelValue: String?
    private var statusValue = MTLCommandBufferStatus.notEnqueued
    private var errorValue: MTLCommandBufferError?
    private var startTime: CFTimeInterval = 0
    private var endTime: CFTimeInterval = 0
    private var passes: [EncodedPass] = []
    private var openEncoder = false
    private var misuse: MTLCommandBufferError?
    private var scheduledHandlers: [MTLCommandBufferHandler] = []
    private var completedHandlers: [MTLCommandBufferHandler] = []
    private var finished = false       // handlers have run; waiters may go
    private var holdsSlot = true       // counts against the queue's maxCommandBufferCount
    private var executingThread: pthread_t?

    init(queue: ExecutorCommandQueue) { self.queue = queue }

    deinit {
        if holdsSlot { queue.releaseSlot() }
    }

    var device: MTLDevice { queue.executorDevice }
    var commandQueue: MTLCommandQueue { queue }
    var retainedReferences: Bool { true }
    var label: String? {
        get { state.withLock { labelValue } }
        set { state.withLock { labelValue = newValue } }
    }
    var status: MTLCommandBufferStatus { state.withLock { statusValue } }
    var error: Error? { state.withLock { errorValue } }
    var gpuStartTime: CFTimeInterval { state.withLock { startTime } }
    var gpuEndTime: CFTimeInterval { state.withLock { endTime } }
    var kernelStartTime: CFTimeInterval { gpuStartTime }
    var kernelEndTime: CFTimeInterval { gpuEndTime }

    func makeComputeCommandEncoder() -> MTLComputeCommandEncoder? {
        makeComputeCommandEncoder(dispatchType: .serial)
    }

    func makeComputeCommandEncoder(dispatchType: MTLDispatchType) -> MTLComputeCommandEncoder? {
        state.withLock {
            if statusValue != .notEnqueued && statusValue != .enqueued {
                noteMisuse("makeComputeCommandEncoder after commit")
            } else if openEncoder {
                noteMisuse("makeComputeCommandEncoder while another encoder has not called endEncoding")
            }
            openEncoder = true
        }
        return ExecutorComputeEncoder(commandBuffer: self, dispatchType: dispatchType)
    }

    /// Called by the encoder's endEncoding.
    func append(_ pass: EncodedPass) {
        state.withLock {
            if statusValue != .notEnqueued && statusValue != .enqueued {
                noteMisuse("endEncoding after the command buffer was committed")
                return
            }
            passes.append(pass)
            openEncoder = false
        }
    }

    /// Records misuse; the first one becomes the command buffer's error and
    /// nothing of it runs. Call with the lock held.
    private func noteMisuse(_ message: String) {
        if misuse == nil { misuse = MTLCommandBufferError(.invalidResource, message) }
    }

    /// Misuse of an encoder after its endEncoding.
    func recordMisuse(_ error: MTLCommandBufferError) {
        state.withLock { if misuse == nil { misuse = error } }
    }

    func enqueue() {
        state.withLock { if statusValue == .notEnqueued { statusValue = .enqueued } }
    }

    func commit() {
        let submit: Bool = state.withLock {
            guard statusValue == .notEnqueued || statusValue == .enqueued else { return false }
            if openEncoder { noteMisuse("commit while an encoder has not called endEncoding") }
            statusValue = .committed
            return true
        }
        if submit { queue.worker.submit(self) }
    }

    func waitUntilScheduled() {
        state.withLock {
            while statusValue == .committed {
                state.wait()
            }
        }
    }

    /// Returns once the command buffer has run and its completed handlers
    /// have returned (at once if it was never committed, or when called from
    /// one of its own handlers).
    func waitUntilCompleted() {
        state.withLock {
            while !finished && statusValue != .notEnqueued && statusValue != .enqueued && !onExecutingThread() {
                state.wait()
            }
        }
    }

    private func onExecutingThread() -> Bool {
        guard let executingThread else { return false }
        return pthread_equal(executingThread, pthread_self()) != 0
    }

    func addScheduledHandler(_ block: @escaping MTLCommandBufferHandler) {
        let now: Bool = state.withLock {
            if statusValue.rawValue >= MTLCommandBufferStatus.scheduled.rawValue { return true }
            scheduledHandlers.append(block)
            return false
        }
        if now { block(self) }
    }

    func addCompletedHandler(_ block: @escaping MTLCommandBufferHandler) {
        let now: Bool = state.withLock {
            if finished { return true }
            completedHandlers.append(block)
            return false
        }
        if now { block(self) }
    }

    func pushDebugGroup(_ string: String) {}
    func popDebugGroup() {}

    /// Runs on the queue's thread: the whole life of a committed buffer.
    func execute() {
        var (work, problem, scheduled): ([EncodedPass], MTLCommandBufferError?, [MTLCommandBufferHandler]) = state.withLock {
            statusValue = .scheduled
            startTime = monotonicSeconds()
            executingThread = pthread_self()
            defer { passes = []; scheduledHandlers = [] }
            state.broadcast()
            return (passes, misuse, scheduledHandlers)
        }
        for handler in scheduled { handler(self) }

        let failure = problem ?? runPasses(work)
        work = []  // the buffers and pipelines it retained go before anyone is told it completed
        scheduled = []

        let completed: [MTLCommandBufferHandler] = state.withLock {
            endTime = monotonicSeconds()
            errorValue = failure
            statusValue = failure == nil ? .completed : .error
            defer { completedHandlers = [] }
            return completedHandlers
        }
        for handler in completed { handler(self) }
        let releaseSlot: Bool = state.withLock {
            finished = true
            executingThread = nil
            state.broadcast()
            defer { holdsSlot = false }
            return holdsSlot
        }
        if releaseSlot { queue.releaseSlot() }
    }
}
