import CPyfa
import PyfaCUDADriver
import PyfaShaderCommon
#if canImport(Glibc)
import Glibc
#endif

/// TMA tensor maps a kernel reads from its inline arguments (cuda_layout.h):
/// built at launch from the dispatch's buffers and parameter struct, because
/// a map holds the tensor's address. A map that cannot be built (a driver
/// without cuTensorMapEncodeTiled, an address or stride TMA refuses) is left
/// out, and the kernel copies those tiles with cp.async instead: K's and V's
/// together (all or none), q's on its own.
struct CUDATensorMaps {
    /// One map: the buffer and row geometry it views, and the argument slot it goes to.
    struct Map {
        let slot: Int32
        let bufferSlot: Int32
        let rows: (pyfa_flash_attn_prefill_params) -> UInt64
        let heads: (pyfa_flash_attn_prefill_params) -> UInt64
        let strides: (pyfa_flash_attn_prefill_params) -> (Int64, Int64, Int64)
        let boxRows: UInt32
        /// Left out alone where it cannot be built (the others stay); else all maps are.
        var optional = false
    }

    let maps: [Map]
    let headDim: Int
    /// The maps that are not optional, all or none (counted once, not per launch).
    let required: Int

    init(maps: [Map], headDim: Int) {
        self.maps = maps
        self.headDim = headDim
        required = maps.filter { !$0.optional }.count
    }
    static let knob = getenv("PYFA_CUDA_PREFILL_TMA").map { String(cString: $0) } ?? ""
    static let enabled = knob != "0"
    /// PYFA_CUDA_PREFILL_TMA=kv: K's and V's maps only (the consumers copy Q, as where q's map cannot be built).
    static let queryMap = knob != "kv"

    /// The maps of a pipeline: the warpgroup-MMA prefill (16-bit, its tile;
    /// the grid kernel and the persistent one) in rectangular mode takes K and
    /// V stages by TMA at the head dims pyfa_cuda_prefill_wgmma_tma names, and
    /// its query tile where pyfa_cuda_prefill_wgmma_q_tma says for the kernel (cuda_layout.h,
    /// PYFA_CUDA_PREFILL_ARG_TMAP_Q).
    /// PYFA_CUDA_PREFILL_TMA=0 leaves every map out (the kernels' cp.async
    /// stages, as where the driver cannot build a map; tests exercise that path with it).
    static func recipe(kernel: String, constants: FunctionConstants) -> CUDATensorMaps? {
        let v = constants.values
        guard kernel == FlashAttnPrefill.kernel || kernel == FlashAttnPrefill.persistentKernel,
              v.count == Int(PYFA_PREFILL_FC_COUNT), enabled else { return nil }
        let d = v[Int(PYFA_PREFILL_FC_HEAD_DIM)]
        guard pyfa_cuda_prefill_wgmma_tma(d) != 0, v[Int(PYFA_PREFILL_FC_DTYPE)] != DType.f32.rawValue,
              v[Int(PYFA_PREFILL_FC_BLOCK_Q)] == pyfa_cuda_prefill_wgmma_block_q(d, PYFA_PREFILL_KV_RECT),
              v[Int(PYFA_PREFILL_FC_BLOCK_K)] == pyfa_cuda_prefill_wgmma_block_k(d, PYFA_PREFILL_KV_RECT),
              v[Int(PYFA_PREFILL_FC_KV_MODE)] == PYFA_PREFILL_KV_RECT else { return nil }
        let box = UInt32(pyfa_cuda_prefill_wgmma_stage_keys(d, PYFA_PREFILL_KV_RECT))
        let kv = { (p: pyfa_flash_attn_prefill_params) in UInt64(p.kv_len) }
        let kvHeads = { (p: pyfa_flash_attn_prefill_params) in UInt64(p.num_kv_heads) }
        var maps = [
            Map(slot: PYFA_CUDA_PREFILL_ARG_TMAP_K, bufferSlot: PYFA_PREFILL_ARG_K, rows: kv, heads: kvHeads,
                strides: { ($0.k_strides.0, $0.k_strides.1, $0.k_strides.2) }, boxRows: box),
            Map(slot: PYFA_CUDA_PREFILL_ARG_TMAP_V, bufferSlot: PYFA_PREFILL_ARG_V, rows: kv, heads: kvHeads,
                strides: { ($0.v_strides.0, $0.v_strides.1, $0.v_strides.2) }, boxRows: box),
        ]
        let persistent: Int32 = kernel == FlashAttnPrefill.persistentKernel ? 1 : 0
        if queryMap && pyfa_cuda_prefill_wgmma_q_tma(d, PYFA_PREFILL_KV_RECT, v[Int(PYFA_PREFILL_FC_DO_CAUSAL)], persistent) != 0 {
            maps.append(Map(slot: PYFA_CUDA_PREFILL_ARG_TMAP_Q, bufferSlot: PYFA_PREFILL_ARG_Q,
                            rows: { UInt64($0.q_len) }, heads: { UInt64($0.num_heads) },
                            strides: { ($0.q_strides.0, $0.q_strides.1, $0.q_strides.2) },
                            boxRows: UInt32(pyfa_cuda_prefill_wgmma_block_q(d, PYFA_PREFILL_KV_RECT)), optional: true))
        }
        return CUDATensorMaps(maps: maps, headDim: Int(d))
    }

