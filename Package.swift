// swift-tools-version:6.0
// libpyfa: flash-attention kernels behind one C ABI (native/CPyfa/include/pyfa.h).
import PackageDescription

let package = Package(
    name: "pyfa",
    products: [
        .library(name: "pyfa", type: .dynamic, targets: ["Pyfa"]),
        .executable(name: "pyfa-example", targets: ["PyfaExample"]),
    ],
    targets: [
        // Parameter structs and constants shared by every kernel language and Swift.
        .target(name: "PyfaShaderCommon", path: "shaders/common", publicHeadersPath: "."),
        // The C ABI header plus the small C runtime pieces (thread-local error slot).
        .target(name: "CPyfa", dependencies: ["PyfaShaderCommon"], path: "native/CPyfa"),
        // CPU kernels: one C function per threadgroup, run on a pthread pool.
        .target(
            name: "PyfaCPUKernels",
            dependencies: ["PyfaShaderCommon", "CPyfa"],
            path: "native/CPUKernels"
        ),
        // CUDA driver + NVRTC prototypes, their dlopen loader and the embedded
        // kernel sources (C23 #embed of shaders/cuda/*): no CUDA SDK at build time.
        .target(
            name: "PyfaCUDADriver",
            path: "native/CUDADriver",
            linkerSettings: [.linkedLibrary("dl"), .linkedLibrary("pthread")]
        ),
        .target(
            name: "Pyfa",
            dependencies: ["CPyfa", "PyfaShaderCommon", "PyfaCPUKernels", "PyfaCUDADriver"],
            path: "native/Pyfa",
            swiftSettings: [.swiftLanguageMode(.v5)]
        ),
        .executableTarget(name: "PyfaExample", dependencies: ["Pyfa", "CPyfa"], path: "native/Example",
                          swiftSettings: [.swiftLanguageMode(.v5)]),
        .testTarget(name: "PyfaTests", dependencies: ["Pyfa", "CPyfa", "PyfaShaderCommon"], path: "native/Tests/PyfaTests",
                    swiftSettings: [.swiftLanguageMode(.v5)]),
    ]
)
