import Glibc
import MSLExecutor

public protocol MTLCommandEncoder: AnyObject {
    var device: MTLDevice { get }
    var label: String? { get set }
    func endEncoding()
    func insertDebugSignpost(_ string: String)
    func pushDebugGroup(_ string: String)
    func popDebugGroup()
}

/// Records compute dispatches. Each dispatch captures the encoder's state at
/// the time of the call (pipeline, bindings with their buffers' labels,
/// setBytes copies, threadgroup memory lengths). What Apple's validation
/// layer would trap on is recorded instead and fails the command buffer at
/// that point of its execution, with a message naming the call.
public protocol MTLComputeCommandEncoder: MTLCommandEncoder {
    var dispatchType: MTLDispatchType { get }
    func setComputePipelineState(_ state: MTLComputePipelineState)
    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int)
    func setBufferOffset(_ offset: Int, index: Int)
    func setBuffers(_ buffers: [MTLBuffer?], offsets: [Int], range: Range<Int>)
    /// Copies `length` bytes now (at most 4 KiB, as on Apple).
    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int)
    /// `length` must be a multiple of 16, as on Apple.
    func setThreadgroupMemoryLength(_ length: Int, index: Int)
    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize)
    /// Supported when each dimension of threadsPerGrid is a multiple of
    /// threadsPerThreadgroup's (the executor has no partial threadgroups);
    /// otherwise the command buffer fails.
    func dispatchThreads(_ threadsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize)
    /// In a .concurrent encoder, dispatches between barriers may run in any
    /// order (the executor's lane-order option picks it); this orders them.
    func memoryBarrier(scope: MTLBarrierScope)
    func memoryBarrier(resources: [MTLResource])
    func useResource(_ resource: MTLResource, usage: MTLResourceUsage)
}

final class ExecutorComputeEncoder: MTLComputeCommandEncoder, @unchecked Sendable {
    static let bindingCount = Int(MSLX_MAX_BINDINGS)
    static let maxInlineBytes = 4096

    let commandBuffer: ExecutorCommandBuffer
    let dispatchType: MTLDispatchType
    var label: String?
    private var pipeline: ExecutorPipelineState?
    private var bindings = [Binding](repeating: .none, count: bindingCount)
    private var threadgroupMemory = [UInt64](repeating: 0, count: bindingCount)
    private var commands: [Command] = []
    private var ended = false

    init(commandBuffer: ExecutorCommandBuffer, dispatchType: MTLDispatchType) {
        self.commandBuffer = commandBuffer
        self.dispatchType = dispatchType
    }

    var device: MTLDevice { commandBuffer.device }

    private func fail(_ message: String) {
        let error = MTLCommandBufferError(.invalidResource, message)
        if ended { commandBuffer.recordMisuse(error) } else { commands.append(.fail(error)) }
    }

    /// Ensures the encoder is open and the index names a binding slot.
    private func check(_ call: String, index: Int) -> Bool {
        if ended {
            fail("\(call) after endEncoding")
            return false
        }
        if index < 0 || index >= Self.bindingCount {
            fail("\(call): index \(index) is outside 0..<\(Self.bindingCount)")
            return false
        }
        return true
    }

