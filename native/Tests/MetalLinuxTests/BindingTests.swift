import Metal
import MSLExecutor
import XCTest

/// Buffers, inline bytes, threadgroup memory, built-in positions and
/// function constants reach the kernel as MSL defines them.
final class BindingTests: MetalTestCase {
    func testBuiltInPositionsOverA3DGrid() throws {
        let source = """
        kernel void positions(device uint *out [[buffer(0)]],
                              uint3 tpig [[thread_position_in_grid]],
                              uint3 tgpig [[threadgroup_position_in_grid]],
                              uint3 tpitg [[thread_position_in_threadgroup]],
                              uint3 tptg [[threads_per_threadgroup]],
                              uint3 tgpg [[threadgroups_per_grid]],
                              uint3 tpg [[threads_per_grid]],
                              uint tiitg [[thread_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint sgs [[simdgroups_per_threadgroup]],
                              uint width [[threads_per_simdgroup]]) {
            uint linear = (tpig.z * tpg.y + tpig.y) * tpg.x + tpig.x;
            device uint *r = out + linear * 20;
            r[0] = tpig.x; r[1] = tpig.y; r[2] = tpig.z;
            r[3] = tgpig.x; r[4] = tgpig.y; r[5] = tgpig.z;
            r[6] = tpitg.x; r[7] = tpitg.y; r[8] = tpitg.z;
            r[9] = tptg.x * 10000 + tptg.y * 100 + tptg.z;
            r[10] = tgpg.x * 10000 + tgpg.y * 100 + tgpg.z;
            r[11] = tpg.x * 10000 + tpg.y * 100 + tpg.z;
            r[12] = tiitg; r[13] = lane; r[14] = sg; r[15] = sgs; r[16] = width;
        }
        """
        let state = try pipeline(source, "positions")
        let (groups, threads) = ((3, 2, 2), (8, 4, 2))
        let grid = (groups.0 * threads.0, groups.1 * threads.1, groups.2 * threads.2)
        let out = buffer(zeros: grid.0 * grid.1 * grid.2 * 20, of: UInt32.self)
        assertCompleted(run(state, buffers: [out], groups: size(groups.0, groups.1, groups.2),
                            threads: size(threads.0, threads.1, threads.2)))
        let values = read(out, as: UInt32.self)
        var mismatches = 0
        for z in 0..<grid.2 {
            for y in 0..<grid.1 {
                for x in 0..<grid.0 {
                    let start = ((z * grid.1 + y) * grid.0 + x) * 20
                    let r = values[start..<start + 17].map(Int.init)
                    let local = (x % threads.0, y % threads.1, z % threads.2)
                    let index = (local.2 * threads.1 + local.1) * threads.0 + local.0
                    let expected = [x, y, z, x / threads.0, y / threads.1, z / threads.2,
                                    local.0, local.1, local.2, 80402, 30202, 240804,
                                    index, index % 32, index / 32, 2, 32]
                    if r != expected {
                        mismatches += 1
                        if mismatches < 4 { XCTFail("thread (\(x), \(y), \(z)): got \(r), expected \(expected)") }
                    }
                }
            }
        }
        XCTAssertEqual(mismatches, 0)
    }

    func testBufferOffsetBytesAndThreadgroupMemory() throws {
        let source = """
        struct Params { float scale; uint bias; };
        kernel void scaled_reverse(device const float *input [[buffer(0)]],
                                   device float *output [[buffer(1)]],
                                   constant Params &params [[buffer(2)]],
                                   threadgroup float *scratch [[threadgroup(0)]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint n [[threads_per_threadgroup]],
                                   uint group [[threadgroup_position_in_grid]]) {
            scratch[tid] = input[group * n + tid] * params.scale;
            threadgroup_barrier(mem_flags::mem_threadgroup);
            output[group * n + tid] = scratch[n - 1 - tid] + float(params.bias);
        }
        """
        let state = try pipeline(source, "scaled_reverse")
        let n = 64, groups = 3
        let input = buffer((0..<(n * groups + 4)).map { Float($0) })
        let output = buffer(zeros: n * groups, of: Float.self)
        struct Params { var scale: Float; var bias: UInt32 }
        var params = Params(scale: 2, bias: 1000)
        let commandBuffer = run(state, buffers: [], groups: size(groups), threads: size(n)) { encoder in
            encoder.setBuffer(input, offset: 4 * MemoryLayout<Float>.stride, index: 0)  // skips 4 elements
            encoder.setBuffer(output, offset: 0, index: 1)
            encoder.setBytes(&params, length: MemoryLayout<Params>.stride, index: 2)
            encoder.setThreadgroupMemoryLength(n * MemoryLayout<Float>.stride, index: 0)
            params.scale = -1  // setBytes copied at call time: this change must not reach the kernel
        }
        assertCompleted(commandBuffer)
        let got = read(output, as: Float.self)
        let expected = (0..<(n * groups)).map { i -> Float in
            let (group, tid) = (i / n, i % n)
            return Float(4 + group * n + (n - 1 - tid)) * 2 + 1000
        }
        XCTAssertEqual(got, expected)
    }

