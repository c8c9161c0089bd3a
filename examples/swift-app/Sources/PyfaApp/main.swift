// A Swift app on pyfa's typed API (PyfaKit): one decode over a KV cache and
// one causal prefill, each checked against a float64 softmax computed here,
// a dense KV cache, and a refused argument. Exits 1 on a mismatch or error.
//
//   swift run pyfa-example        (in the pyfa repository)
//   swift run                     (in examples/swift-app: pyfa by version)
import PyfaKit
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Deterministic inputs in [-0.5, 0.5) (a 64-bit LCG).
func inputs(_ count: Int, seed: UInt64) -> [Float] {
    var s = seed
    return (0..<count).map { _ in
        s = s &* 6364136223846793005 &+ 1442695040888963407
        return Float(s >> 40) / Float(1 << 24) - 0.5
    }
}

/// Float64 attention of one query row over `n` key rows: (output, LSE).
func reference(q: ArraySlice<Float>, keys: (Int) -> ArraySlice<Float>, values: (Int) -> ArraySlice<Float>,
               n: Int, scale: Double) -> ([Double], Double) {
    let scores = (0..<n).map { t in zip(q, keys(t)).reduce(0.0) { $0 + Double($1.0) * Double($1.1) } * scale }
    let m = scores.max() ?? -.infinity
    let w = scores.map { exp($0 - m) }
    let total = w.reduce(0, +)
    var out = [Double](repeating: 0, count: q.count)
    for t in 0..<n {
        for (i, x) in values(t).enumerated() { out[i] += w[t] * Double(x) / total }
    }
    return (out, m + log(total))
}

func maxError(_ a: [Float], _ b: [Double]) -> Double {
    zip(a, b).reduce(0) { max($0, abs(Double($1.0) - $1.1)) }
}

func run() throws -> Bool {
    // --- decode: 8 query heads over a 2-head f16 cache (GQA), head_dim 128 ---
    let device = try Device(backend: "auto")
    print("pyfa ABI \(Library.abiVersion) on \(device.backend) (\(device.name))")
    let (heads, kvHeads, headDim, capacity) = (8, 2, 128, 1024)
    let q = try Buffer(device, shape: [heads, headDim], dtype: .float32,
                       values: inputs(heads * headDim, seed: 1))
    let k = try Buffer(device, shape: [kvHeads, capacity, headDim], dtype: .float16,
                       values: inputs(kvHeads * capacity * headDim, seed: 2))
    let v = try Buffer(device, shape: [kvHeads, capacity, headDim], dtype: .float16,
                       values: inputs(kvHeads * capacity * headDim, seed: 3))
    let decoded = try decodeAttention(q: q, k: k, v: v, kvLen: 1000,
                                      options: DecodeOptions(returnLSE: true))
    let out = try decoded.out.floats()            // [heads, headDim], f32 like q
    let lse = try decoded.lse?.floats() ?? []     // [heads]

    // Head 0 reads KV head 0; k and v hold their f16-rounded values.
    let (qs, ks, vs) = (try q.floats(), try k.floats(), try v.floats())
    let row = { (a: [Float], t: Int) in a[t * headDim..<(t + 1) * headDim] }
    let (ref, refLSE) = reference(q: qs[0..<headDim], keys: { row(ks, $0) }, values: { row(vs, $0) }, n: 1000,
                                  scale: 1 / Double(headDim).squareRoot())
    let decodeError = max(maxError(Array(out[0..<headDim]), ref), abs(Double(lse.first ?? .nan) - refLSE))
    print("decode: kv_len 1000 of \(capacity), max |error| of head 0 = \(decodeError)")

    // --- prefill: causal attention of 16 rows over 16 keys, [B, H, L, D] ---
    let (rows, dim) = (16, 64)
    let x = try Buffer(device, shape: [1, 1, rows, dim], dtype: .float32, values: inputs(rows * dim, seed: 4))
    let causal = try attention(q: x, k: x, v: x, options: AttentionOptions(causal: true)).out.floats()
    let xs = try x.floats()
    let last = rows - 1  // the last row sees every key
    let (refRow, _) = reference(q: xs[last * dim..<rows * dim], keys: { xs[$0 * dim..<($0 + 1) * dim] },
                                values: { xs[$0 * dim..<($0 + 1) * dim] }, n: rows, scale: 1 / Double(dim).squareRoot())
    let prefillError = maxError(Array(causal[last * dim..<rows * dim]), refRow)
    print("prefill: causal, max |error| of row \(last) = \(prefillError)")

    // --- a KV cache: append rows [n, kvHeads, headDim], attend one query ---
    let cache = try KVCache(device, numKVHeads: kvHeads, headDim: headDim, capacity: 4096)
    let newRows = try Buffer(device, shape: [3, kvHeads, headDim], dtype: .float32,
                             values: inputs(3 * kvHeads * headDim, seed: 5))
    try cache.append(k: newRows, v: newRows)
    let step = try cache.attend(q: q)          // [heads, headDim]
    print("cache: \(cache.count) tokens, attend -> \(step.out.shape)")

    // --- bad input throws PyfaError with the library's message ---
    do {
        _ = try decodeAttention(q: q, k: k, v: v, kvLen: capacity + 1)
        print("kv_len beyond the capacity was not refused")
        return false
    } catch let error as PyfaError {
        print("refused: \(error.code): \(error.message)")
    }
    return decodeError < 1e-4 && prefillError < 1e-4
}

do {
    if try !run() { exit(1) }
} catch {
    print("error: \(error)")
    exit(1)
}
