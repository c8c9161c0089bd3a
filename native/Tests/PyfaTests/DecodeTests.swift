import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

/// The Swift-side API: devices, buffers, registry, encoder and the decode op.
final class DecodeTests: XCTestCase {
    private func fill(_ b: Buffer, _ f: (Int) -> Float) {
        let p = b.contents!.bindMemory(to: Float.self, capacity: b.count)
        for i in 0..<b.count { p[i] = f(i) }
    }

    private func params(heads: UInt32, kvHeads: UInt32, headDim: UInt32, capacity: UInt32) -> pyfa_flash_attn_vec_params {
        pyfa_flash_attn_vec_params(batch: 1, num_heads: heads, num_kv_heads: kvHeads, head_dim: headDim,
                                   kv_capacity: capacity, nwg: 0, window: 0,
                                   scale: 1 / Float(headDim).squareRoot(), softcap: 0, reserved: 0)
    }

    func testDecodeMatchesDirectSoftmax() throws {
        try checkDecode(try Device.open("cpu"))
    }

    /// The Metal backend through the same Swift API: a GPU on a Mac, the MSL
    /// executor on Linux (where it must open: the package builds it there).
    func testDecodeOnMetalMatchesDirectSoftmax() throws {
        #if os(Linux)
        let device = try Device.open("metal")
        XCTAssertEqual(device.backend.info.is_gpu, 0)
        #else
        guard let device = try? Device.open("metal") else { throw XCTSkip("no Metal device") }
        #endif
        try checkDecode(device)
    }

