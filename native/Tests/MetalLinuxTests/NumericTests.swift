import Glibc
import Metal
import XCTest

/// half and bfloat conversions (round to nearest even) and a few math
/// functions, bit-exact or within a stated error of the C library.
final class NumericTests: MetalTestCase {
    func testHalfAndBFloatConversions() throws {
        let source = """
        kernel void convert(device const float *x [[buffer(0)]], device ushort *halves [[buffer(1)]],
                            device ushort *bfloats [[buffer(2)]], device float *back [[buffer(3)]],
                            uint i [[thread_position_in_grid]]) {
            half h = half(x[i]);
            bfloat b = bfloat(x[i]);
            halves[i] = as_type<ushort>(h);
            bfloats[i] = as_type<ushort>(b);
            back[2 * i] = float(h);
            back[2 * i + 1] = float(b);
        }
        """
        let state = try pipeline(source, "convert")
        // (input, half bits, bfloat bits)
        let cases: [(Float, UInt16, UInt16)] = [
            (1.0, 0x3C00, 0x3F80),
            (1.00048828125, 0x3C00, 0x3F80),      // 1 + 2^-11: half tie -> even (1.0)
            (1.00146484375, 0x3C02, 0x3F80),      // 1 + 3*2^-11: half tie -> even (1 + 2^-9)
            (1.00390625, 0x3C04, 0x3F80),         // 1 + 2^-8: bfloat tie -> even (1.0)
            (1.01171875, 0x3C0C, 0x3F82),         // 1 + 3*2^-8: bfloat tie -> even (1 + 2^-6)
            (65504, 0x7BFF, 0x4780),              // half max; bfloat rounds 65504 up to 65536
            (65519, 0x7BFF, 0x4780),              // below the half overflow threshold
            (65520, 0x7C00, 0x4780),              // half tie at max -> inf
            (-2.5, 0xC100, 0xC020),
            (5.9604644775390625e-08, 0x0001, 0x3380),  // 2^-24: smallest half subnormal
            (2.98023223876953125e-08, 0x0000, 0x3300), // 2^-25: half tie -> even (0)
            (8.94069671630859375e-08, 0x0002, 0x33C0), // 3*2^-25: half tie -> even (2^-23)
            (.infinity, 0x7C00, 0x7F80),
            (-0.0, 0x8000, 0x8000),
            (3.0e38, 0x7C00, 0x7F62),
        ]
        let input = buffer(cases.map { $0.0 } + [.nan])
        let n = cases.count + 1
        let halves = buffer(zeros: n, of: UInt16.self)
        let bfloats = buffer(zeros: n, of: UInt16.self)
        let back = buffer(zeros: 2 * n, of: Float.self)
        assertCompleted(run(state, buffers: [input, halves, bfloats, back], groups: size(1), threads: size(n)))
        let h = read(halves, as: UInt16.self), b = read(bfloats, as: UInt16.self), f = read(back, as: Float.self)
        for (i, c) in cases.enumerated() {
            XCTAssertEqual(h[i], c.1, "half(\(c.0)) bits 0x\(String(h[i], radix: 16))")
            XCTAssertEqual(b[i], c.2, "bfloat(\(c.0)) bits 0x\(String(b[i], radix: 16))")
            XCTAssertEqual(f[2 * i + 1].bitPattern, UInt32(c.2) << 16, "float(bfloat(\(c.0)))")
        }
        XCTAssertEqual(f[2], 1.0)
        XCTAssertEqual(f[10], 65504)
        XCTAssertEqual(f[14], .infinity)
        XCTAssertEqual(f[18], 5.9604644775390625e-08)
        XCTAssertTrue(f[2 * cases.count].isNaN && f[2 * cases.count + 1].isNaN, "NaN converts to NaN")
        XCTAssertEqual(h[cases.count] & 0x7C00, 0x7C00)
        XCTAssertNotEqual(h[cases.count] & 0x03FF, 0)
    }

    func testMathFunctions() throws {
        let source = """
        kernel void math(device const float *x [[buffer(0)]], device float *out [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
            float v = x[i];
            device float *r = out + i * 12;
            r[0] = exp(v); r[1] = log(fabs(v) + 1.0f); r[2] = sqrt(fabs(v)); r[3] = rsqrt(fabs(v) + 1.0f);
            r[4] = tanh(v); r[5] = fma(v, 3.0f, 0.25f); r[6] = exp2(v); r[7] = max(v, 0.5f);
            r[8] = clamp(v, -1.0f, 1.0f); r[9] = precise::exp(v); r[10] = fast::exp(v); r[11] = floor(v);
        }
        """
        let state = try pipeline(source, "math")
        let x: [Float] = [0, 1, -1, 0.5, 2.25, -3.75, 10, -20]
        let out = buffer(zeros: x.count * 12, of: Float.self)
        assertCompleted(run(state, buffers: [buffer(x), out], groups: size(1), threads: size(x.count)))
        let got = read(out, as: Float.self)
        for (i, v) in x.enumerated() {
            let expected: [Float] = [expf(v), logf(fabsf(v) + 1), sqrtf(fabsf(v)), 1 / sqrtf(fabsf(v) + 1),
                                     tanhf(v), v * 3 + 0.25, exp2f(v), max(v, 0.5), min(max(v, -1), 1),
                                     expf(v), expf(v), floorf(v)]
            let names = ["exp", "log", "sqrt", "rsqrt", "tanh", "fma", "exp2", "max", "clamp",
                         "precise::exp", "fast::exp", "floor"]
            for k in 0..<12 {
                let e = expected[k], g = got[i * 12 + k]
                // Metal's precise functions are within 4 ulp; the exact ones (fma, max, clamp, floor,
                // sqrt) must match; fast::exp is allowed more.
                let ulps: Float = [5, 7, 8, 11].contains(k) || k == 2 ? 0 : (k == 10 ? 64 : 4)
                XCTAssertLessThanOrEqual(abs(g - e), ulps * e.ulp, "\(names[k])(\(v)): got \(g), expected \(e)")
            }
        }
    }
}
