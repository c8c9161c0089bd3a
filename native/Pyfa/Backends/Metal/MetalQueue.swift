import CPyfa
import Metal

/// One command buffer per submission (on the device's command queue), with
/// one compute encoder whose dispatches may overlap (.concurrent): a
/// `.barrier` command becomes a buffer memory barrier, exactly where a
/// dispatch reads what an earlier one wrote. `wait` blocks on every command
/// buffer in flight and reports the first failure.
final class MetalQueue: CommandQueue {
    let queue: MTLCommandQueue
    private var inFlight: [(commands: MTLCommandBuffer, copies: [MetalCopiedMemory])] = []
    /// GPU seconds of the command buffers the last wait completed (those a
    /// submit had to finish early included).
    private(set) var lastDeviceSeconds: Double? = nil
    private var completedSeconds = 0.0

    init(queue: MTLCommandQueue) { self.queue = queue }

    deinit {
        // Copied caller memory must not be read after its owner lets go.
        for (commands, _) in inFlight { commands.waitUntilCompleted() }
    }

    func submit(_ commands: [EncodedCommand]) throws {
        guard !commands.isEmpty else { return }
        guard let buffer = queue.makeCommandBuffer(),
              let encoder = buffer.makeComputeCommandEncoder(dispatchType: .concurrent) else {
            throw PyfaError.execution("metal: could not make a command buffer")
        }
        var copies: [ObjectIdentifier: MetalCopiedMemory] = [:]
        do {
            for command in commands {
                switch command {
                case .barrier:
                    encoder.memoryBarrier(scope: .buffers)
                case .dispatch(let d):
                    try encode(d, encoder, &copies)
                }
            }
        } catch {
            encoder.endEncoding()
            throw error
        }
        encoder.endEncoding()
        // A copy an earlier submission still uses is synced back before this
        // one overwrites it with the caller's bytes.
        let reused = Set(copies.keys)
        try finish { $0.copies.contains { reused.contains(ObjectIdentifier($0)) } }
        for c in copies.values {
            pyfa_count(PYFA_COUNT_HOST_TO_DEVICE)
            c.upload()
        }
        buffer.commit()
        inFlight.append((buffer, Array(copies.values)))
    }

    private func encode(_ d: EncodedDispatch, _ encoder: MTLComputeCommandEncoder,
                        _ copies: inout [ObjectIdentifier: MetalCopiedMemory]) throws {
        guard let pipeline = d.pipeline as? MetalPipeline else {
            throw PyfaError.internal("dispatch \(d.pipeline.name): pipeline is not a Metal pipeline")
        }
        let threads = Int(d.threads.0) * Int(d.threads.1) * Int(d.threads.2)
        guard threads <= pipeline.state.maxTotalThreadsPerThreadgroup else {
            throw PyfaError.unsupported("dispatch \(pipeline.name): \(threads) threads per threadgroup exceed the pipeline's \(pipeline.state.maxTotalThreadsPerThreadgroup)")
        }
        encoder.setComputePipelineState(pipeline.state)
        for a in d.args {
            let slot = a.slot
            switch a.arg {
            case .buffer(let b, let offset):
                switch b.memory {
                case let m as MetalBufferMemory:
                    encoder.setBuffer(m.buffer, offset: offset, index: slot)
                case let m as MetalCopiedMemory:
                    // Two wraps of the same caller memory in one submission (an append and the
                    // attend after it, both binding a cache) share the first one's copy, so
                    // the second reads what the first wrote and one copy goes back.
                    let shared = copies.values.first { $0.host == m.host && $0.bytes == m.bytes } ?? m
                    copies[ObjectIdentifier(shared)] = shared
                    encoder.setBuffer(shared.buffer, offset: offset, index: slot)
                default:
                    throw PyfaError.internal("dispatch \(pipeline.name): argument \(slot) is not Metal memory")
                }
            case .bytes(let bytes):
                bytes.withUnsafeBytes { raw in
                    if let base = raw.baseAddress { encoder.setBytes(base, length: raw.count, index: slot) }
                }
            }
        }
        if d.threadgroupMemory > 0 {
            // Metal takes threadgroup memory in multiples of 16 bytes.
            encoder.setThreadgroupMemoryLength((d.threadgroupMemory + 15) & ~15, index: 0)
        }
        encoder.dispatchThreadgroups(MTLSize(width: Int(d.grid.0), height: Int(d.grid.1), depth: Int(d.grid.2)),
                                     threadsPerThreadgroup: MTLSize(width: Int(d.threads.0), height: Int(d.threads.1),
                                                                    depth: Int(d.threads.2)))
    }

    func wait() throws {
        defer {
            lastDeviceSeconds = completedSeconds
            completedSeconds = 0
        }
        try finish { _ in true }
    }

    /// Waits for the submissions `picked` selects, writes back their copies
    /// (only of those that completed: a failed one leaves caller memory as it
    /// was) and reports the first failure.
    private func finish(_ picked: ((commands: MTLCommandBuffer, copies: [MetalCopiedMemory])) -> Bool) throws {
        var failure: PyfaError? = nil
        var rest: [(commands: MTLCommandBuffer, copies: [MetalCopiedMemory])] = []
        for entry in inFlight {
            guard picked(entry) else {
                rest.append(entry)
                continue
            }
            pyfa_count(PYFA_COUNT_SYNCHRONIZATION)
            entry.commands.waitUntilCompleted()
            completedSeconds += max(0, entry.commands.gpuEndTime - entry.commands.gpuStartTime)
            if entry.commands.status == .error {
                let reason = entry.commands.error.map { String(describing: $0) } ?? "no reason given"
                failure = failure ?? PyfaError.execution("metal: command buffer failed: \(reason)")
            } else {
                for c in entry.copies {
                    pyfa_count(PYFA_COUNT_DEVICE_TO_HOST)
                    c.download()
                }
            }
        }
        inFlight = rest
        if let failure { throw failure }
    }
}
