import MSLExecutor

/// A kernel ready to dispatch. Limits are the executor's: 1024 threads per
/// threadgroup, SIMD-groups of 32.
public protocol MTLComputePipelineState: AnyObject {
    var label: String? { get }
    var device: MTLDevice { get }
    var maxTotalThreadsPerThreadgroup: Int { get }
    var threadExecutionWidth: Int { get }
    /// Threadgroup memory the kernel declares in its body.
    var staticThreadgroupMemoryLength: Int { get }
    var supportIndirectCommandBuffers: Bool { get }
}

final class ExecutorPipelineState: MTLComputePipelineState, @unchecked Sendable {
    let executorDevice: ExecutorDevice
    let kernel: SpecialisedKernel
    let staticThreadgroupMemoryLength: Int

    init(device: ExecutorDevice, function kernel: SpecialisedKernel) {
        executorDevice = device
        self.kernel = kernel
        staticThreadgroupMemoryLength = kernel.staticThreadgroupMemoryLength
    }

    var label: String? { nil }
    var device: MTLDevice { executorDevice }
    var maxTotalThreadsPerThreadgroup: Int { Int(MSLX_MAX_THREADS_PER_THREADGROUP) }
    var threadExecutionWidth: Int { Int(MSLX_SIMD_WIDTH) }
    var supportIndirectCommandBuffers: Bool { false }
    var name: String { String(cString: mslx_function_name(kernel.handle)) }
}