    /// A specialisation outside the supported lists, dispatched by hand (the
    /// dispatchers never build one): the Metal kernel poisons its rows with NaN
    /// rather than leaving them unwritten.
    func testMetalKernelPoisonsUnsupportedConstants() throws {
        #if os(Linux)
        let device = try Device.open("metal")
        #else
        guard let device = try? Device.open("metal") else { throw XCTSkip("no Metal device") }
        #endif
        let (H, D, cap) = (2, 64, 32)
        var p = params(heads: UInt32(H), kvHeads: 1, headDim: UInt32(D), capacity: UInt32(cap))
        p.nwg = 1
        let q = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        let kv = try device.makeBuffer(dtype: .f32, shape: [1, 1, cap, D])
        let lens = try device.makeBuffer(dtype: .u32, shape: [1])
        let rings = try device.makeBuffer(dtype: .u32, shape: [1])
        let out = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        lens.contents!.storeBytes(of: UInt32(cap), as: UInt32.self)
        rings.contents!.storeBytes(of: UInt32(0), as: UInt32.self)
        fill(out) { _ in 0 }
        let bad = try FlashAttnVec.vecConstants(q: .f32, kv: .u8, headDim: UInt32(D), softcap: false, direct: true,
                                                variant: PYFA_VEC_VARIANT_PORTABLE, out: .f32, lse: false)
        let pipeline = try device.registry.pipeline("flash_attn_vec", constants: bad)
        let encoder = try device.makeEncoder()
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_VEC_ARG_PARAMS, .value(p)), .at(PYFA_VEC_ARG_Q, .buffer(q)), .at(PYFA_VEC_ARG_K, .buffer(kv)),
            .at(PYFA_VEC_ARG_V, .buffer(kv)), .at(PYFA_VEC_ARG_KV_LEN, .buffer(lens)),
            .at(PYFA_VEC_ARG_RING_START, .buffer(rings)), .at(PYFA_VEC_ARG_TMP, .buffer(out)),
            .at(PYFA_VEC_ARG_OUT, .buffer(out)), .at(PYFA_VEC_ARG_LSE, .buffer(out)),
            // Not paged: a zero page geometry and an unread block table (every declared slot is bound).
            .at(PYFA_VEC_ARG_PAGES, .value(pyfa_kv_pages())), .at(PYFA_VEC_ARG_BLOCK_TABLE, .buffer(lens)),
        ], grid: (1, 1, 1), threads: (32, 1, 1), threadgroupMemory: 4096)
        try encoder.commit()
        try encoder.wait()
        let o = out.contents!.bindMemory(to: Float.self, capacity: out.count)
        XCTAssertTrue((0..<out.count).allSatisfy { o[$0].isNaN })
    }

    private func checkDecode(_ device: Device) throws {
        let (H, Hkv, D, cap, n) = (4, 2, 64, 300, 257)
        let q = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        let k = try device.makeBuffer(dtype: .f32, shape: [1, Hkv, cap, D])
        let v = try device.makeBuffer(dtype: .f32, shape: [1, Hkv, cap, D])
        fill(q) { Float(($0 * 37) % 17) / 17 - 0.5 }
        fill(k) { Float(($0 * 13) % 23) / 23 - 0.5 }
        fill(v) { Float(($0 * 7) % 29) / 29 - 0.5 }
        let lens = try device.makeBuffer(dtype: .u32, shape: [1])
        let rings = try device.makeBuffer(dtype: .u32, shape: [1])
        lens.contents!.storeBytes(of: UInt32(n), as: UInt32.self)
        rings.contents!.storeBytes(of: UInt32(0), as: UInt32.self)
        let out = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        var p = params(heads: UInt32(H), kvHeads: UInt32(Hkv), headDim: UInt32(D), capacity: UInt32(cap))
        let (_, tmpBytes) = try FlashAttnVec.plan(device, &p, kvDType: .f32, maxKvLen: UInt32(n))
        let tmp = try device.makeBuffer(dtype: .f32, shape: [max(1, tmpBytes / 4)])
        let encoder = try device.makeEncoder()
        try FlashAttnVec.encode(encoder, p, q: q, k: k, v: v, kvLen: .buffer(lens), ringStart: .buffer(rings), tmp: tmp, out: out,
                                lse: nil)
        try encoder.commit()
        try encoder.wait()

        let qp = q.contents!.bindMemory(to: Float.self, capacity: q.count)
        let kp = k.contents!.bindMemory(to: Float.self, capacity: k.count)
        let vp = v.contents!.bindMemory(to: Float.self, capacity: v.count)
        let op = out.contents!.bindMemory(to: Float.self, capacity: out.count)
        for h in 0..<H {
            let kvh = h / (H / Hkv)
            var s = [Double](repeating: 0, count: n)
            for t in 0..<n {
                var dot = 0.0
                for i in 0..<D { dot += Double(qp[h * D + i]) * Double(kp[(kvh * cap + t) * D + i]) }
                s[t] = dot * Double(p.scale)
            }
            let m = s.max()!
            let w = s.map { Double(expf(Float($0 - m))) }
            let total = w.reduce(0, +)
            for i in 0..<D {
                var ref = 0.0
                for t in 0..<n { ref += w[t] * Double(vp[(kvh * cap + t) * D + i]) }
                XCTAssertEqual(Double(op[h * D + i]), ref / total, accuracy: 1e-5)
            }
        }
    }

    func testRegistryCachesOnePipelinePerConstants() throws {
        let device = try Device.open("cpu")
        let a = try device.registry.pipeline("flash_attn_vec_reduce", constants: FunctionConstants(count: 1, [0: 64]))
        let b = try device.registry.pipeline("flash_attn_vec_reduce", constants: FunctionConstants(count: 1, [0: 64]))
        let c = try device.registry.pipeline("flash_attn_vec_reduce", constants: FunctionConstants(count: 1, [0: 128]))
        XCTAssertTrue(a === b)
        XCTAssertFalse(a === c)
        XCTAssertThrowsError(try device.registry.pipeline("no_such_kernel"))
    }

    func testRulesThrowInvalidArgument() throws {
        let device = try Device.open("cpu")
        var p = params(heads: 6, kvHeads: 4, headDim: 64, capacity: 8)
        XCTAssertThrowsError(try FlashAttnVec.plan(device, &p, kvDType: .f32, maxKvLen: 4)) { error in
            let e = error as! PyfaError
            XCTAssertEqual(e.status, PYFA_ERR_INVALID_ARGUMENT)
            XCTAssertTrue(e.message.hasPrefix("num_heads: 6 must be a multiple of num_kv_heads"))
        }
        var q = params(heads: 4, kvHeads: 2, headDim: 100, capacity: 8)
        XCTAssertThrowsError(try FlashAttnVec.plan(device, &q, kvDType: .f32, maxKvLen: 4))
        XCTAssertThrowsError(try Device.open("tpu"))
        XCTAssertThrowsError(try device.makeBuffer(dtype: .f32, shape: [-1]))
    }

    func testPlanFillsWorkgroupsAndTmpSize() throws {
        let device = try Device.open("cpu")
        var p = params(heads: 16, kvHeads: 8, headDim: 256, capacity: 16384)
        let (geometry, tmpBytes) = try FlashAttnVec.plan(device, &p, kvDType: .f32, maxKvLen: 16384)
        XCTAssertGreaterThanOrEqual(p.nwg, 1)
        XCTAssertEqual(geometry.nwg, p.nwg)
        XCTAssertEqual(tmpBytes, p.nwg == 1 ? 0 : 16 * Int(p.nwg) * (256 + 2) * 4)
    }
}
