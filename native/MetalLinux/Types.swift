// Value types and enumerations of Apple's Metal API, with Apple's names and
// raw values, as far as the Linux executor needs them. Apple imports these
// from C; they deliberately add nothing Apple lacks (no Equatable on MTLSize),
// so code that compiles against this module compiles against Apple's.

/// Seconds, as Core Foundation measures time intervals.
public typealias CFTimeInterval = Double

public struct MTLSize: Sendable {
    public var width: Int
    public var height: Int
    public var depth: Int
    public init() { width = 0; height = 0; depth = 0 }
    public init(width: Int, height: Int, depth: Int) {
        self.width = width; self.height = height; self.depth = depth
    }
}

public struct MTLOrigin: Sendable {
    public var x: Int
    public var y: Int
    public var z: Int
    public init() { x = 0; y = 0; z = 0 }
    public init(x: Int, y: Int, z: Int) { self.x = x; self.y = y; self.z = z }
}

public struct MTLResourceOptions: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }

    public static let cpuCacheModeDefaultCache = MTLResourceOptions([])
    public static let cpuCacheModeWriteCombined = MTLResourceOptions(rawValue: 1)
    public static let storageModeShared = MTLResourceOptions([])
    public static let storageModeManaged = MTLResourceOptions(rawValue: 1 << 4)
    public static let storageModePrivate = MTLResourceOptions(rawValue: 2 << 4)
    public static let storageModeMemoryless = MTLResourceOptions(rawValue: 3 << 4)
    public static let hazardTrackingModeDefault = MTLResourceOptions([])
    public static let hazardTrackingModeUntracked = MTLResourceOptions(rawValue: 1 << 8)
    public static let hazardTrackingModeTracked = MTLResourceOptions(rawValue: 2 << 8)

    var storageMode: MTLStorageMode { MTLStorageMode(rawValue: (rawValue >> 4) & 0xF) ?? .shared }
    var cpuCacheMode: MTLCPUCacheMode { MTLCPUCacheMode(rawValue: rawValue & 0xF) ?? .defaultCache }
    var hazardTrackingMode: MTLHazardTrackingMode {
        MTLHazardTrackingMode(rawValue: (rawValue >> 8) & 0x3) ?? .default
    }
}

public enum MTLStorageMode: UInt, Sendable {
    case shared = 0, managed = 1, `private` = 2, memoryless = 3
}

public enum MTLCPUCacheMode: UInt, Sendable {
    case defaultCache = 0, writeCombined = 1
}

public enum MTLHazardTrackingMode: UInt, Sendable {
    case `default` = 0, untracked = 1, tracked = 2
}

public enum MTLPurgeableState: UInt, Sendable {
    case keepCurrent = 1, nonVolatile = 2, volatile = 3, empty = 4
}

public struct MTLResourceUsage: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    public static let read = MTLResourceUsage(rawValue: 1)
    public static let write = MTLResourceUsage(rawValue: 2)
}

public enum MTLDataType: UInt, Sendable {
    case none = 0, `struct` = 1, array = 2
    case float = 3, float2 = 4, float3 = 5, float4 = 6
    case half = 16, half2 = 17, half3 = 18, half4 = 19
    case int = 29, int2 = 30, int3 = 31, int4 = 32
    case uint = 33, uint2 = 34, uint3 = 35, uint4 = 36
    case short = 37, short2 = 38, short3 = 39, short4 = 40
    case ushort = 41, ushort2 = 42, ushort3 = 43, ushort4 = 44
    case char = 45, char2 = 46, char3 = 47, char4 = 48
    case uchar = 49, uchar2 = 50, uchar3 = 51, uchar4 = 52
    case bool = 53, bool2 = 54, bool3 = 55, bool4 = 56
    case pointer = 60
    case long = 81, long2 = 82, long3 = 83, long4 = 84
    case ulong = 85, ulong2 = 86, ulong3 = 87, ulong4 = 88
    case bfloat = 121, bfloat2 = 122, bfloat3 = 123, bfloat4 = 124
}

public enum MTLDispatchType: UInt, Sendable {
    case serial = 0, concurrent = 1
}

public struct MTLBarrierScope: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    public static let buffers = MTLBarrierScope(rawValue: 1)
    public static let textures = MTLBarrierScope(rawValue: 2)
    public static let renderTargets = MTLBarrierScope(rawValue: 4)
}

public enum MTLDeviceLocation: UInt, Sendable {
    case builtIn = 0, slot = 1, external = 2, unspecified = 18446744073709551615
}

public enum MTLGPUFamily: Int, Sendable {
    case apple1 = 1001, apple2 = 1002, apple3 = 1003, apple4 = 1004, apple5 = 1005
    case apple6 = 1006, apple7 = 1007, apple8 = 1008, apple9 = 1009
    case mac1 = 2001, mac2 = 2002
    case common1 = 3001, common2 = 3002, common3 = 3003
    case macCatalyst1 = 4001, macCatalyst2 = 4002
    case metal3 = 5001
}

public enum MTLFunctionType: UInt, Sendable {
    case vertex = 1, fragment = 2, kernel = 3, visible = 5, intersection = 6, mesh = 7, object = 8
}

public enum MTLLanguageVersion: UInt, Sendable {
    case version1_1 = 65537, version1_2 = 65538
    case version2_0 = 131072, version2_1 = 131073, version2_2 = 131074, version2_3 = 131075, version2_4 = 131076
    case version3_0 = 196608, version3_1 = 196609, version3_2 = 196610
}

public enum MTLMathMode: Int, Sendable {
    case safe = 0, relaxed = 1, fast = 2
}

public enum MTLMathFloatingPointFunctions: Int, Sendable {
    case fast = 0, precise = 1
}

public enum MTLLibraryType: Int, Sendable {
    case executable = 0, dynamic = 1
}

public enum MTLLibraryOptimizationLevel: Int, Sendable {
    case `default` = 0, size = 1
}

public enum MTLCommandBufferStatus: UInt, Sendable {
    case notEnqueued = 0, enqueued = 1, committed = 2, scheduled = 3, completed = 4, error = 5
}
