/// Every (kernel, function constants) pair the dispatchers can request, so a
/// backend that compiles ahead of use (CI's CUDA compile check) covers them
/// all. Each op family appends its own list.
enum KernelSpecialisations {
    static var all: [(name: String, constants: [[Int32]])] {
        flashAttnVec + turboQuant
    }

    static let floatCodes: [Int32] = FlashAttnVec.floatTypes.map(\.rawValue)
    static let headDims: [Int32] = supportedHeadDims.sorted().map { Int32($0) }

    static var flashAttnVec: [(name: String, constants: [[Int32]])] {
        var vec: [[Int32]] = []
        for q in floatCodes {
            for kv in floatCodes {
                for d in headDims {
                    for softcap: Int32 in [0, 1] {
                        for direct: Int32 in [0, 1] { vec.append([q, kv, d, softcap, direct]) }
                    }
                }
            }
        }
        return [(FlashAttnVec.kernel, vec), (FlashAttnVec.reduceKernel, headDims.map { [$0] })]
    }

    static var turboQuant: [(name: String, constants: [[Int32]])] {
        let bits = TurboQuant.bitWidths.map { Int32($0) }, dims = TurboQuant.headDims.map { Int32($0) }
        let srcCodes = TurboQuant.floatTypes.map(\.rawValue)
        var quantize: [[Int32]] = [], dequantize: [[Int32]] = [], fwht: [[Int32]] = [], vec: [[Int32]] = []
        for d in dims {
            for src in srcCodes {
                fwht.append([src, d])
                for b in bits { quantize.append([src, b, d]) }
            }
            for b in bits { dequantize.append([b, d]) }
            for kb in bits {
                for vb in bits {
                    for softcap: Int32 in [0, 1] {
                        for direct: Int32 in [0, 1] { vec.append([kb, vb, d, softcap, direct]) }
                    }
                }
            }
        }
        return [("hadamard_quantize_kv", quantize), ("tq_dequantize_kv", dequantize)]
            + TurboQuant.fwhtKernels.map { ($0, fwht) }
            + [(FlashAttnVecTQ.kernel, vec), (FlashAttnVecTQ.fusedReduceKernel, dims.map { [$0] })]
    }
}
