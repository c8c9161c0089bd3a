import Glibc
import Metal
import XCTest

/// The Metal API surface itself: device facts, buffers, command buffer life
/// cycle, and misuse that Apple's validation layer traps on failing the
/// command buffer instead.
final class APITests: MetalTestCase {
    static let source = """
    kernel void add_one(device float *data [[buffer(0)]], uint i [[thread_position_in_grid]]) {
        data[i] += 1.0f;
    }
    """

    func testDeviceFacts() {
        XCTAssertTrue(MTLCreateSystemDefaultDevice() === device, "one shared device")
        XCTAssertEqual(MTLCopyAllDevices().count, 1)
        XCTAssertEqual(device.name, "MSL CPU executor")
        XCTAssertEqual(device.maxThreadgroupMemoryLength, 32768)
        XCTAssertEqual(device.maxThreadsPerThreadgroup.width, 1024)
        XCTAssertTrue(device.hasUnifiedMemory)
        XCTAssertEqual(device.location, .unspecified)
        XCTAssertFalse(device.isLowPower || device.isHeadless || device.isRemovable)
        XCTAssertGreaterThan(device.recommendedMaxWorkingSetSize, 0)
        XCTAssertTrue(queue.device === device)
    }

    func testBuffers() throws {
        let zeroed = try XCTUnwrap(device.makeBuffer(length: 1000, options: .storageModeShared))
        XCTAssertEqual(zeroed.length, 1000)
        XCTAssertGreaterThanOrEqual(zeroed.allocatedSize, 1000)
        XCTAssertTrue(read(zeroed, as: UInt8.self).allSatisfy { $0 == 0 })
        XCTAssertEqual(zeroed.gpuAddress, UInt64(UInt(bitPattern: zeroed.contents())))
        zeroed.label = "zeroed"
        XCTAssertEqual(zeroed.label, "zeroed")
        zeroed.didModifyRange(0..<10)
        XCTAssertNil(device.makeBuffer(length: 0))

        let copied = buffer([1, 2, 3] as [Int32])
        XCTAssertEqual(read(copied, as: Int32.self), [1, 2, 3])

        let page = Int(sysconf(Int32(_SC_PAGESIZE)))
        let memory = UnsafeMutableRawPointer.allocate(byteCount: 2 * page, alignment: page)
        memory.initializeMemory(as: UInt8.self, repeating: 0, count: 2 * page) // add_one reads it
        XCTAssertNil(device.makeBuffer(bytesNoCopy: memory + 16, length: page, options: [], deallocator: nil),
                     "not page-aligned")
        final class Flag: @unchecked Sendable { var freed = 0 }
        let flag = Flag()
        do {
            let wrapped = try XCTUnwrap(device.makeBuffer(bytesNoCopy: memory, length: page, options: [],
                                                          deallocator: { pointer, length in
                XCTAssertEqual(pointer, memory)
                XCTAssertEqual(length, page)
                flag.freed += 1
            }))
            XCTAssertEqual(wrapped.contents(), memory)
            let state = try pipeline(Self.source, "add_one")
            assertCompleted(run(state, buffers: [wrapped], groups: size(4), threads: size(32)))
            XCTAssertEqual(memory.load(as: Float.self), 1)
        }
        XCTAssertEqual(flag.freed, 1, "the deallocator runs when the buffer is freed")
        memory.deallocate()
    }

    func testCommandBufferLifeCycleAndOrder() throws {
        let state = try pipeline(Self.source, "add_one")
        let data = buffer(zeros: 64, of: Float.self)
        final class Log: @unchecked Sendable {
            private let lock = TestLock()
            private var entries: [String] = []
            func add(_ s: String) { lock.locked { entries.append(s) } }
            var all: [String] { lock.locked { entries } }
        }
        let log = Log()
        var buffers: [MTLCommandBuffer] = []
        for k in 0..<5 {
            let commandBuffer = queue.makeCommandBuffer()!
            commandBuffer.label = "cb\(k)"
            XCTAssertEqual(commandBuffer.status, .notEnqueued)
            let encoder = commandBuffer.makeComputeCommandEncoder()!
            encoder.setComputePipelineState(state)
            encoder.setBuffer(data, offset: 0, index: 0)
            encoder.dispatchThreadgroups(size(2), threadsPerThreadgroup: size(32))
            encoder.endEncoding()
            commandBuffer.addCompletedHandler { log.add($0.label ?? "?") }
            commandBuffer.commit()
            buffers.append(commandBuffer)
        }
        buffers.last!.waitUntilCompleted()
        XCTAssertEqual(log.all, ["cb0", "cb1", "cb2", "cb3", "cb4"], "a queue runs its command buffers in commit order")
        for commandBuffer in buffers {
            assertCompleted(commandBuffer)
            XCTAssertNil(commandBuffer.error)
            XCTAssertGreaterThan(commandBuffer.gpuStartTime, 0)
            XCTAssertGreaterThanOrEqual(commandBuffer.gpuEndTime, commandBuffer.gpuStartTime)
        }
        XCTAssertEqual(read(data, as: Float.self), [Float](repeating: 5, count: 64))
    }

