// A Swift program that links libpyfa and runs one decode through the C ABI
// (the same calls Python makes). Run: swift run pyfa-example
import CPyfa
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

func check(_ status: Int32, _ what: String) {
    if status != PYFA_OK {
        print("\(what) failed: \(String(cString: pyfa_last_error()))")
        exit(1)
    }
}

var device: OpaquePointer? = nil
check(pyfa_device_new(&device, "auto"), "pyfa_device_new")
var info = pyfa_device_info()
check(pyfa_device_info_get(device, &info), "pyfa_device_info_get")
let backendName = withUnsafeBytes(of: info.backend) { String(cString: $0.bindMemory(to: CChar.self).baseAddress!) }
print("pyfa ABI \(pyfa_abi_version()), backends: \(String(cString: pyfa_backends())), using: \(backendName)")

let (heads, kvHeads, headDim, capacity, kvLen) = (8, 2, 128, 1024, 1000)
func makeBuffer(_ dtype: Int32, _ shape: [Int64]) -> OpaquePointer? {
    var b: OpaquePointer? = nil
    check(pyfa_buffer_new(&b, device, dtype, UInt32(shape.count), shape, PYFA_STORAGE_SHARED), "pyfa_buffer_new")
    return b
}
let q = makeBuffer(PYFA_DTYPE_F32, [1, Int64(heads), Int64(headDim)])
let k = makeBuffer(PYFA_DTYPE_F32, [1, Int64(kvHeads), Int64(capacity), Int64(headDim)])
let v = makeBuffer(PYFA_DTYPE_F32, [1, Int64(kvHeads), Int64(capacity), Int64(headDim)])
let lens = makeBuffer(PYFA_DTYPE_U32, [1])
let rings = makeBuffer(PYFA_DTYPE_U32, [1])
let out = makeBuffer(PYFA_DTYPE_F32, [1, Int64(heads), Int64(headDim)])
let lse = makeBuffer(PYFA_DTYPE_F32, [1, Int64(heads)])

// Deterministic inputs: v rows are one-hot at (position % head_dim), and k
// favours the last position, so the output concentrates there.
var seed: UInt64 = 1
func rand() -> Float {
    seed = seed &* 6364136223846793005 &+ 1442695040888963407
    return Float(seed >> 40) / Float(1 << 24) - 0.5
}
let qp = pyfa_buffer_contents(q)!.bindMemory(to: Float.self, capacity: heads * headDim)
for i in 0..<heads * headDim { qp[i] = rand() }
let kp = pyfa_buffer_contents(k)!.bindMemory(to: Float.self, capacity: kvHeads * capacity * headDim)
let vp = pyfa_buffer_contents(v)!.bindMemory(to: Float.self, capacity: kvHeads * capacity * headDim)
for i in 0..<kvHeads * capacity * headDim { kp[i] = rand(); vp[i] = rand() }
pyfa_buffer_contents(lens)!.storeBytes(of: UInt32(kvLen), as: UInt32.self)
pyfa_buffer_contents(rings)!.storeBytes(of: UInt32(0), as: UInt32.self)

var params = pyfa_flash_attn_vec_params(batch: 1, num_heads: UInt32(heads), num_kv_heads: UInt32(kvHeads),
                                        head_dim: UInt32(headDim), kv_capacity: UInt32(capacity), nwg: 0, window: 0,
                                        scale: 1 / Float(headDim).squareRoot(), softcap: 0, reserved: 0)
var tmpBytes: UInt64 = 0
check(pyfa_flash_attn_vec_plan(device, &params, PYFA_DTYPE_F32, UInt32(kvLen), &tmpBytes), "pyfa_flash_attn_vec_plan")
let tmp = tmpBytes > 0 ? makeBuffer(PYFA_DTYPE_U8, [Int64(tmpBytes)]) : nil
var tmpF32: OpaquePointer? = nil
if tmpBytes > 0 {
    check(pyfa_buffer_wrap(&tmpF32, device, pyfa_buffer_contents(tmp), tmpBytes, PYFA_DTYPE_F32, 1, [Int64(tmpBytes / 4)]), "pyfa_buffer_wrap")
}
var encoder: OpaquePointer? = nil
check(pyfa_encoder_new(&encoder, device), "pyfa_encoder_new")
check(pyfa_flash_attn_vec(encoder, &params, q, k, v, lens, rings, tmpF32, out, lse), "pyfa_flash_attn_vec")
check(pyfa_encoder_commit(encoder), "pyfa_encoder_commit")
check(pyfa_encoder_wait(encoder), "pyfa_encoder_wait")

// Check head 0 against a direct softmax-weighted sum.
let scale = params.scale
var scores = [Double](repeating: 0, count: kvLen)
for t in 0..<kvLen {
    var s = 0.0
    for i in 0..<headDim { s += Double(qp[i]) * Double(kp[t * headDim + i]) }
    scores[t] = s * Double(scale)
}
let m = scores.max()!
let w = scores.map { exp($0 - m) }
let total = w.reduce(0, +)
let op = pyfa_buffer_contents(out)!.bindMemory(to: Float.self, capacity: heads * headDim)
var maxErr = 0.0
for i in 0..<headDim {
    var ref = 0.0
    for t in 0..<kvLen { ref += w[t] * Double(vp[t * headDim + i]) }
    maxErr = max(maxErr, abs(ref / total - Double(op[i])))
}
let lseErr = abs(Double(pyfa_buffer_contents(lse)!.load(as: Float.self)) - (m + log(total)))
print("decode: heads=\(heads) kv_heads=\(kvHeads) head_dim=\(headDim) kv_len=\(kvLen) nwg=\(params.nwg) max|err| head 0 = \(maxErr), |lse err| = \(lseErr)")
for b in [q, k, v, lens, rings, out, lse, tmp, tmpF32] { pyfa_buffer_free(b) }
pyfa_encoder_free(encoder)
pyfa_device_free(device)
if maxErr > 1e-4 || lseErr > 1e-4 { exit(1) }

