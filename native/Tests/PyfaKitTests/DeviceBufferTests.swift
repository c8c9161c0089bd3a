import XCTest
import PyfaKit

final class DeviceBufferTests: XCTestCase {
    func testCPUDeviceOpensWithItsFacts() throws {
        let device = try Device(backend: "cpu")
        XCTAssertEqual(device.backend, "cpu")
        XCTAssertFalse(device.name.isEmpty)
        XCTAssertTrue(device.hostVisible)
        XCTAssertFalse(device.isGPU)
        XCTAssertGreaterThan(device.computeUnits, 0)
        XCTAssertTrue(Library.backends.contains("cpu"))
        XCTAssertTrue(Library.headDims.contains(128))
        XCTAssertEqual(Library.turboQuantBits, [2, 3, 4, 8])
        XCTAssertGreaterThanOrEqual(Library.abiVersion, 3)
    }

    func testAutoOpensABackend() throws {
        XCTAssertTrue(Library.backends.contains(try Device().backend))
    }

    func testUnknownBackendIsInvalid() {
        assertPyfaError(.invalidArgument, "backend") { try Device(backend: "tpu") }
    }

    func testFloatValuesRoundTripEveryFloatDType() throws {
        let device = try Device(backend: "cpu")
        // Exact in f16 and bf16: small integers and halves, signed zero, infinities.
        let exact: [Float] = [0, -0.0, 1, -2, 0.5, 3.25, 96, -.infinity, .infinity]
        for dtype in [DType.float32, .float16, .bfloat16] {
            let b = try Buffer(device, shape: [exact.count], dtype: dtype, values: exact)
            XCTAssertEqual(try b.floats(), exact, "\(dtype)")
            XCTAssertEqual(b.nbytes, exact.count * dtype.size)
            XCTAssertTrue(try b.floats()[7].isInfinite)
        }
    }

    func testNarrowingRoundsToNearestEven() throws {
        let device = try Device(backend: "cpu")
        let ulp16 = Float(1) / 1024, ulpBF = Float(1) / 128
        let f16 = try Buffer(device, shape: [5], dtype: .float16,
                             values: [1 + ulp16 / 2, 1 + 1.5 * ulp16, 65519, 65520, 1e-8])
        // Ties go to the even neighbour; 65520 and above overflow to infinity;
        // 1e-8 is below half the smallest subnormal (2^-24 ~ 6e-8): zero.
        XCTAssertEqual(try f16.floats(), [1, 1 + 2 * ulp16, 65504, .infinity, 0])
        let subnormal = Float(3) / Float(1 << 24)  // a subnormal half, exact
        let sub = try Buffer(device, shape: [1], dtype: .float16, values: [subnormal])
        XCTAssertEqual(try sub.floats(), [subnormal])
        let bf = try Buffer(device, shape: [2], dtype: .bfloat16, values: [1 + ulpBF / 2, 1 + 1.5 * ulpBF])
        XCTAssertEqual(try bf.floats(), [1, 1 + 2 * ulpBF])
        let nan = try Buffer(device, shape: [2], dtype: .float16, values: [.nan, -.nan])
        XCTAssertTrue(try nan.floats().allSatisfy(\.isNaN))
    }

    func testSharedStorageIsZeroCopy() throws {
        let device = try Device(backend: "cpu")
        let b = try Buffer(device, shape: [2, 3], dtype: .float32)
        try b.withUnsafeMutableBytes { raw in
            let p = raw.bindMemory(to: Float.self)
            for i in p.indices { p[i] = Float(i) }
        }
        XCTAssertEqual(try b.floats(), [0, 1, 2, 3, 4, 5])
        try b.write([6, 5, 4, 3, 2, 1])
        XCTAssertEqual(try b.withUnsafeBytes { Array($0.bindMemory(to: Float.self)) }, [6, 5, 4, 3, 2, 1])
    }

    func testPrivateStorageCopiesButHasNoHostView() throws {
        let device = try Device(backend: "cpu")
        let b = try Buffer(device, shape: [4], dtype: .uint8, storage: .private)
        try b.write(bytes: [1, 2, 3, 250])
        XCTAssertEqual(try b.bytes(), [1, 2, 3, 250])
        assertPyfaError(.invalidArgument, "private storage") { try b.withUnsafeMutableBytes { _ in () } }
    }

    func testEmptyBufferHasNothingToCopy() throws {
        let device = try Device(backend: "cpu")
        let b = try Buffer(device, shape: [0, 4], dtype: .float16, values: [])
        XCTAssertEqual(b.count, 0)
        XCTAssertEqual(try b.floats(), [])
        XCTAssertEqual(try b.bytes(), [])
        XCTAssertEqual(try b.withUnsafeBytes { $0.count }, 0)
    }

    func testNegativeDimensionIsInvalid() throws {
        let device = try Device(backend: "cpu")
        assertPyfaError(.invalidArgument, "shape[1]") { try Buffer(device, shape: [2, -1], dtype: .float32) }
    }

    func testMoreThanEightDimensionsIsInvalid() throws {
        let device = try Device(backend: "cpu")
        assertPyfaError(.invalidArgument, "at most 8") { try Buffer(device, shape: Array(repeating: 1, count: 9), dtype: .float32) }
    }

    func testOverflowingShapeIsInvalid() throws {
        let device = try Device(backend: "cpu")
        assertPyfaError(.invalidArgument, "too many") { try Buffer(device, shape: [Int.max / 2, 4], dtype: .float32) }
    }

    func testValueCountMustMatchTheShape() throws {
        let device = try Device(backend: "cpu")
        assertPyfaError(.invalidArgument, "values: 3 values") {
            try Buffer(device, shape: [2, 2], dtype: .float32, values: [1, 2, 3])
        }
        let b = try Buffer(device, shape: [2], dtype: .uint8)
        assertPyfaError(.invalidArgument, "bytes: 3 bytes") { try b.write(bytes: [1, 2, 3]) }
    }

    func testFloatAccessNeedsAFloatDType() throws {
        let device = try Device(backend: "cpu")
        let b = try Buffer(device, shape: [2], dtype: .int32)
        assertPyfaError(.invalidArgument, "not a float type") { try b.floats() }
        assertPyfaError(.invalidArgument, "not a float type") { try b.write([1, 2]) }
    }
}
