import XCTest
import Dispatch
import CPyfa
import PyfaKit

final class PlanConcurrencyTests: XCTestCase {
    let device = try! Device(backend: "cpu")

    func counters() -> pyfa_counters {
        var c = pyfa_counters()
        XCTAssertEqual(pyfa_counters_get(&c), PYFA_OK)
        return c
    }

    func testDecodePlanRunsMatchDecodeAndAllocateNothing() throws {
        let (B, H, Hkv, cap, D) = (2, 4, 2, 48, 64)
        let plan = try DecodePlan(device, batch: B, heads: H, kvHeads: Hkv, headDim: D, capacity: cap,
                                  qDType: .float32, kvDType: .float16, softcap: 3, returnLSE: true)
        let q = try filled(device, [B, H, D], seed: 1)
        let k = try filled(device, [B, Hkv, cap, D], .float16, seed: 2), v = try filled(device, [B, Hkv, cap, D], .float16, seed: 3)
        let out = try Buffer(device, shape: [B, H, D], dtype: .float32), lse = try Buffer(device, shape: [B, H], dtype: .float32)
        try plan.run(q: q, k: k, v: v, kvLen: [1, 1], out: out, lse: lse)  // first run: kernels compiled, nothing else
        let before = counters()
        for lengths in [[48, 5], [7, 30], [20, 20]] {
            try plan.run(q: q, k: k, v: v, kvLen: lengths, out: out, lse: lse)
            let expected = try decodeAttention(q: q, k: k, v: v, kvLen: lengths,
                                               options: DecodeOptions(softcap: 3, returnLSE: true))
            assertClose(try out.floats(), try expected.out.floats().map(Double.init), tol: 2e-6, "out \(lengths)")
            assertClose(try lse.floats(), try expected.lse!.floats().map(Double.init), tol: 2e-6, "lse \(lengths)")
        }
        // decodeAttention allocated its results; the plan runs added nothing to
        // the plans made, and a run alone allocates no host memory.
        let mid = counters()
        XCTAssertGreaterThan(mid.host_allocations, before.host_allocations, "the counter sees decodeAttention's results")
        try plan.run(q: q, k: k, v: v, kvLen: [9, 9], out: out, lse: lse)
        XCTAssertEqual(counters().host_allocations, mid.host_allocations)
        XCTAssertEqual(counters().plans_created, before.plans_created)
    }

    func testDecodePlanRefusesBuffersThatDoNotFit() throws {
        let plan = try DecodePlan(device, heads: 2, kvHeads: 1, headDim: 64, capacity: 8, qDType: .float32, kvDType: .float32)
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        let out = try Buffer(device, shape: [2, 64], dtype: .float32)
        assertPyfaError(.invalidArgument, "q: dtype f16 differs from the plan's f32") {
            try plan.run(q: try filled(device, [2, 64], .float16, seed: 1), k: k, v: k, kvLen: 8, out: out)
        }
        assertPyfaError(.invalidArgument, "k: shape [1, 4, 64] does not fit the plan") {
            try plan.run(q: q, k: try filled(device, [1, 4, 64], seed: 2), v: k, kvLen: 4, out: out)
        }
        assertPyfaError(.invalidArgument, "lse: the plan was made without return_lse") {
            try plan.run(q: q, k: k, v: k, kvLen: 8, out: out, lse: try Buffer(device, shape: [2], dtype: .float32))
        }
        assertPyfaError(.invalidArgument, "kv_len[0]: 9") { try plan.run(q: q, k: k, v: k, kvLen: 9, out: out) }
    }

    func testDecodePlanChecksItsOptionsWhenMade() {
        assertPyfaError(.invalidArgument, "head_dim: 72 is not supported") {
            try DecodePlan(device, heads: 2, kvHeads: 1, headDim: 72, capacity: 8, qDType: .float32, kvDType: .float32)
        }
    }

    func testConcurrentAppendsEachGetTheirOwnSlots() throws {
        let (D, perThread, threads) = (64, 3, 8)
        let cache = try KVCache(device, numKVHeads: 1, headDim: D, capacity: perThread * threads, dtype: .float32)
        // Thread t appends rows whose values are all t: after every append the
        // cache holds each thread's rows once, whatever the order.
        let failures = Failures()
        let device = self.device
        DispatchQueue.concurrentPerform(iterations: threads) { t in
            do {
                let rows = try Buffer(device, shape: [perThread, 1, D], dtype: .float32,
                                      values: [Float](repeating: Float(t), count: perThread * D))
                try cache.append(k: rows, v: rows)
            } catch {
                failures.add("\(error)")
            }
        }
        XCTAssertEqual(failures.all, [])
        XCTAssertEqual(cache.count, perThread * threads)
        // One query head, scale 0: uniform weights, so out is the mean of the values: the mean of 0..<threads.
        let result = try cache.attend(q: try filled(device, [1, D], seed: 1), options: CacheAttendOptions(scale: 0))
        assertClose(try result.out.floats(), [Double](repeating: Double(threads - 1) / 2, count: D), tol: 1e-5, "mean")
    }

    func testConcurrentDecodesOnOneDeviceMatchSerialOnes() throws {
        let q = try filled(device, [4, 64], seed: 1), k = try filled(device, [2, 32, 64], seed: 2)
        let serial = try (1...8).map { try decodeAttention(q: q, k: k, v: k, kvLen: $0 * 4).out.floats() }
        let results = Results(count: 8)
        DispatchQueue.concurrentPerform(iterations: 8) { i in
            results.set(i, (try? decodeAttention(q: q, k: k, v: k, kvLen: (i + 1) * 4).out.floats()) ?? [])
        }
        XCTAssertEqual(results.all, serial)
    }
}

/// Collected from concurrent closures under a lock.
final class Failures: @unchecked Sendable {
    private var items: [String] = []
    private let lock = DispatchQueue(label: "failures")
    func add(_ s: String) { lock.sync { items.append(s) } }
    var all: [String] { lock.sync { items } }
}

final class Results: @unchecked Sendable {
    private var items: [[Float]]
    private let lock = DispatchQueue(label: "results")
    init(count: Int) { items = Array(repeating: [], count: count) }
    func set(_ i: Int, _ value: [Float]) { lock.sync { items[i] = value } }
    var all: [[Float]] { lock.sync { items } }
}
