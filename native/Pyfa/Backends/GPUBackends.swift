/// GPU backends compiled into this build, best first, and how to open each.
/// A backend folder adds its entry here; Ops/ never name a backend.
let gpuBackendOpeners: [String: () throws -> Backend] = [
    "cuda": { try CUDABackend() },
    "metal": { try MetalBackend() },
]
let gpuBackendNames: [String] = ["cuda", "metal"]