    func testBarrierOrdersThreadgroupMemoryAcrossSimdgroups() throws {
        // Each step doubles the stride of a tree sum across 8 SIMD-groups; a
        // barrier that did not order lanes would lose partial sums.
        let source = """
        kernel void tree_sum(device const uint *input [[buffer(0)]], device uint *output [[buffer(1)]],
                             threadgroup uint *partial [[threadgroup(0)]],
                             uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
            partial[tid] = input[tid];
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint stride = n / 2; stride > 0; stride /= 2) {
                uint mine = tid < stride ? partial[tid] + partial[tid + stride] : 0;
                threadgroup_barrier(mem_flags::mem_threadgroup);
                if (tid < stride) partial[tid] = mine;
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            if (tid == 0) output[0] = partial[0];
        }
        """
        let state = try pipeline(source, "tree_sum")
        let values = (0..<256).map { UInt32($0 * 7 % 31) }
        let output = buffer(zeros: 1, of: UInt32.self)
        for order in [MSLX_LANES_FORWARD, MSLX_LANES_REVERSE, MSLX_LANES_RANDOM] {
            setOptions { $0.lane_order = Int32(order) }
            assertCompleted(run(state, buffers: [buffer(values), output], groups: size(1), threads: size(256)) {
                $0.setThreadgroupMemoryLength(256 * 4, index: 0)
            })
            XCTAssertEqual(read(output, as: UInt32.self)[0], values.reduce(0, +), "lane order \(order)")
        }
    }

    func testStaticThreadgroupMemoryIsReported() throws {
        let source = """
        kernel void uses_static(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
            threadgroup float tile[100];
            tile[tid] = float(tid);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            out[tid] = tile[99 - tid];
        }
        """
        let state = try pipeline(source, "uses_static")
        XCTAssertGreaterThanOrEqual(state.staticThreadgroupMemoryLength, 400)
        XCTAssertEqual(state.maxTotalThreadsPerThreadgroup, 1024)
        XCTAssertEqual(state.threadExecutionWidth, 32)
        let out = buffer(zeros: 100, of: Float.self)
        assertCompleted(run(state, buffers: [out], groups: size(1), threads: size(100)))
        XCTAssertEqual(read(out, as: Float.self), (0..<100).map { Float(99 - $0) })
    }

    static let constantsSource = """
    constant int factor [[function_constant(0)]];
    constant bool add_offset [[function_constant(1)]];
    constant float fscale [[function_constant(2)]];
    constant ushort small [[function_constant(3)]];
    constant bool has_factor = is_function_constant_defined(factor);
    constant bool has_offset = is_function_constant_defined(add_offset);
    constant bool has_fscale = is_function_constant_defined(fscale);
    kernel void specialised(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
        float f = has_factor ? float(factor) : -1.0f;
        float offset = (has_offset && add_offset) ? 100.0f : 0.0f;
        float s = has_fscale ? fscale : 1.0f;
        out[i] = f * float(i) * s + offset;
        if (i == 0) out[4] = is_function_constant_defined(small) ? float(small) : -7.0f;
    }
    """

    func testFunctionConstantsSpecialise() throws {
        let library = try device.makeLibrary(source: Self.prelude + Self.constantsSource, options: nil)
        XCTAssertEqual(library.functionNames, ["specialised"])

        func evaluate(_ function: MTLFunction) throws -> [Float] {
            let state = try device.makeComputePipelineState(function: function)
            let out = buffer(zeros: 5, of: Float.self)
            assertCompleted(run(state, buffers: [out], groups: size(1), threads: size(4)))
            return read(out, as: Float.self)
        }

        let a = MTLFunctionConstantValues()
        var three: Int32 = 3
        a.setConstantValue(&three, type: .int, index: 0)
        let b = MTLFunctionConstantValues()
        var pair: [Int32] = [5, 0]
        b.setConstantValues(&pair, type: .int, range: 0..<1)
        var yes = true, half: Float = 0.5, small: UInt16 = 9
        b.setConstantValue(&yes, type: .bool, index: 1)
        b.setConstantValue(&half, type: .float, index: 2)
        b.setConstantValue(&small, type: .ushort, index: 3)

        let fa = try library.makeFunction(name: "specialised", constantValues: a)
        let fb = try library.makeFunction(name: "specialised", constantValues: b)
        XCTAssertEqual(fa.name, "specialised")
        XCTAssertEqual(fa.functionType, .kernel)
        XCTAssertEqual(try evaluate(fa), [0, 3, 6, 9, -7])
        XCTAssertEqual(try evaluate(fb), [100, 102.5, 105, 107.5, 9])
        // No values at all: every constant undefined.
        XCTAssertEqual(try evaluate(try library.makeFunction(name: "specialised", constantValues: MTLFunctionConstantValues())),
                       [0, -1, -2, -3, -7])
    }

    func testUnknownFunctionNames() throws {
        let library = try device.makeLibrary(source: Self.prelude + Self.constantsSource, options: nil)
        XCTAssertNil(library.makeFunction(name: "missing"))
        XCTAssertThrowsError(try library.makeFunction(name: "missing", constantValues: MTLFunctionConstantValues())) {
            XCTAssertEqual(($0 as? MTLLibraryError)?.code, .functionNotFound, "\($0)")
        }
    }
}
