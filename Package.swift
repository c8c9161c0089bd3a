// swift-tools-version:6.0
// libpyfa: flash-attention kernels behind one C ABI (native/CPyfa/include/pyfa.h).
import PackageDescription

// The Metal backend (native/Pyfa/Backends/Metal) is written against Apple's
// Metal API. On Apple platforms that is the system framework; on Linux it is
// this package's own `Metal` module, which runs the same .metal sources on an
// MSL CPU executor (native/MSLExecutor), so the Metal path builds and is
// tested everywhere.
#if os(Linux)
let metalTargets: [Target] = [
    .target(
        name: "MSLExecutor",
        path: "native/MSLExecutor",
        exclude: ["stdlib"],
        cSettings: [.define("_GNU_SOURCE")],
        linkerSettings: [.linkedLibrary("dl"), .linkedLibrary("pthread")]
    ),
    .target(name: "Metal", dependencies: ["MSLExecutor"], path: "native/MetalLinux"),
    .testTarget(name: "MetalLinuxTests", dependencies: ["Metal", "MSLExecutor"], path: "native/Tests/MetalLinuxTests"),
]
let metalDependency: [Target.Dependency] = ["Metal"]
let metalLinker: [LinkerSetting] = []
#else
let metalTargets: [Target] = []
let metalDependency: [Target.Dependency] = []
let metalLinker: [LinkerSetting] = [.linkedFramework("Metal", .when(platforms: [.macOS, .iOS]))]
#endif

let package = Package(
    name: "pyfa",
    // The Metal backend's floor: Metal 3 era API (unified-memory queries, concurrent encoders).
    platforms: [.macOS(.v13), .iOS(.v16)],
    products: [
        .library(name: "pyfa", type: .dynamic, targets: ["Pyfa"]),
        // The Swift API over the C ABI: what Swift apps depend on (README, Swift).
        .library(name: "PyfaKit", targets: ["PyfaKit"]),
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
        // The embedded Metal kernel sources (C23 #embed of shaders/metal/*).
        .target(name: "PyfaMetalSources", path: "native/MetalSources"),
        .target(
            name: "Pyfa",
            dependencies: ["CPyfa", "PyfaShaderCommon", "PyfaCPUKernels", "PyfaCUDADriver", "PyfaMetalSources"]
                + metalDependency,
            path: "native/Pyfa",
            swiftSettings: [.swiftLanguageMode(.v5)],
            linkerSettings: metalLinker
        ),
        // Typed Swift API over the C ABI. Its module is named PyfaKit, not
        // Pyfa: the implementation module `Pyfa` exports classes of the same
        // names (Device, Buffer, PyfaError) for its own tests. It links the
        // implementation in (the `Pyfa` dependency) but calls only pyfa.h.
        .target(name: "PyfaKit", dependencies: ["CPyfa", "PyfaShaderCommon", "Pyfa"], path: "native/PyfaKit"),
        // The example app is the standalone package's (examples/swift-app),
        // so the program CI runs by version is the one `swift run pyfa-example` runs.
        .executableTarget(name: "PyfaExample", dependencies: ["PyfaKit"], path: "examples/swift-app/Sources/PyfaApp"),
        .testTarget(name: "PyfaTests", dependencies: ["Pyfa", "CPyfa", "PyfaShaderCommon"], path: "native/Tests/PyfaTests",
                    swiftSettings: [.swiftLanguageMode(.v5)]),
        .testTarget(name: "PyfaKitTests", dependencies: ["PyfaKit", "CPyfa"], path: "native/Tests/PyfaKitTests"),
    ] + metalTargets
)
