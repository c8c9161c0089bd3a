import PyfaShaderCommon

/// Element types of pyfa buffers (the `PYFA_DTYPE_*` codes of pyfa_params.h).
/// The attention ops read and write `.float32`, `.float16` and `.bfloat16`;
/// the integer types serve masks (`.uint8`) and indices.
public enum DType: Int32, CaseIterable, Sendable, CustomStringConvertible {
    /// IEEE binary32.
    case float32 = 0
    /// IEEE binary16.
    case float16 = 1
    /// bfloat16: the top 16 bits of a binary32.
    case bfloat16 = 2
    /// Unsigned bytes (boolean masks: non-zero attends; TurboQuant codes).
    case uint8 = 3
    /// Unsigned 16-bit integers.
    case uint16 = 4
    /// Unsigned 32-bit integers.
    case uint32 = 5
    /// Signed 32-bit integers (per-sequence lengths and ring starts).
    case int32 = 6

    /// Bytes per element.
    public var size: Int {
        switch self {
        case .float32, .uint32, .int32: return 4
        case .float16, .bfloat16, .uint16: return 2
        case .uint8: return 1
        }
    }

    /// True for the float types the attention kernels use (f32, f16, bf16).
    public var isFloat: Bool { self == .float32 || self == .float16 || self == .bfloat16 }

    /// The name the library's messages use ("f32", "bf16", "u8", ...).
    public var description: String {
        switch self {
        case .float32: return "f32"
        case .float16: return "f16"
        case .bfloat16: return "bf16"
        case .uint8: return "u8"
        case .uint16: return "u16"
        case .uint32: return "u32"
        case .int32: return "i32"
        }
    }
}

/// Float <-> 16-bit conversions for host access to f16 / bf16 buffers, in
/// bit arithmetic rather than Swift's `Float16` (unavailable on Intel macOS).
/// Both narrowings round to nearest even, as the kernels do; overflow gives
/// infinity; NaN stays NaN.
enum HalfBits {
    static func fromFloat16(_ h: UInt16) -> Float {
        let sign = UInt32(h & 0x8000) << 16
        let exponent = Int(h >> 10) & 0x1f
        let mantissa = UInt32(h & 0x3ff)
        if exponent == 0x1f {  // infinity or NaN
            return Float(bitPattern: sign | 0x7f80_0000 | (mantissa << 13))
        }
        if exponent == 0 {  // zero or subnormal: mantissa * 2^-24, exact in f32
            let magnitude = Float(mantissa) * Float(bitPattern: 0x3380_0000)
            return sign != 0 ? -magnitude : magnitude
        }
        return Float(bitPattern: sign | UInt32(exponent + 112) << 23 | (mantissa << 13))
    }

    static func toFloat16(_ f: Float) -> UInt16 {
        let bits = f.bitPattern
        let sign = UInt16((bits >> 16) & 0x8000)
        let a = Swift.abs(f)
        if a.isNaN { return sign | 0x7e00 }
        // 65520 and above round to infinity under round-to-nearest-even.
        if a >= 65520 { return sign | 0x7c00 }
        if a < Float(bitPattern: 0x3880_0000) {  // below 2^-14: a subnormal half
            // a * 2^24 is the subnormal's integer mantissa; Float's rounding to
            // an integer here is to nearest even (exact, since a < 2^-14).
            let m = (a * Float(bitPattern: 0x4b80_0000)).rounded(.toNearestOrEven)
            return sign | UInt16(m)
        }
        // Normal: keep 10 of the 23 mantissa bits, rounding the dropped 13 to nearest even.
        let abits = a.bitPattern
        let rounded = abits &+ 0x0fff &+ ((abits >> 13) & 1)
        return sign | UInt16(truncatingIfNeeded: (rounded >> 13) &- (112 << 10))
    }

    static func fromBFloat16(_ b: UInt16) -> Float { Float(bitPattern: UInt32(b) << 16) }

    static func toBFloat16(_ f: Float) -> UInt16 {
        let bits = f.bitPattern
        if f.isNaN { return UInt16(bits >> 16) | 0x0040 }  // stays a (quiet) NaN
        return UInt16(truncatingIfNeeded: (bits &+ 0x7fff &+ ((bits >> 16) & 1)) >> 16)
    }
}
