import PyfaCUDADriver

/// Driver-call helpers: every CUresult becomes a PyfaError naming the call.
enum CU {
    static func errorText(_ r: CUresult) -> String {
        var name: UnsafePointer<CChar>? = nil
        var text: UnsafePointer<CChar>? = nil
        _ = pyfa_cu.cuGetErrorName?(r, &name)
        _ = pyfa_cu.cuGetErrorString?(r, &text)
        let n = name.map { String(cString: $0) } ?? "CUDA error"
        let t = text.map { String(cString: $0) } ?? ""
        return "\(n) (\(r))\(t.isEmpty ? "" : ": \(t)")"
    }

    /// Throws `make(message)` when a driver call fails.
    static func check(_ r: CUresult, _ what: @autoclosure () -> String,
                      _ make: (String) -> PyfaError = PyfaError.execution) throws {
        if r != 0 { throw make("\(what()): \(errorText(r))") }
    }

    /// Out-of-memory failures are reported as such, anything else as execution errors.
    static func checkAlloc(_ r: CUresult, _ what: @autoclosure () -> String) throws {
        if r == 2 /* CUDA_ERROR_OUT_OF_MEMORY */ { throw PyfaError.outOfMemory("\(what()): \(errorText(r))") }
        try check(r, what())
    }
}

/// The primary context of one device, made current on the calling thread
/// before each group of driver calls (threads come and go through cffi).
final class CUDAContext {
    let device: CUdevice
    let context: CUcontext

    init(device: CUdevice) throws {
        self.device = device
        var ctx: CUcontext? = nil
        try CU.check(pyfa_cu.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain", PyfaError.unavailable)
        guard let ctx else { throw PyfaError.unavailable("cuDevicePrimaryCtxRetain returned no context") }
        context = ctx
    }

    deinit { _ = pyfa_cu.cuDevicePrimaryCtxRelease(device) }

    func makeCurrent() throws {
        try CU.check(pyfa_cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    }
}
