// swift-tools-version:6.0
// A Swift app that depends on pyfa by version, as any app outside the pyfa
// repository does (README, Swift). scripts/swift_example_check.sh builds and
// runs it against the current commit, mirrored under pyfa's URL with a tag.
import PackageDescription

let package = Package(
    name: "pyfa-swift-app",
    platforms: [.macOS(.v13), .iOS(.v16)],
    dependencies: [
        .package(url: "https://github.com/pyfa-project/pyfa.git", from: "0.1.0"),
    ],
    targets: [
        .executableTarget(
            name: "PyfaApp",
            dependencies: [.product(name: "PyfaKit", package: "pyfa")]
        ),
    ]
)
