/// Records dispatches and barriers; `commit` submits them in order to the
/// device's queue, `wait` blocks until they finish and reports execution
/// errors. One encoder per thread; encoders of one device may run at once.
///
/// Dispatches between two barriers may run concurrently (a Metal concurrent
/// encoder does so). Ops record the barriers their own dispatches need; the
/// encoder adds one before any dispatch that binds memory a dispatch since
/// the last barrier also binds, so ops recorded into one commit (two decodes
/// sharing a tmp buffer, an op reading another's output) run as if in order.
/// Overlap is judged by address range, without telling reads from writes:
/// two readers of one buffer get a barrier they do not strictly need.
public final class CommandEncoder {
    public let device: Device
    private let queue: CommandQueue
    private var recorded: [EncodedCommand] = []
    private var pendingOpKind: OpKind = .other
    /// Address ranges bound since the last barrier.
    private var segmentRanges: [Range<UInt64>] = []

    /// An encoder that submits to `queue`: Device.makeEncoder passes the
    /// backend's own; tools that capture, reorder or replay commands pass theirs.
    public init(device: Device, queue: CommandQueue) {
        self.device = device
        self.queue = queue
    }

    /// Tags the next dispatch.
    public func setOpKind(_ kind: OpKind) { pendingOpKind = kind }

    public func dispatch(_ pipeline: Pipeline, args: [SlotArg],
                         grid: (UInt32, UInt32, UInt32), threads: (UInt32, UInt32, UInt32),
                         threadgroupMemory: Int = 0, cluster: (UInt32, UInt32, UInt32) = (1, 1, 1)) throws {
        try require(cluster.0 >= 1 && cluster.1 >= 1 && cluster.2 >= 1 && grid.0 % cluster.0 == 0 &&
                    grid.1 % cluster.1 == 0 && grid.2 % cluster.2 == 0,
                    "dispatch \(pipeline.name): cluster \(cluster) does not divide grid \(grid)")
        var ranges: [Range<UInt64>] = []
        ranges.reserveCapacity(args.count)
        for a in args {
            if case .buffer(let b, _) = a.arg {
                try require(b.device === device,
                            "argument \(a.slot) of \(pipeline.name): buffer belongs to another device")
                ranges.append(b.addressRange)
            }
        }
        if ranges.contains(where: { r in segmentRanges.contains { $0.overlaps(r) } }) {
            memoryBarrier()
        }
        segmentRanges += ranges
        recorded.append(.dispatch(EncodedDispatch(pipeline: pipeline, args: args, grid: grid, threads: threads,
                                                  threadgroupMemory: threadgroupMemory, opKind: pendingOpKind,
                                                  cluster: cluster)))
        pendingOpKind = .other
    }

    /// Makes later dispatches see what earlier ones wrote.
    public func memoryBarrier() {
        recorded.append(.barrier)
        segmentRanges.removeAll(keepingCapacity: true)
    }

    public func commit() throws {
        let commands = recorded
        recorded = []
        segmentRanges.removeAll(keepingCapacity: true)
        try queue.submit(commands)
    }

    public func wait() throws { try queue.wait() }

    /// Forgets what was recorded since the last commit.
    public func reset() {
        recorded.removeAll()
        segmentRanges.removeAll()
        pendingOpKind = .other
    }

    /// Device execution seconds of what the last `wait` completed (nil: the
    /// backend has no device clock).
    public var lastDeviceSeconds: Double? { queue.lastDeviceSeconds }

    /// Dispatches recorded and not yet committed.
    public var pendingCount: Int { recorded.count }

    /// Runs later commits on a caller's stream (a CUDA stream handle; 0 = the
    /// encoder's own); backends without streams refuse.
    public func useStream(_ handle: UInt64) throws {
        try queue.useStream(handle)
        boundStream = handle
    }

    /// The caller's stream later commits run on (0: the encoder's own).
    public private(set) var boundStream: UInt64 = 0

    /// Commits, then waits unless the work runs on a caller's stream (which
    /// orders it with the caller's own work instead).
    public func finish() throws {
        try commit()
        if boundStream == 0 { try wait() }
    }

    /// Whether commits are being captured into a graph (a CUDA stream in
    /// capture mode): what they record then replays later.
    public var isCapturing: Bool { queue.isCapturing }
}
