import Glibc
import MSLExecutor

/// Compiled Metal source: its kernels by name. The executor parses the
/// source when the library is made and compiles each kernel when a function
/// is made from it (per set of function-constant values), so clang's errors
/// in a kernel's body surface from makeFunction(name:constantValues:) or,
/// for makeFunction(name:), from makeComputePipelineState(function:).
public protocol MTLLibrary: AnyObject {
    var label: String? { get set }
    var device: MTLDevice { get }
    var type: MTLLibraryType { get }
    var functionNames: [String] { get }
    func makeFunction(name functionName: String) -> MTLFunction?
    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction
}

public protocol MTLFunction: AnyObject {
    var label: String? { get set }
    var device: MTLDevice { get }
    var functionType: MTLFunctionType { get }
    var name: String { get }
}

/// Options for makeLibrary(source:options:). Accepted and ignored: the
/// executor computes exactly, in the one MSL version it implements; its
/// perturbation mode (PYFA_MSL_PERTURB_ULPS) stands in for fast math.
open class MTLCompileOptions {
    open var mathMode: MTLMathMode = .fast
    open var mathFloatingPointFunctions: MTLMathFloatingPointFunctions = .fast
    open var languageVersion: MTLLanguageVersion = .version3_1
    open var libraryType: MTLLibraryType = .executable
    open var installName: String?
    open var preserveInvariance = false
    open var optimizationLevel: MTLLibraryOptimizationLevel = .default
    open var fastMathEnabled: Bool {
        get { mathMode == .fast }
        set { mathMode = newValue ? .fast : .safe }
    }
    public init() {}
}

/// Values for a kernel's [[function_constant(i)]] declarations, by index.
/// Scalar types the executor specialises on: bool, int, uint, short, ushort,
/// float, half; others make function creation throw.
open class MTLFunctionConstantValues {
    fileprivate var values: [Int: (type: MTLDataType, bytes: [UInt8])] = [:]

    public init() {}

    open func setConstantValue(_ value: UnsafeRawPointer, type: MTLDataType, index: Int) {
        let size = constantSize(type) ?? 0
        values[index] = (type, Array(UnsafeRawBufferPointer(start: value, count: size)))
    }

    /// Consecutive values of one type, for indices range.lowerBound..<upperBound.
    open func setConstantValues(_ values: UnsafeRawPointer, type: MTLDataType, range: Range<Int>) {
        let stride = constantSize(type) ?? 0
        for (i, index) in range.enumerated() {
            setConstantValue(values + i * stride, type: type, index: index)
        }
    }

    open func reset() { values.removeAll() }
}

private func constantSize(_ type: MTLDataType) -> Int? {
    switch type {
    case .bool: return 1
    case .short, .ushort, .half: return 2
    case .int, .uint, .float: return 4
    default: return nil
    }
}

private func executorType(_ type: MTLDataType) -> UInt32? {
    switch type {
    case .bool: return UInt32(MSLX_TYPE_BOOL)
    case .int: return UInt32(MSLX_TYPE_INT)
    case .uint: return UInt32(MSLX_TYPE_UINT)
    case .short: return UInt32(MSLX_TYPE_SHORT)
    case .ushort: return UInt32(MSLX_TYPE_USHORT)
    case .float: return UInt32(MSLX_TYPE_FLOAT)
    case .half: return UInt32(MSLX_TYPE_HALF)
    default: return nil
    }
}

final class ExecutorLibrary: MTLLibrary, @unchecked Sendable {
    let executorDevice: ExecutorDevice
    let handle: OpaquePointer
    let functionNames: [String]
    private let state = Monitor()
    private var labelValue: String?

    init(device: ExecutorDevice, source: String) throws {
        var error = [CChar](repeating: 0, count: 16384)
        var library: OpaquePointer?
        let status = source.withCString {
            mslx_library_create($0, strlen($0), nil, 0, &library, &error, error.count)
        }
        guard status == MSLX_OK, let library else {
            let code: MTLLibraryError.Code = status == MSLX_ERR_COMPILE ? .compileFailure : .internal
            throw MTLLibraryError(code, executorMessage(error, status: status))
        }
        executorDevice = device
        handle = library
        functionNames = (0..<mslx_library_function_count(library)).map {
            String(cString: mslx_library_function_name(library, $0))
        }
    }

