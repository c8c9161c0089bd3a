import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

#if canImport(Glibc)
import Glibc
#endif

/// The kernel registry and the function-constant builder.
final class RegistryTests: XCTestCase {
    /// A backend stand-in whose compile is slow and counted.
    private final class SlowPipeline: Pipeline { let name = "slow" }

    /// Every index below the family's count set exactly once, or an internal error naming the rule.
    func testFunctionConstantsRules() throws {
        func message(_ body: () throws -> FunctionConstants) -> String {
            do { _ = try body(); return "" } catch let e as PyfaError { return e.message } catch { return "\(error)" }
        }
        XCTAssertEqual(try FunctionConstants(count: 3, [2: 5, 0: 1, 1: 9]).values, [1, 9, 5])
        XCTAssertEqual(try FunctionConstants(count: 0, [:]).values, [])
        XCTAssertTrue(message { try FunctionConstants(count: 3, [0: 1, 2: 2]) }.contains("constant 1 of 3 not set"))
        XCTAssertTrue(message { try FunctionConstants(count: 2, [0: 1, 0: 2, 1: 3]) }.contains("constant 0 set twice"))
        XCTAssertTrue(message { try FunctionConstants(count: 2, [0: 1, 2: 2]) }.contains("index 2 is outside 0..<2"))
        XCTAssertTrue(message { try FunctionConstants(count: 2, [-1: 1]) }.contains("index -1 is outside"))
        XCTAssertTrue(message { try FunctionConstants(count: 65, [:]) }.contains("count 65 is outside 0...64"))
        XCTAssertTrue(message { try FunctionConstants(count: 64, [0: 1, 63: 2]) }.contains("constant 1 of 64 not set"))
    }

    func testRacingThreadsCompileEachSpecialisationOnce() throws {
        let registry = KernelRegistry(compile: { _, _ in
            usleep(20_000)
            return SlowPipeline()
        })
        let constants = try FunctionConstants(count: 2, [0: 7, 1: 9])
        var threads: [pthread_t] = []
        final class Box { let body: () -> Void; init(_ b: @escaping () -> Void) { body = b } }
        for _ in 0..<8 {
            let box = Unmanaged.passRetained(Box { _ = try? registry.pipeline("k", constants: constants) })
            var t = pthread_t()
            pthread_create(&t, nil, { arg in
                let b = Unmanaged<Box>.fromOpaque(arg!).takeRetainedValue()
                b.body()
                return nil
            }, box.toOpaque())
            threads.append(t)
        }
        for t in threads { pthread_join(t, nil) }
        XCTAssertEqual(registry.compileCount, 1)
        let a = try registry.pipeline("k", constants: constants)
        let b = try registry.pipeline("k", constants: constants)
        XCTAssertTrue(a === b)
        XCTAssertEqual(registry.compileCount, 1)
    }

    func testFailedCompileIsNotCached() throws {
        var attempts = 0
        let registry = KernelRegistry(compile: { _, _ in
            attempts += 1
            if attempts == 1 { throw PyfaError.compile("first try fails") }
            return SlowPipeline()
        })
        XCTAssertThrowsError(try registry.pipeline("k"))
        XCTAssertNoThrow(try registry.pipeline("k"))
        XCTAssertEqual(attempts, 2)
    }

    func testConstantsAreSetByIndexExactlyOnce() throws {
        let c = try FlashAttnVec.vecConstants(q: .f16, kv: .bf16, headDim: 128, softcap: true, direct: false,
                                              variant: PYFA_VEC_VARIANT_PORTABLE, out: .bf16, lse: true)
        XCTAssertEqual(c.values.count, Int(PYFA_VEC_FC_COUNT))
        XCTAssertEqual(c.values[Int(PYFA_VEC_FC_KV_DTYPE)], DType.bf16.rawValue)
        XCTAssertEqual(c.values[Int(PYFA_VEC_FC_HEAD_DIM)], 128)
        XCTAssertEqual(c.values[Int(PYFA_VEC_FC_HAS_SOFTCAP)], 1)
        // The split path folds out and lse away: its partials are f32 and the reduce writes both.
        XCTAssertEqual(c.values[Int(PYFA_VEC_FC_OUT_DTYPE)], DType.f32.rawValue)
        XCTAssertEqual(c.values[Int(PYFA_VEC_FC_HAS_LSE)], 0)
    }

    func testSpecialisationListsHaveNoDuplicates() throws {
        for (name, list) in try KernelSpecialisations.all(plan: try Device.open("cpu").backend.plan) {
            XCTAssertEqual(Set(list).count, list.count, name)
        }
    }
}
