import PyfaShaderCommon

/// Element types. Raw values are the PYFA_DTYPE_* codes of pyfa_params.h.
public enum DType: Int32, CaseIterable, Sendable {
    case f32 = 0, f16 = 1, bf16 = 2, u8 = 3, u16 = 4, u32 = 5, i32 = 6

    public init(code: Int32) throws {
        guard let d = DType(rawValue: code) else {
            throw PyfaError.invalid("dtype: unknown dtype code \(code) (expected 0...6)")
        }
        self = d
    }

    public var size: Int {
        switch self {
        case .u8: return 1
        case .f16, .bf16, .u16: return 2
        case .f32, .u32, .i32: return 4
        }
    }

    public var name: String {
        switch self {
        case .f32: return "f32"
        case .f16: return "f16"
        case .bf16: return "bf16"
        case .u8: return "u8"
        case .u16: return "u16"
        case .u32: return "u32"
        case .i32: return "i32"
        }
    }

    /// Floating-point types the attention kernels read.
    public var isAttentionFloat: Bool { self == .f32 || self == .f16 || self == .bf16 }
}
