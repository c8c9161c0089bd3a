import Glibc
import Metal
import MSLExecutor
import XCTest

/// Base of the Linux Metal tests: the shared device and a queue, executor
/// options saved before each test and restored after it, and helpers to
/// compile a kernel, make buffers and run one dispatch.
///
/// Every test forces perturbation off (its outputs are exact); other modes
/// keep the environment's values unless a test sets them, so the suite run
/// under PYFA_MSL_CHECK=1 or another lane order also exercises those modes
/// on correct kernels.
class MetalTestCase: XCTestCase {
    var device: MTLDevice!
    var queue: MTLCommandQueue!
    private var savedOptions = mslx_options()

    static let prelude = "#include <metal_stdlib>\nusing namespace metal;\n"

    override func setUpWithError() throws {
        mslx_get_options(&savedOptions)
        setOptions { $0.perturb_ulps = 0 }
        guard let device = MTLCreateSystemDefaultDevice() else {
            XCTFail("MTLCreateSystemDefaultDevice() returned nil: \(Self.probeFailure()); \(String(cString: mslx_describe()))")
            throw XCTSkip("no executor")
        }
        self.device = device
        queue = try XCTUnwrap(device.makeCommandQueue())
    }

    /// Why the executor cannot compile a trivial kernel (what makes the
    /// device nil), straight from its C API.
    static func probeFailure() -> String {
        let source = prelude + "kernel void probe(device uint *out [[buffer(0)]]) { out[0] = 1; }"
        var error = [CChar](repeating: 0, count: 16384)
        var library: OpaquePointer?
        var status = source.withCString { mslx_library_create($0, strlen($0), nil, 0, &library, &error, error.count) }
        if status == MSLX_OK, let library {
            var function: OpaquePointer?
            status = mslx_function_create(library, "probe", nil, 0, &function, &error, error.count)
            if let function { mslx_function_release(function) }
            mslx_library_release(library)
        }
        return status == MSLX_OK ? "the probe compiles now" : "status \(status): " + error.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
    }

    override func tearDown() {
        mslx_set_options(&savedOptions)
        queue = nil
        device = nil
    }

    /// Changes executor options for the rest of this test.
    func setOptions(_ change: (inout mslx_options) -> Void) {
        var options = mslx_options()
        mslx_get_options(&options)
        change(&options)
        mslx_set_options(&options)
    }

    func pipeline(_ body: String, _ name: String,
                  constants: MTLFunctionConstantValues? = nil) throws -> MTLComputePipelineState {
        let library = try device.makeLibrary(source: Self.prelude + body, options: nil)
        let function: MTLFunction
        if let constants {
            function = try library.makeFunction(name: name, constantValues: constants)
        } else {
            function = try XCTUnwrap(library.makeFunction(name: name), "no kernel \(name)")
        }
        return try device.makeComputePipelineState(function: function)
    }

    func buffer<T>(_ values: [T], label: String? = nil) -> MTLBuffer {
        let buffer = values.withUnsafeBytes {
            device.makeBuffer(bytes: $0.baseAddress!, length: $0.count, options: .storageModeShared)!
        }
        buffer.label = label
        return buffer
    }

    func buffer<T>(zeros count: Int, of type: T.Type, label: String? = nil) -> MTLBuffer {
        let buffer = device.makeBuffer(length: count * MemoryLayout<T>.stride, options: .storageModeShared)!
        buffer.label = label
        return buffer
    }

    func read<T>(_ buffer: MTLBuffer, as type: T.Type, count: Int? = nil) -> [T] {
        let n = count ?? buffer.length / MemoryLayout<T>.stride
        return Array(UnsafeBufferPointer(start: buffer.contents().bindMemory(to: T.self, capacity: n), count: n))
    }

    /// Encodes one dispatch (buffers bound at indices 0, 1, ...), commits and
    /// waits. `configure` may bind more before the dispatch.
    @discardableResult
    func run(_ pipeline: MTLComputePipelineState, buffers: [MTLBuffer],
             groups: MTLSize, threads: MTLSize,
             configure: (MTLComputeCommandEncoder) -> Void = { _ in }) -> MTLCommandBuffer {
        let commandBuffer = queue.makeCommandBuffer()!
        let encoder = commandBuffer.makeComputeCommandEncoder()!
        encoder.setComputePipelineState(pipeline)
        for (index, buffer) in buffers.enumerated() {
            encoder.setBuffer(buffer, offset: 0, index: index)
        }
        configure(encoder)
        encoder.dispatchThreadgroups(groups, threadsPerThreadgroup: threads)
        encoder.endEncoding()
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        return commandBuffer
    }

    func assertCompleted(_ commandBuffer: MTLCommandBuffer, file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertEqual(commandBuffer.status, .completed,
                       "command buffer failed: \(commandBuffer.error.map { String(describing: $0) } ?? "no error")",
                       file: file, line: line)
    }

    func errorText(_ commandBuffer: MTLCommandBuffer) -> String {
        commandBuffer.error.map { String(describing: $0) } ?? ""
    }
}

func size(_ width: Int, _ height: Int = 1, _ depth: Int = 1) -> MTLSize {
    MTLSize(width: width, height: height, depth: depth)
}
