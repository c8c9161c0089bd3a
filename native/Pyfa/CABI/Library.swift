import CPyfa
import PyfaShaderCommon
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

@_cdecl("pyfa_abi_version")
public func pyfa_abi_version_impl() -> UInt32 { UInt32(PYFA_ABI_VERSION) }

private let backendsCString: UnsafeMutablePointer<CChar> = strdup(Device.compiledBackends.joined(separator: ","))!

@_cdecl("pyfa_backends")
public func pyfa_backends_impl() -> UnsafePointer<CChar> { UnsafePointer(backendsCString) }

/// Sizes of the structs that cross the ABI or reach kernels, as compiled.
let structSizes: [String: Int] = [
    "pyfa_device_info": MemoryLayout<pyfa_device_info>.size,
    "pyfa_flash_attn_vec_params": MemoryLayout<pyfa_flash_attn_vec_params>.size,
    "pyfa_attn_reduce_params": MemoryLayout<pyfa_attn_reduce_params>.size,
    "pyfa_kv_append_params": MemoryLayout<pyfa_kv_append_params>.size,
    "pyfa_flash_attn_prefill_params": MemoryLayout<pyfa_flash_attn_prefill_params>.size,
    "pyfa_merge_attn_params": MemoryLayout<pyfa_merge_attn_params>.size,
    "pyfa_tq_quantize_params": MemoryLayout<pyfa_tq_quantize_params>.size,
    "pyfa_tq_dequantize_params": MemoryLayout<pyfa_tq_dequantize_params>.size,
    "pyfa_tq_fwht_params": MemoryLayout<pyfa_tq_fwht_params>.size,
    "pyfa_flash_attn_vec_tq_params": MemoryLayout<pyfa_flash_attn_vec_tq_params>.size,
    "pyfa_tq_reduce_undo_params": MemoryLayout<pyfa_tq_reduce_undo_params>.size,
    "pyfa_kv_pages": MemoryLayout<pyfa_kv_pages>.size,
    // paged appends
    "pyfa_kv_append_paged_params": MemoryLayout<pyfa_kv_append_paged_params>.size,
    "pyfa_tq_quantize_paged_params": MemoryLayout<pyfa_tq_quantize_paged_params>.size,
    // device-resident cache lengths
    "pyfa_kv_state": MemoryLayout<pyfa_kv_state>.size,
    "pyfa_kv_advance_params": MemoryLayout<pyfa_kv_advance_params>.size,
]

@_cdecl("pyfa_struct_size")
public func pyfa_struct_size_impl(_ name: UnsafePointer<CChar>?) -> Int {
    guard let name else { return 0 }
    return structSizes[String(cString: name)] ?? 0
}

/// Where the CUDA backend looks for NVRTC first (set by the Python side,
/// which can find the pip wheel's copy).
nonisolated(unsafe) var nvrtcPathOverride: String? = nil
private let nvrtcPathLock = Lock()

func currentNvrtcPath() -> String? { nvrtcPathLock.withLock { nvrtcPathOverride } }

@_cdecl("pyfa_set_nvrtc_path")
public func pyfa_set_nvrtc_path_impl(_ path: UnsafePointer<CChar>?) -> Int32 {
    abiCall {
        let value = path.map { String(cString: $0) }
        nvrtcPathLock.withLock { nvrtcPathOverride = value }
    }
}
