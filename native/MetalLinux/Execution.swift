import Glibc
import MSLExecutor

/// What a [[buffer(i)]] slot holds when a dispatch is recorded.
enum Binding {
    case none
    case buffer(ExecutorBuffer, offset: Int)
    case bytes(InlineBytes)

    var label: String? {
        if case .buffer(let buffer, _) = self { return buffer.label }
        return nil
    }
}

/// A setBytes copy: owned memory whose address stays put until every
/// dispatch that bound it has run.
final class InlineBytes: @unchecked Sendable {
    let pointer: UnsafeMutableRawPointer
    let length: Int

    init(copying bytes: UnsafeRawPointer, length: Int) {
        // At least 16 bytes, 16-aligned: kernels may read a whole vector.
        pointer = UnsafeMutableRawPointer.allocate(byteCount: max(length, 16), alignment: 16)
        pointer.initializeMemory(as: UInt8.self, repeating: 0, count: max(length, 16))
        pointer.copyMemory(from: bytes, byteCount: length)
        self.length = length
    }

    deinit { pointer.deallocate() }
}

struct RecordedDispatch {
    let pipeline: ExecutorPipelineState
    let bindings: [Binding]
    let labels: [String?]
    let threadgroupMemory: [UInt64]
    let threadgroups: [UInt32]
    let threadsPerThreadgroup: [UInt32]
}

enum Command {
    case dispatch(RecordedDispatch)
    case barrier
    case fail(MTLCommandBufferError)
}

/// One ended encoder's commands.
struct EncodedPass {
    let dispatchType: MTLDispatchType
    let commands: [Command]
}

extension ExecutorCommandBuffer {
    /// Runs the passes in order; returns the first failure. A serial pass
    /// runs its dispatches in recorded order. A concurrent pass runs each
    /// barrier-delimited segment in the order the executor's lane-order
    /// option gives (forward, reverse, or shuffled by its seed), so a missing
    /// memoryBarrier between dependent dispatches shows up as a wrong result.
    func runPasses(_ passes: [EncodedPass]) -> MTLCommandBufferError? {
        var options = mslx_options()
        mslx_get_options(&options)
        var random = SplitMix64(seed: options.seed)
        for pass in passes {
            var segment: [RecordedDispatch] = []
            func flush() -> MTLCommandBufferError? {
                defer { segment.removeAll() }
                if pass.dispatchType == .concurrent {
                    switch Int(options.lane_order) {
                    case Int(MSLX_LANES_REVERSE): segment.reverse()
                    case Int(MSLX_LANES_RANDOM): segment.shuffle(using: &random)
                    default: break
                    }
                }
                for dispatch in segment {
                    if let failure = run(dispatch) { return failure }
                }
                return nil
            }
            for command in pass.commands {
                switch command {
                case .dispatch(let dispatch):
                    if pass.dispatchType == .serial {
                        if let failure = run(dispatch) { return failure }
                    } else {
                        segment.append(dispatch)
                    }
                case .barrier:
                    if let failure = flush() { return failure }
                case .fail(let failure):
                    if let earlier = flush() { return earlier }
                    return failure
                }
            }
            if let failure = flush() { return failure }
        }
        return nil
    }

    private func run(_ dispatch: RecordedDispatch) -> MTLCommandBufferError? {
        var desc = mslx_dispatch_desc()
        desc.function = dispatch.pipeline.kernel.handle
        let labels: [UnsafeMutablePointer<CChar>?] = dispatch.labels.map { $0.flatMap { strdup($0) } }
        defer { labels.forEach { free($0) } }
        withUnsafeMutableBytes(of: &desc.buffers) { raw in
            let slots = raw.baseAddress!.assumingMemoryBound(to: mslx_binding.self)
            for (index, binding) in dispatch.bindings.enumerated() {
                switch binding {
                case .none:
                    break
                case .buffer(let buffer, let offset):
                    slots[index].kind = UInt32(MSLX_BIND_BUFFER)
                    slots[index].data = UnsafeRawPointer(buffer.contents() + offset)
                    slots[index].length = UInt64(buffer.length - offset)
                    slots[index].label = UnsafePointer(labels[index])
                case .bytes(let bytes):
                    slots[index].kind = UInt32(MSLX_BIND_BYTES)
                    slots[index].data = UnsafeRawPointer(bytes.pointer)
                    slots[index].length = UInt64(bytes.length)
                }
            }
        }
        withUnsafeMutableBytes(of: &desc.threadgroup_memory_length) { raw in
            let lengths = raw.baseAddress!.assumingMemoryBound(to: UInt64.self)
            for (index, length) in dispatch.threadgroupMemory.enumerated() { lengths[index] = length }
        }
        desc.threadgroups = (dispatch.threadgroups[0], dispatch.threadgroups[1], dispatch.threadgroups[2])
        desc.threads_per_threadgroup = (dispatch.threadsPerThreadgroup[0], dispatch.threadsPerThreadgroup[1],
                                        dispatch.threadsPerThreadgroup[2])
        var error = [CChar](repeating: 0, count: 8192)
        let status = withExtendedLifetime(dispatch) { mslx_dispatch(&desc, &error, error.count) }
        guard status != MSLX_OK else { return nil }
        let message = executorMessage(error, status: status)
        let code: MTLCommandBufferError.Code
        switch Int(status) {
        case Int(MSLX_ERR_INVALID): code = .invalidResource
        case Int(MSLX_ERR_EXECUTION):
            code = message.contains("stack overflow") ? .stackOverflow
                : message.contains("fault") || message.contains("bus error") ? .pageFault : .internal
        default: code = .internal
        }
        return MTLCommandBufferError(code, message)
    }
}

/// The shuffle of MSLX_LANES_RANDOM: reproducible from the executor's seed.
struct SplitMix64: RandomNumberGenerator {
    private var state: UInt64
    init(seed: UInt64) { state = seed }
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