    deinit { mslx_library_release(handle) }

    var device: MTLDevice { executorDevice }
    var type: MTLLibraryType { .executable }
    var label: String? {
        get { state.withLock { labelValue } }
        set { state.withLock { labelValue = newValue } }
    }

    /// nil when the library has no kernel of that name; a kernel that does
    /// not compile gives a function whose pipeline creation throws clang's error.
    func makeFunction(name functionName: String) -> MTLFunction? {
        guard functionNames.contains(functionName) else { return nil }
        return ExecutorFunction(library: self, name: functionName,
                                kernel: Result { () throws(MTLLibraryError) in try specialise(functionName, []) })
    }

    /// Throws .functionNotFound for an unknown name (as Apple does), and
    /// .compileFailure with clang's message when the specialisation fails.
    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction {
        guard functionNames.contains(name) else {
            throw MTLLibraryError(.functionNotFound, "Function \(name) was not found in the library")
        }
        var values: [mslx_constant_value] = []
        for (index, entry) in constantValues.values.sorted(by: { $0.key < $1.key }) {
            guard let type = executorType(entry.type), index >= 0, index <= Int(UInt32.max) else {
                throw MTLLibraryError(.unsupported,
                                      "function constant \(index) of \(name): type \(entry.type) is not supported by the MSL executor")
            }
            var value = mslx_constant_value()
            value.index = UInt32(index)
            value.type = type
            withUnsafeMutableBytes(of: &value.bytes) { raw in
                raw.copyBytes(from: entry.bytes.prefix(raw.count))
            }
            values.append(value)
        }
        let kernel = try specialise(name, values)
        return ExecutorFunction(library: self, name: name, kernel: .success(kernel))
    }

    private func specialise(_ name: String, _ values: [mslx_constant_value]) throws(MTLLibraryError) -> SpecialisedKernel {
        var error = [CChar](repeating: 0, count: 65536)
        var function: OpaquePointer?
        let status = values.withUnsafeBufferPointer { constants in
            mslx_function_create(handle, name, constants.baseAddress, constants.count, &function, &error, error.count)
        }
        guard status == MSLX_OK, let function else {
            let code: MTLLibraryError.Code
            switch Int(status) {
            case Int(MSLX_ERR_COMPILE): code = .compileFailure
            case Int(MSLX_ERR_INVALID): code = .unsupported  // e.g. a constant's type differs from its declaration
            default: code = .internal
            }
            throw MTLLibraryError(code, executorMessage(error, status: status))
        }
        return SpecialisedKernel(library: self, handle: function)
    }
}

/// One compiled specialisation of a kernel (an mslx_function).
final class SpecialisedKernel: @unchecked Sendable {
    let library: ExecutorLibrary  // keeps the mslx_library alive under the function
    let handle: OpaquePointer

    init(library: ExecutorLibrary, handle: OpaquePointer) {
        self.library = library
        self.handle = handle
    }

    deinit { mslx_function_release(handle) }

    var staticThreadgroupMemoryLength: Int { Int(mslx_function_static_threadgroup_memory(handle)) }
}

final class ExecutorFunction: MTLFunction, @unchecked Sendable {
    let library: ExecutorLibrary
    let name: String
    private let kernel: Result<SpecialisedKernel, MTLLibraryError>
    private let state = Monitor()
    private var labelValue: String?

    init(library: ExecutorLibrary, name: String, kernel: Result<SpecialisedKernel, MTLLibraryError>) {
        self.library = library
        self.name = name
        self.kernel = kernel
    }

    var device: MTLDevice { library.executorDevice }
    var functionType: MTLFunctionType { .kernel }
    var label: String? {
        get { state.withLock { labelValue } }
        set { state.withLock { labelValue = newValue } }
    }

    /// The compiled kernel, or the error its compilation gave.
    func specialised() throws -> SpecialisedKernel { try kernel.get() }
}
