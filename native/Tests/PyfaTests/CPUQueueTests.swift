import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

/// Keeps what an encoder commits instead of running it, so a test can edit
/// the command list (drop a barrier) and run it on a CPU queue of its choice.
private final class RecordingQueue: CommandQueue {
    var commands: [EncodedCommand] = []
    func submit(_ commands: [EncodedCommand]) throws { self.commands += commands }
    func wait() throws {}
}

/// The CPU queue's barrier-stress modes (PYFA_CPU_BARRIER_STRESS) and the
/// kernels' failure reports (pyfa_cpu_fail).
final class CPUQueueTests: XCTestCase {
    private func fill(_ b: Buffer, _ f: (Int) -> Float) {
        let p = b.contents!.bindMemory(to: Float.self, capacity: b.count)
        for i in 0..<b.count { p[i] = f(i) }
    }

    private func floats(_ b: Buffer) -> [Float] {
        Array(UnsafeBufferPointer(start: b.contents!.bindMemory(to: Float.self, capacity: b.count), count: b.count))
    }

    /// A split decode (nwg = 4: flash_attn_vec writes partials to tmp, the
    /// reduce reads them) recorded through the encoder, with and without the
    /// barrier between the two dispatches, run in every mode.
    func testStressModesExposeAMissingBarrier() throws {
        let device = try Device.open("cpu")
        let (H, Hkv, D, cap, n) = (4, 2, 64, 600, 520)
        let q = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        let k = try device.makeBuffer(dtype: .f32, shape: [1, Hkv, cap, D])
        let v = try device.makeBuffer(dtype: .f32, shape: [1, Hkv, cap, D])
        fill(q) { Float(($0 * 37) % 17) / 17 - 0.5 }
        fill(k) { Float(($0 * 13) % 23) / 23 - 0.5 }
        fill(v) { Float(($0 * 7) % 29) / 29 + 0.5 } // outputs near 1, far from a zeroed out
        let lens = try device.makeBuffer(dtype: .u32, shape: [1])
        let rings = try device.makeBuffer(dtype: .u32, shape: [1])
        lens.contents!.storeBytes(of: UInt32(n), as: UInt32.self)
        rings.contents!.storeBytes(of: UInt32(0), as: UInt32.self)
        let out = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        var p = pyfa_flash_attn_vec_params(batch: 1, num_heads: UInt32(H), num_kv_heads: UInt32(Hkv),
                                           head_dim: UInt32(D), kv_capacity: UInt32(cap), nwg: 4, window: 0,
                                           scale: 1 / Float(D).squareRoot(), softcap: 0, reserved: 0)
        let (_, tmpBytes) = try FlashAttnVec.plan(device, &p, kvDType: .f32, maxKvLen: UInt32(n))
        XCTAssertEqual(p.nwg, 4)
        let tmp = try device.makeBuffer(dtype: .f32, shape: [tmpBytes / 4])

        let recorder = RecordingQueue()
        let encoder = CommandEncoder(device: device, queue: recorder)
        try FlashAttnVec.encode(encoder, p, q: q, k: k, v: v, kvLen: .buffer(lens), ringStart: .buffer(rings), tmp: tmp, out: out,
                                lse: nil)
        try encoder.commit()
        let withBarrier = recorder.commands
        let withoutBarrier = withBarrier.filter { if case .barrier = $0 { return false } else { return true } }
        XCTAssertEqual(withBarrier.count, 3, "vec, barrier, reduce")
        XCTAssertEqual(withoutBarrier.count, 2)

        // Fresh tmp and out for every run: stale partials from an earlier run
        // would hide a reduce that ran too early.
        func run(_ commands: [EncodedCommand], _ stress: BarrierStress) throws -> [Float] {
            fill(tmp) { _ in 0 }
            fill(out) { _ in 0 }
            let queue = try device.makeQueue(barrierStress: stress)
            try queue.submit(commands)
            try queue.wait()
            return floats(out)
        }
        let reference = try run(withBarrier, .off)
        XCTAssertTrue(reference.allSatisfy { $0 > 0.5 }, "the decode produced an output")
        for mode in [BarrierStress.reverse, .concurrent] {
            XCTAssertEqual(try run(withBarrier, mode), reference, "barrier recorded, mode \(mode)")
        }
        // Today's order hides the missing barrier ...
        XCTAssertEqual(try run(withoutBarrier, .off), reference)
        // ... reverse order runs the reduce over partials not yet written.
        let reversed = try run(withoutBarrier, .reverse)
        let worst = zip(reversed, reference).map { abs($0 - $1) }.max()!
        XCTAssertGreaterThan(worst, 0.5, "reverse mode must change the result of a decode without its barrier")
    }

