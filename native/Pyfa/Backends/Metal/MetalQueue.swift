import Metal

/// One command buffer per submission, with one compute encoder whose
/// dispatches may overlap (.concurrent): a `.barrier` command becomes a
/// buffer memory barrier, exactly where a dispatch reads what an earlier one
/// wrote. `wait` blocks on every command buffer in flight and reports the
/// first failure.
final class MetalQueue: CommandQueue {
    let queue: MTLCommandQueue
    private var inFlight: [(commands: MTLCommandBuffer, copies: [MetalCopiedMemory])] = []

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
        for c in copies.values { c.upload() }
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
        for (slot, arg) in d.args {
            switch arg {
            case .buffer(let b, let offset):
                switch b.memory {
                case let m as MetalBufferMemory:
                    encoder.setBuffer(m.buffer, offset: offset, index: slot)
                case let m as MetalCopiedMemory:
                    copies[ObjectIdentifier(m)] = m
                    encoder.setBuffer(m.buffer, offset: offset, index: slot)
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
        let pending = inFlight
        inFlight.removeAll()
        var failure: PyfaError? = nil
        for (commands, copies) in pending {
            commands.waitUntilCompleted()
            if commands.status == .error, failure == nil {
                let reason = commands.error.map { String(describing: $0) } ?? "no reason given"
                failure = PyfaError.execution("metal: command buffer failed: \(reason)")
            }
            for c in copies { c.download() }
        }
        if let failure { throw failure }
    }
}