    /// Encodes the maps into `raw` (the launch's pyfa_cuda_args) from inline
    /// offset `cursor` on (each at a multiple of 64 bytes) and points their
    /// slots at them; returns the new cursor. The required maps (K's and V's)
    /// all or none: the kernel takes their TMA only with both; an optional map
    /// (q's) that cannot be built, or has no room, is left out alone.
    func encode(into raw: UnsafeMutableRawBufferPointer, cursor: Int,
                args: [SlotArg]) -> Int {
        guard let encodeTiled = pyfa_cu.cuTensorMapEncodeTiled else { return cursor }
        // Read from the dispatch's arguments in place (nothing allocated per launch).
        var params: pyfa_flash_attn_prefill_params? = nil
        for a in args where a.slot == Int(PYFA_PREFILL_ARG_PARAMS) {
            if case .bytes(let bytes) = a.arg, bytes.count == MemoryLayout<pyfa_flash_attn_prefill_params>.size {
                params = bytes.withUnsafeBytes { $0.loadUnaligned(as: pyfa_flash_attn_prefill_params.self) }
            }
        }
        func bufferAddress(_ slot: Int32) -> UInt64? {
            for a in args where a.slot == Int(slot) {
                if case .buffer(let b, let offset) = a.arg { return b.deviceAddress + UInt64(offset) }
            }
            return nil
        }
        let base = MemoryLayout<UInt64>.stride * Int(PYFA_CUDA_MAX_ARGS)
        let start = (cursor + 63) & ~63
        guard let p = params, start + 128 * required <= Int(PYFA_CUDA_INLINE_BYTES) else { return cursor }
        for (i, m) in maps.enumerated() {
            let at = start + 128 * i
            if m.optional && at + 128 > Int(PYFA_CUDA_INLINE_BYTES) { continue }
            guard let address = bufferAddress(m.bufferSlot), encodeOne(m, p, address, encodeTiled,
                                                                   into: raw.baseAddress!.advanced(by: base + at)) else {
                if m.optional { continue }
                for earlier in maps[..<i] { raw.storeBytes(of: UInt64(0), toByteOffset: Int(earlier.slot) * 8, as: UInt64.self) }
                return cursor
            }
            raw.storeBytes(of: UInt64(at) | PYFA_CUDA_INLINE_TAG, toByteOffset: Int(m.slot) * 8, as: UInt64.self)
        }
        return start + 128 * maps.count
    }

    /// The byte strides of row, head and batch of a 16-bit [batch, heads, rows, headDim] view with
    /// element strides (batch, head, row), or nil where TMA cannot view it: multiples of 16 below
    /// 2^40 (TMA's rule), extents of at most 2^32. A dimension of extent 1 never advances, so it
    /// takes the contiguous stride whatever the tensor's is.
    static func strides(_ s: (Int64, Int64, Int64), rows: UInt64, heads: UInt64, batch: UInt64,
                        headDim: Int) -> (UInt64, UInt64, UInt64)? {
        guard rows > 0, heads > 0, batch > 0, max(rows, heads, batch) <= (1 << 32) else { return nil }
        let row = UInt64(headDim * 2)
        func legal(_ elements: Int64, extent: UInt64, contiguous: UInt64) -> UInt64? {
            if extent == 1 { return contiguous }
            let b = elements * 2
            return b > 0 && b % 16 == 0 && b < (1 << 40) ? UInt64(b) : nil
        }
        guard let rowStride = legal(s.2, extent: rows, contiguous: row),
              let headStride = legal(s.1, extent: heads, contiguous: row * rows),
              let batchStride = legal(s.0, extent: batch, contiguous: row * rows * heads) else { return nil }
        return (rowStride, headStride, batchStride)
    }

