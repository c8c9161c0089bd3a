import XCTest
import PyfaKit

/// Float64 references and inputs shared by the PyfaKit tests. Shapes are
/// small and every op runs on the CPU device.
enum Ref {
    /// Deterministic values in [-1, 1) (a 64-bit LCG), distinct per seed.
    static func values(_ count: Int, seed: UInt64) -> [Float] {
        var s = seed &* 0x9E37_79B9_7F4A_7C15 &+ 1
        return (0..<count).map { _ in
            s = s &* 6364136223846793005 &+ 1442695040888963407
            return Float(s >> 40) / Float(1 << 23) - 1
        }
    }

    /// Softmax attention of one query row: scores = scale · q·k_j (softcap
    /// applied, then `bias[j]` added); keys with visible[j] false are left
    /// out. Returns (out, lse); a row with no visible key gives zeros, -inf.
    static func row(q: [Double], keys: [[Double]], values: [[Double]], scale: Double, softcap: Double = 0,
                    visible: [Bool]? = nil, bias: [Double]? = nil) -> ([Double], Double) {
        var scores: [Double] = []
        var picked: [Int] = []
        for j in keys.indices where visible?[j] ?? true {
            var s = zip(q, keys[j]).reduce(0) { $0 + $1.0 * $1.1 } * scale
            if softcap > 0 { s = softcap * tanh(s / softcap) }
            s += bias?[j] ?? 0
            if s == -.infinity { continue }
            scores.append(s)
            picked.append(j)
        }
        guard let m = scores.max() else { return ([Double](repeating: 0, count: q.count), -.infinity) }
        let w = scores.map { exp($0 - m) }
        let total = w.reduce(0, +)
        var out = [Double](repeating: 0, count: q.count)
        for (i, j) in picked.enumerated() {
            for d in out.indices { out[d] += w[i] * values[j][d] / total }
        }
        return (out, m + log(total))
    }

    /// Rows of a row-major [..., D] array as Double vectors.
    static func rows(_ a: [Float], _ d: Int) -> [[Double]] {
        stride(from: 0, to: a.count, by: d).map { a[$0..<$0 + d].map(Double.init) }
    }
}

/// Asserts |actual - expected| <= tol elementwise (equal infinities pass).
func assertClose(_ actual: [Float], _ expected: [Double], tol: Double, _ what: String,
                 file: StaticString = #filePath, line: UInt = #line) {
    XCTAssertEqual(actual.count, expected.count, "\(what): count", file: file, line: line)
    var worst = 0.0, at = -1
    for (i, (a, e)) in zip(actual, expected).enumerated() {
        if Double(a) == e { continue }
        let err = abs(Double(a) - e)
        if !(err <= worst) { worst = err.isNaN ? .infinity : err; at = i }
    }
    XCTAssertLessThanOrEqual(worst, tol, "\(what): worst error at \(at)", file: file, line: line)
}

/// Asserts `body` throws a PyfaError of `code` whose message contains `fragment`.
func assertPyfaError<T>(_ code: PyfaError.Code, _ fragment: String, file: StaticString = #filePath, line: UInt = #line,
                        _ body: () throws -> T) {
    do {
        _ = try body()
        XCTFail("expected PyfaError.\(code) containing '\(fragment)', nothing was thrown", file: file, line: line)
    } catch let error as PyfaError {
        XCTAssertEqual(error.code, code, "\(error)", file: file, line: line)
        XCTAssertEqual(error.status, code.rawValue, file: file, line: line)
        XCTAssertTrue(error.message.contains(fragment), "message '\(error.message)' lacks '\(fragment)'",
                      file: file, line: line)
    } catch {
        XCTFail("expected PyfaError, got \(error)", file: file, line: line)
    }
}

/// A buffer of `shape` and `dtype` filled with Ref.values.
func filled(_ device: Device, _ shape: [Int], _ dtype: DType = .float32, seed: UInt64,
            storage: Buffer.Storage = .shared) throws -> Buffer {
    try Buffer(device, shape: shape, dtype: dtype, values: Ref.values(shape.reduce(1, *), seed: seed), storage: storage)
}
