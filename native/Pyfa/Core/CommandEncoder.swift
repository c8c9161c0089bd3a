/// Records dispatches and barriers; `commit` submits them in order to the
/// device's queue, `wait` blocks until they finish and reports execution
/// errors. One encoder per thread; encoders of one device may run at once.
public final class CommandEncoder {
    public let device: Device
    private let queue: CommandQueue
    private var recorded: [EncodedCommand] = []
    private var pendingOpKind: OpKind = .other

    /// An encoder that submits to `queue`: Device.makeEncoder passes the
    /// backend's own; tools that capture, reorder or replay commands pass theirs.
    public init(device: Device, queue: CommandQueue) {
        self.device = device
        self.queue = queue
    }

    /// Tags the next dispatch.
    public func setOpKind(_ kind: OpKind) { pendingOpKind = kind }

    public func dispatch(_ pipeline: Pipeline, args: [(slot: Int, arg: KernelArg)],
                         grid: (UInt32, UInt32, UInt32), threads: (UInt32, UInt32, UInt32),
                         threadgroupMemory: Int = 0) throws {
        for (slot, arg) in args {
            if case .buffer(let b, _) = arg {
                try require(b.device === device,
                            "argument \(slot) of \(pipeline.name): buffer belongs to another device")
            }
        }
        recorded.append(.dispatch(EncodedDispatch(pipeline: pipeline, args: args, grid: grid, threads: threads,
                                                  threadgroupMemory: threadgroupMemory, opKind: pendingOpKind)))
        pendingOpKind = .other
    }

    /// Makes later dispatches see what earlier ones wrote.
    public func memoryBarrier() { recorded.append(.barrier) }

    public func commit() throws {
        let commands = recorded
        recorded.removeAll()
        try queue.submit(commands)
    }

    public func wait() throws { try queue.wait() }

    /// Dispatches recorded and not yet committed.
    public var pendingCount: Int { recorded.count }

    /// Runs later commits on a caller's stream (a CUDA stream handle; 0 = the
    /// encoder's own); backends without streams refuse.
    public func useStream(_ handle: UInt64) throws { try queue.useStream(handle) }
}