    /// Encodes `misuse`, then a dispatch of add_one over `data`; returns the
    /// command buffer after it ran.
    private func misuse(_ misuse: (MTLComputeCommandEncoder) -> Void) throws -> (MTLCommandBuffer, [Float]) {
        let state = try pipeline(Self.source, "add_one")
        let data = buffer(zeros: 32, of: Float.self)
        let commandBuffer = queue.makeCommandBuffer()!
        let encoder = commandBuffer.makeComputeCommandEncoder()!
        misuse(encoder)
        encoder.setComputePipelineState(state)
        encoder.setBuffer(data, offset: 0, index: 0)
        encoder.dispatchThreadgroups(size(1), threadsPerThreadgroup: size(32))
        encoder.endEncoding()
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        return (commandBuffer, read(data, as: Float.self))
    }

    func testMisuseFailsTheCommandBuffer() throws {
        var big = [UInt8](repeating: 0, count: 5000)
        let cases: [(String, (MTLComputeCommandEncoder) -> Void)] = [
            ("setBytes", { $0.setBytes(&big, length: big.count, index: 1) }),
            ("index 31", { $0.setBuffer(self.buffer(zeros: 4, of: Float.self), offset: 0, index: 31) }),
            ("without a compute pipeline", { $0.dispatchThreadgroups(size(1), threadsPerThreadgroup: size(1)) }),
            ("multiple of 16", { $0.setThreadgroupMemoryLength(10, index: 0) }),
            ("offset", { $0.setBuffer(self.buffer(zeros: 4, of: Float.self), offset: 64, index: 2) }),
        ]
        for (expected, misuse) in cases {
            let (commandBuffer, data) = try self.misuse(misuse)
            XCTAssertEqual(commandBuffer.status, .error, expected)
            XCTAssertTrue(errorText(commandBuffer).contains(expected), "\(expected): \(errorText(commandBuffer))")
            XCTAssertEqual((commandBuffer.error as? MTLCommandBufferError)?.code, .invalidResource)
            XCTAssertEqual(data, [Float](repeating: 0, count: 32), "\(expected): later dispatches are skipped")
        }
    }

    func testCommitWithAnOpenEncoderFails() throws {
        let commandBuffer = queue.makeCommandBuffer()!
        _ = commandBuffer.makeComputeCommandEncoder()!
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        XCTAssertEqual(commandBuffer.status, .error)
        XCTAssertTrue(errorText(commandBuffer).contains("endEncoding"), errorText(commandBuffer))
    }

    func testUnboundBufferFailsTheDispatch() throws {
        let state = try pipeline(Self.source, "add_one")
        let commandBuffer = queue.makeCommandBuffer()!
        let encoder = commandBuffer.makeComputeCommandEncoder()!
        encoder.setComputePipelineState(state)
        encoder.dispatchThreadgroups(size(1), threadsPerThreadgroup: size(32))
        encoder.endEncoding()
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        XCTAssertEqual(commandBuffer.status, .error)
        XCTAssertFalse(errorText(commandBuffer).isEmpty)
    }

    func testDispatchThreads() throws {
        let state = try pipeline(Self.source, "add_one")
        let data = buffer(zeros: 64, of: Float.self)
        let commandBuffer = queue.makeCommandBuffer()!
        let encoder = commandBuffer.makeComputeCommandEncoder()!
        encoder.setComputePipelineState(state)
        encoder.setBuffer(data, offset: 0, index: 0)
        encoder.dispatchThreads(size(64), threadsPerThreadgroup: size(16))
        encoder.endEncoding()
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        assertCompleted(commandBuffer)
        XCTAssertEqual(read(data, as: Float.self), [Float](repeating: 1, count: 64))
    }
}

/// A tiny pthread lock for test bookkeeping (no Foundation).
final class TestLock: @unchecked Sendable {
    private let mutex = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
    init() { pthread_mutex_init(mutex, nil) }
    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }
    func locked<T>(_ body: () -> T) -> T {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return body()
    }
}