    func setComputePipelineState(_ state: MTLComputePipelineState) {
        guard check("setComputePipelineState", index: 0) else { return }
        guard let state = state as? ExecutorPipelineState, state.executorDevice === commandBuffer.queue.executorDevice else {
            fail("setComputePipelineState: the pipeline state was made by another device")
            return
        }
        pipeline = state
    }

    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int) {
        guard check("setBuffer", index: index) else { return }
        guard let buffer else {
            bindings[index] = .none
            return
        }
        guard let owned = buffer as? ExecutorBuffer, owned.executorDevice === commandBuffer.queue.executorDevice else {
            fail("setBuffer(index: \(index)): the buffer \(buffer.label ?? "(unlabelled)") was made by another device")
            return
        }
        guard offset >= 0 && offset < owned.length else {
            fail("setBuffer(index: \(index)): offset \(offset) is outside buffer \(owned.label ?? "(unlabelled)") of length \(owned.length)")
            return
        }
        bindings[index] = .buffer(owned, offset: offset)
    }

    func setBufferOffset(_ offset: Int, index: Int) {
        guard check("setBufferOffset", index: index) else { return }
        guard case .buffer(let buffer, _) = bindings[index] else {
            fail("setBufferOffset(index: \(index)): no buffer is bound there")
            return
        }
        setBuffer(buffer, offset: offset, index: index)
    }

    func setBuffers(_ buffers: [MTLBuffer?], offsets: [Int], range: Range<Int>) {
        guard buffers.count >= range.count, offsets.count >= range.count else {
            fail("setBuffers: \(buffers.count) buffers and \(offsets.count) offsets for \(range.count) indices")
            return
        }
        for (i, index) in range.enumerated() {
            setBuffer(buffers[i], offset: offsets[i], index: index)
        }
    }

    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int) {
        guard check("setBytes", index: index) else { return }
        guard length >= 0 && length <= Self.maxInlineBytes else {
            fail("setBytes(index: \(index)): length \(length) is over the \(Self.maxInlineBytes)-byte limit; use a buffer")
            return
        }
        bindings[index] = .bytes(InlineBytes(copying: bytes, length: length))
    }

    func setThreadgroupMemoryLength(_ length: Int, index: Int) {
        guard check("setThreadgroupMemoryLength", index: index) else { return }
        guard length >= 0 && length % 16 == 0 else {
            fail("setThreadgroupMemoryLength(index: \(index)): length \(length) is not a multiple of 16")
            return
        }
        threadgroupMemory[index] = UInt64(length)
    }

    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize) {
        guard check("dispatchThreadgroups", index: 0) else { return }
        guard let pipeline else {
            fail("dispatchThreadgroups without a compute pipeline state")
            return
        }
        let groups = [threadgroupsPerGrid.width, threadgroupsPerGrid.height, threadgroupsPerGrid.depth]
        let threads = [threadsPerThreadgroup.width, threadsPerThreadgroup.height, threadsPerThreadgroup.depth]
        let kernel = pipeline.name
        guard threads.allSatisfy({ $0 > 0 }), threads.reduce(1, *) <= pipeline.maxTotalThreadsPerThreadgroup else {
            fail("dispatch of \(kernel): threadsPerThreadgroup \(threads) must be positive with at most \(pipeline.maxTotalThreadsPerThreadgroup) threads")
            return
        }
        guard groups.allSatisfy({ $0 >= 0 && $0 <= Int(UInt32.max) }) else {
            fail("dispatch of \(kernel): threadgroupsPerGrid \(groups) is out of range")
            return
        }
        let memory = threadgroupMemory.reduce(0, +) + UInt64(pipeline.staticThreadgroupMemoryLength)
        guard memory <= UInt64(MSLX_MAX_THREADGROUP_MEMORY) else {
            fail("dispatch of \(kernel): \(memory) bytes of threadgroup memory, over the \(MSLX_MAX_THREADGROUP_MEMORY)-byte limit")
            return
        }
        if groups.contains(0) { return }  // an empty grid runs nothing
        commands.append(.dispatch(RecordedDispatch(
            pipeline: pipeline, bindings: bindings, labels: bindings.map { $0.label },
            threadgroupMemory: threadgroupMemory,
            threadgroups: groups.map { UInt32($0) }, threadsPerThreadgroup: threads.map { UInt32($0) })))
    }

    func dispatchThreads(_ threadsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize) {
        let grid = [threadsPerGrid.width, threadsPerGrid.height, threadsPerGrid.depth]
        let group = [threadsPerThreadgroup.width, threadsPerThreadgroup.height, threadsPerThreadgroup.depth]
        guard group.allSatisfy({ $0 > 0 }), zip(grid, group).allSatisfy({ $0 % $1 == 0 }) else {
            fail("dispatchThreads: threadsPerGrid \(grid) is not a multiple of threadsPerThreadgroup \(group); the MSL executor runs whole threadgroups only (use dispatchThreadgroups and guard in the kernel)")
            return
        }
        dispatchThreadgroups(MTLSize(width: grid[0] / group[0], height: grid[1] / group[1], depth: grid[2] / group[2]),
                             threadsPerThreadgroup: threadsPerThreadgroup)
    }

    func memoryBarrier(scope: MTLBarrierScope) {
        guard check("memoryBarrier", index: 0) else { return }
        commands.append(.barrier)
    }

    func memoryBarrier(resources: [MTLResource]) {
        guard check("memoryBarrier", index: 0) else { return }
        commands.append(.barrier)
    }

    func useResource(_ resource: MTLResource, usage: MTLResourceUsage) {}

    func endEncoding() {
        guard !ended else {
            fail("endEncoding called twice")
            return
        }
        ended = true
        commandBuffer.append(EncodedPass(dispatchType: dispatchType, commands: commands))
        commands = []
    }

    func insertDebugSignpost(_ string: String) {}
    func pushDebugGroup(_ string: String) {}
    func popDebugGroup() {}
}
