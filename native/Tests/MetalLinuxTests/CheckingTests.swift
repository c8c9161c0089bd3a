import Metal
import MSLExecutor
import XCTest

/// Failures surface as errors, never traps: clang's message from a bad
/// source, checking-mode reports, and hazards that lane order and
/// concurrent dispatch order expose.
final class CheckingTests: MetalTestCase {
    func testCompileErrorCarriesClangsMessage() throws {
        let source = Self.prelude + """
        kernel void broken(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
            out[i] = undeclared_value * 2.0f;
        }
        """
        do {
            let library = try device.makeLibrary(source: source, options: MTLCompileOptions())
            let function = try library.makeFunction(name: "broken", constantValues: MTLFunctionConstantValues())
            _ = try device.makeComputePipelineState(function: function)
            XCTFail("a kernel using an undeclared identifier compiled")
        } catch let error as MTLLibraryError {
            XCTAssertEqual(error.code, .compileFailure, "\(error)")
            XCTAssertTrue(String(describing: error).contains("undeclared_value"), "\(error)")
        }
        // The non-throwing makeFunction defers the error to pipeline creation.
        if let library = try? device.makeLibrary(source: source, options: nil),
           let function = library.makeFunction(name: "broken") {
            XCTAssertThrowsError(try device.makeComputePipelineState(function: function)) { error in
                XCTAssertTrue(String(describing: error).contains("undeclared_value"), "\(error)")
            }
        }
    }

    func testReadPastTheEndNamesTheBuffer() throws {
        setOptions { $0.check = 1 }  // before allocating: buffers get their guard page
        let source = """
        kernel void overread(device const float *input [[buffer(0)]], device float *out [[buffer(1)]],
                             uint i [[thread_position_in_grid]]) {
            out[i] = input[i + 4];
        }
        """
        let state = try pipeline(source, "overread")
        let input = buffer([Float](repeating: 1, count: 16), label: "short-input")
        let out = buffer(zeros: 16, of: Float.self, label: "out")
        let commandBuffer = run(state, buffers: [input, out], groups: size(1), threads: size(16))
        XCTAssertEqual(commandBuffer.status, .error)
        XCTAssertTrue(errorText(commandBuffer).contains("short-input"), errorText(commandBuffer))
    }

    func testDivergentBarrierIsReported() throws {
        setOptions { $0.check = 1 }
        let source = """
        kernel void divergent(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
            if (tid < 16) {
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            out[tid] = 1.0f;
        }
        """
        let state = try pipeline(source, "divergent")
        let commandBuffer = run(state, buffers: [buffer(zeros: 64, of: Float.self)], groups: size(1), threads: size(64))
        XCTAssertEqual(commandBuffer.status, .error)
        XCTAssertTrue(errorText(commandBuffer).contains("barrier"), errorText(commandBuffer))
        XCTAssertTrue(errorText(commandBuffer).contains("divergent"), "names the kernel: \(errorText(commandBuffer))")
    }

    func testUnwrittenThreadgroupMemoryReadsNaN() throws {
        setOptions { $0.check = 1 }
        let source = """
        kernel void unwritten(device float *out [[buffer(0)]], threadgroup float *dynamic_tile [[threadgroup(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
            threadgroup float static_tile[32];
            out[tid] = static_tile[tid];
            out[32 + tid] = dynamic_tile[tid];
        }
        """
        let state = try pipeline(source, "unwritten")
        let out = buffer(zeros: 64, of: Float.self)
        assertCompleted(run(state, buffers: [out], groups: size(1), threads: size(32)) {
            $0.setThreadgroupMemoryLength(32 * 4, index: 0)
        })
        XCTAssertTrue(read(out, as: Float.self).allSatisfy { $0.isNaN }, "\(read(out, as: Float.self))")
    }

    func testMissingBarrierDependsOnLaneOrder() throws {
        setOptions { $0.check = 1 }  // unwritten threadgroup memory reads NaN
        let source = """
        kernel void no_barrier(device float *out [[buffer(0)]], threadgroup float *tile [[threadgroup(0)]],
                               uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
            tile[tid] = float(tid);
            // missing: threadgroup_barrier(mem_flags::mem_threadgroup);
            out[tid] = tile[n - 1 - tid];
        }
        """
        let state = try pipeline(source, "no_barrier")
        func result(_ order: Int32) -> [Float] {
            setOptions { $0.lane_order = order }
            let out = buffer(zeros: 32, of: Float.self)
            assertCompleted(run(state, buffers: [out], groups: size(1), threads: size(32)) {
                $0.setThreadgroupMemoryLength(32 * 4, index: 0)
            })
            return read(out, as: Float.self)
        }
        let forward = result(Int32(MSLX_LANES_FORWARD)), reverse = result(Int32(MSLX_LANES_REVERSE))
        XCTAssertNotEqual(forward.map(\.bitPattern), reverse.map(\.bitPattern))
        // Forward: lane 0 runs first and reads lane 31's slot before it is written.
        XCTAssertTrue(forward[0].isNaN, "\(forward)")
        XCTAssertEqual(forward[31], 0)
        XCTAssertEqual(reverse[0], 31)
        XCTAssertTrue(reverse[31].isNaN, "\(reverse)")
    }

    static let producerConsumer = """
    kernel void produce(device float *a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
        a[i] = float(i + 1);
    }
    kernel void consume(device const float *a [[buffer(0)]], device float *b [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
        b[i] = a[i] * 2.0f;
    }
    """

    /// Runs produce then consume in one encoder; returns b.
    private func producerConsumer(_ dispatchType: MTLDispatchType, barrier: Bool) throws -> [Float] {
        let produce = try pipeline(Self.producerConsumer, "produce")
        let consume = try pipeline(Self.producerConsumer, "consume")
        let a = buffer(zeros: 64, of: Float.self), b = buffer(zeros: 64, of: Float.self)
        let commandBuffer = queue.makeCommandBuffer()!
        let encoder = commandBuffer.makeComputeCommandEncoder(dispatchType: dispatchType)!
        XCTAssertEqual(encoder.dispatchType, dispatchType)
        encoder.setComputePipelineState(produce)
        encoder.setBuffer(a, offset: 0, index: 0)
        encoder.dispatchThreadgroups(size(2), threadsPerThreadgroup: size(32))
        if barrier { encoder.memoryBarrier(scope: .buffers) }
        encoder.setComputePipelineState(consume)
        encoder.setBuffer(b, offset: 0, index: 1)
        encoder.dispatchThreadgroups(size(2), threadsPerThreadgroup: size(32))
        encoder.endEncoding()
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        assertCompleted(commandBuffer)
        return read(b, as: Float.self)
    }

    func testConcurrentEncoderNeedsMemoryBarrier() throws {
        let right = (0..<64).map { Float(2 * ($0 + 1)) }
        setOptions { $0.lane_order = Int32(MSLX_LANES_REVERSE) }
        XCTAssertEqual(try producerConsumer(.concurrent, barrier: false), [Float](repeating: 0, count: 64),
                       "without a barrier, reverse order runs the consumer first")
        XCTAssertEqual(try producerConsumer(.concurrent, barrier: true), right)
        XCTAssertEqual(try producerConsumer(.serial, barrier: false), right, "a serial encoder keeps recorded order")
        setOptions { $0.lane_order = Int32(MSLX_LANES_FORWARD) }
        XCTAssertEqual(try producerConsumer(.concurrent, barrier: false), right)
    }
}
