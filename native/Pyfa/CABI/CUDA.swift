import CPyfa
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

@_cdecl("pyfa_encoder_set_stream")
public func pyfa_encoder_set_stream_impl(_ encoder: OpaquePointer?, _ stream: UInt64) -> Int32 {
    abiCall { try (object(encoder, "encoder") as CommandEncoder).useStream(stream) }
}

@_cdecl("pyfa_encoder_is_capturing")
public func pyfa_encoder_is_capturing_impl(_ encoder: OpaquePointer?, _ out: UnsafeMutablePointer<UInt32>?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        guard let out else { throw PyfaError.invalid("out: is NULL") }
        out.pointee = e.isCapturing ? 1 : 0
    }
}

@_cdecl("pyfa_cuda_compile_all")
public func pyfa_cuda_compile_all_impl(_ arch: UnsafePointer<CChar>?, _ count: UnsafeMutablePointer<UInt32>?) -> Int32 {
    abiCall {
        let a = try string(arch, "arch")
        try require(a.hasPrefix("sm_") && a.count >= 5, "arch: expected an NVRTC architecture such as sm_80 or sm_90a, got '\(a)'")
        // The kernels as a device of that architecture compiles them (its shared memory decides some).
        let dims = CUDAPlan.tqMmaDims(maxShared: CUDAPlan.sharedLimit(arch: a))
        let compiler = try CUDACompiler(arch: a, extraOptions: CUDAPlan.compileDefines(tqMmaDims: dims))
        var total: UInt32 = 0
        // NVRTC's time grows faster than linearly with the entries of one
        // program: compile them in programs of at most `chunk` entries.
        let chunk = 512
        // PYFA_CUDA_COMPILE_ONLY=<prefix>: only the entries whose names start with it
        // (e.g. flash_attn_vec__fc2_2_128_), to look at a few kernels' code quickly.
        let only = getenv("PYFA_CUDA_COMPILE_ONLY").map { String(cString: $0) } ?? ""
        // PYFA_CUDA_COMPILE_FULL=1: the kernels as a plan builds them (bodies
        // inlined, no -rdc), for their true register and stack use; slower.
        let check = CUDAPlan.envInt("PYFA_CUDA_COMPILE_FULL", 0) == 0
        for (name, all) in try specialisations(arch: a) {
            let specs = all.map(\.values).filter { only.isEmpty || CUDACompiler.entryName(name, $0).hasPrefix(only) }
            if specs.isEmpty { continue }
            for start in stride(from: 0, to: specs.count, by: chunk) {
                _ = try compiler.cubin(name: name, specialisations: Array(specs[start..<min(start + chunk, specs.count)]),
                                       check: check)
            }
            total += UInt32(specs.count)
        }
        if let count { count.pointee = total }
    }
}

/// Every specialisation a plan for `arch` can request: on sm_90a both prefill
/// paths of 16-bit inputs (warpgroup MMA, and mma.sync when it is turned off).
private func specialisations(arch: String) throws -> [(name: String, constants: [FunctionConstants])] {
    let plain = CUDAPlan(smCount: 1, residentBlocks: { _, _, _ in 0 })
    var all = try KernelSpecialisations.all(plan: plain)
    guard arch == "sm_90a" else { return all }
    let hopper = try KernelSpecialisations.prefill(plan: CUDAPlan(smCount: 1, residentBlocks: { _, _, _ in 0 },
                                                                  sm90a: true, prefillWgmma: 1))
    for (name, extra) in hopper {
        guard let i = all.firstIndex(where: { $0.name == name }) else { continue }
        var seen = Set(all[i].constants)
        for c in extra where seen.insert(c).inserted { all[i].constants.append(c) }
    }
    return all
}