    func testStressModeComesFromTheEnvironment() throws {
        defer { unsetenv(BarrierStress.variable) }
        for (value, mode) in [("off", BarrierStress.off), ("", .off), ("reverse", .reverse), ("concurrent", .concurrent)] {
            setenv(BarrierStress.variable, value, 1)
            XCTAssertEqual(try BarrierStress.fromEnvironment(), mode)
        }
        unsetenv(BarrierStress.variable)
        XCTAssertEqual(try BarrierStress.fromEnvironment(), .off)
        setenv(BarrierStress.variable, "sideways", 1)
        XCTAssertThrowsError(try Device.open("cpu").makeEncoder()) { error in
            XCTAssertEqual((error as! PyfaError).status, PYFA_ERR_INVALID_ARGUMENT)
        }
    }

    /// A decode dispatched with a head_dim constant no kernel copy is built
    /// for (the dispatcher's validation never lets one through): the kernel's
    /// default case reports, the queue throws, the output stays untouched.
    func testKernelDefaultCaseIsAnError() throws {
        let device = try Device.open("cpu")
        let (H, Hkv, D, cap) = (2, 1, 64, 16)
        let q = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        let k = try device.makeBuffer(dtype: .f32, shape: [1, Hkv, cap, D])
        let v = try device.makeBuffer(dtype: .f32, shape: [1, Hkv, cap, D])
        let lens = try device.makeBuffer(dtype: .u32, shape: [1])
        let rings = try device.makeBuffer(dtype: .u32, shape: [1])
        let out = try device.makeBuffer(dtype: .f32, shape: [1, H, D])
        fill(q) { _ in 0.25 }
        fill(k) { _ in 0.5 }
        fill(v) { _ in 1 }
        fill(out) { _ in 7 }
        lens.contents!.storeBytes(of: UInt32(cap), as: UInt32.self)
        rings.contents!.storeBytes(of: UInt32(0), as: UInt32.self)
        let p = pyfa_flash_attn_vec_params(batch: 1, num_heads: UInt32(H), num_kv_heads: UInt32(Hkv),
                                           head_dim: UInt32(D), kv_capacity: UInt32(cap), nwg: 1, window: 0,
                                           scale: 0.125, softcap: 0, reserved: 0)
        let args: [SlotArg] = [
            .at(PYFA_VEC_ARG_PARAMS, .value(p)), .at(PYFA_VEC_ARG_Q, .buffer(q)),
            .at(PYFA_VEC_ARG_K, .buffer(k)), .at(PYFA_VEC_ARG_V, .buffer(v)),
            .at(PYFA_VEC_ARG_KV_LEN, .buffer(lens)), .at(PYFA_VEC_ARG_RING_START, .buffer(rings)),
            .at(PYFA_VEC_ARG_OUT, .buffer(out)), .at(PYFA_VEC_ARG_LSE, .buffer(out)),
        ]
        let scratch = device.backend.plan.flashAttnVec(p, kvDType: .f32, maxKvLen: UInt32(cap)).threadgroupMemory
        func dispatch(headDim: Int32, kvDType: Int32) throws -> PyfaError? {
            let constants = try FunctionConstants(count: PYFA_VEC_FC_COUNT, [
                PYFA_VEC_FC_Q_DTYPE: DType.f32.rawValue, PYFA_VEC_FC_KV_DTYPE: kvDType, PYFA_VEC_FC_HEAD_DIM: headDim,
                PYFA_VEC_FC_HAS_SOFTCAP: 0, PYFA_VEC_FC_DIRECT_OUT: 1, PYFA_VEC_FC_VARIANT: PYFA_VEC_VARIANT_PORTABLE,
                PYFA_VEC_FC_OUT_DTYPE: DType.f32.rawValue, PYFA_VEC_FC_HAS_LSE: 0, PYFA_VEC_FC_PAGED: 0,
            ])
            let pipeline = try device.registry.pipeline("flash_attn_vec", constants: constants)
            let encoder = try device.makeEncoder()
            try encoder.dispatch(pipeline, args: args, grid: (1, UInt32(Hkv), 1), threads: (1, 1, 1),
                                 threadgroupMemory: scratch)
            try encoder.commit()
            do {
                try encoder.wait()
                return nil
            } catch let e as PyfaError {
                return e
            }
        }

        // The supported constant runs (the arguments are sound).
        XCTAssertNil(try dispatch(headDim: Int32(D), kvDType: DType.f32.rawValue))
        XCTAssertEqual(floats(out)[0], 1, accuracy: 1e-6)
        fill(out) { _ in 7 }

        let e = try XCTUnwrap(try dispatch(headDim: 100, kvDType: DType.f32.rawValue))
        XCTAssertEqual(e.status, PYFA_ERR_INTERNAL)
        XCTAssertEqual(e.message, "kernel flash_attn_vec: unsupported head_dim 100")
        XCTAssertTrue(floats(out).allSatisfy { $0 == 7 }, "nothing written")

        let bad = try XCTUnwrap(try dispatch(headDim: Int32(D), kvDType: DType.u8.rawValue))
        XCTAssertEqual(bad.message, "kernel flash_attn_vec: unsupported kv dtype \(DType.u8.rawValue)")
        XCTAssertTrue(floats(out).allSatisfy { $0 == 7 }, "nothing written")
    }
}