    /// Whether a rectangular prefill launch of `p` will carry q's, K's and V's maps, as far as is
    /// known before its buffers are bound: the knobs allow them, the driver builds maps, and TMA
    /// takes the strides of q, k and v. A launch whose buffer address is not 16-byte aligned still
    /// leaves that map out (the persistent kernel then runs its body without maps).
    static func allPrefillMapsExpected(_ p: pyfa_flash_attn_prefill_params) -> Bool {
        guard enabled, queryMap, pyfa_cu.cuTensorMapEncodeTiled != nil else { return false }
        let d = Int(p.head_dim), b = UInt64(p.batch)
        return strides(p.q_strides, rows: UInt64(p.q_len), heads: UInt64(p.num_heads), batch: b, headDim: d) != nil
            && strides(p.k_strides, rows: UInt64(p.kv_len), heads: UInt64(p.num_kv_heads), batch: b, headDim: d) != nil
            && strides(p.v_strides, rows: UInt64(p.kv_len), heads: UInt64(p.num_kv_heads), batch: b, headDim: d) != nil
    }

    /// One map into `dst` (128 bytes); false where TMA cannot view the tensor.
    private func encodeOne(_ m: Map, _ p: pyfa_flash_attn_prefill_params, _ address: UInt64,
                           _ encodeTiled: @convention(c) (UnsafeMutableRawPointer?, Int32, UInt32, UnsafeMutableRawPointer?,
                                                          UnsafePointer<UInt64>?, UnsafePointer<UInt64>?,
                                                          UnsafePointer<UInt32>?, UnsafePointer<UInt32>?,
                                                          Int32, Int32, Int32, Int32) -> CUresult,
                           into dst: UnsafeMutableRawPointer) -> Bool {
        let rows = m.rows(p), heads = m.heads(p), batch = UInt64(p.batch)
        guard address % 16 == 0,
              let (rowStride, headStride, batchStride) = CUDATensorMaps.strides(m.strides(p), rows: rows, heads: heads,
                                                                                 batch: batch, headDim: headDim)
        else { return false }
        // Rows of one swizzle span (128, 64 or 32 bytes) per box row, the head dim's blocks of that span outside the rows.
        let span = Int(pyfa_cuda_prefill_wgmma_swizzle_bytes(Int32(headDim)))
        let blockElements = span / 2, blocks = headDim / blockElements
        let swizzle: Int32 = span == 128 ? 3 : span == 64 ? 2 : 1 /* CU_TENSOR_MAP_SWIZZLE_{128,64,32}B */
        let dims: [UInt64] = [UInt64(blockElements), rows, UInt64(blocks), heads, batch]
        let strides: [UInt64] = [rowStride, UInt64(span), headStride, batchStride]
        let box: [UInt32] = [UInt32(blockElements), m.boxRows, UInt32(blocks), 1, 1]
        let ones: [UInt32] = [1, 1, 1, 1, 1]
        // The driver writes a map only to a 64-byte aligned address: a stack scratch, then the block.
        return withUnsafeTemporaryAllocation(byteCount: 128, alignment: 64) { map -> Bool in
            let status = encodeTiled(map.baseAddress!, 1 /* UINT16 */, 5, UnsafeMutableRawPointer(bitPattern: UInt(address)),
                                     dims, strides, box, ones, 0 /* no interleave */, swizzle,
                                     2 /* L2 promotion 128 B */, 0 /* out-of-bounds elements read as zeros */)
            if status == 0 { dst.copyMemory(from: map.baseAddress!, byteCount: 128) }
            return status == 0
        }
    }
}
