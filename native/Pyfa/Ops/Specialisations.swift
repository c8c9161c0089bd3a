/// Every (kernel, function constants) pair the dispatchers can request, so a
/// backend that compiles ahead of use (CI's CUDA compile check) covers them
/// all. Each op family appends its own list.
enum KernelSpecialisations {
    static var all: [(name: String, constants: [[Int32]])] {
        flashAttnVec
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
}
