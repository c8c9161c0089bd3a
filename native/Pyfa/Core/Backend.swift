import CPyfa

/// A compiled kernel specialisation, as a backend holds it.
public protocol Pipeline: AnyObject {
    var name: String { get }
}

/// One kernel argument slot.
public enum KernelArg {
    case buffer(Buffer, offset: Int)
    case bytes([UInt8])

    public static func buffer(_ b: Buffer) -> KernelArg { .buffer(b, offset: 0) }

    /// The bytes of a POD value (a parameter struct), passed inline.
    public static func value<T>(_ v: T) -> KernelArg {
        withUnsafeBytes(of: v) { .bytes(Array($0)) }
    }
}

/// A kernel argument and the slot it binds. A struct, not a tuple: arrays of
/// it are copied and freed on every dispatch, and a struct's value witnesses
/// are generated for it where a tuple's go through the runtime's generic ones.
public struct SlotArg {
    public var slot: Int
    public var arg: KernelArg

    public init(slot: Int, arg: KernelArg) {
        self.slot = slot
        self.arg = arg
    }

    /// `arg` at slot `slot` (a PYFA_*_ARG_* constant).
    public static func at<I: BinaryInteger>(_ slot: I, _ arg: KernelArg) -> SlotArg { SlotArg(slot: Int(slot), arg: arg) }
}

/// What an encoded dispatch is, for tools that reorder or profile.
public enum OpKind: Sendable {
    case attention, reduce, quantize, transform, other
}

/// A recorded dispatch: a pipeline, its arguments by slot and its geometry.
public struct EncodedDispatch {
    public var pipeline: Pipeline
    public var args: [SlotArg]
    public var grid: (UInt32, UInt32, UInt32)
    public var threads: (UInt32, UInt32, UInt32)
    public var threadgroupMemory: Int
    public var opKind: OpKind
    /// Threadgroups the backend may run as one cluster along each grid axis,
    /// co-scheduled (CUDA's thread-block clusters, sm_90 and later); (1, 1, 1):
    /// none. A backend without clusters runs them apart, and a kernel that
    /// asks for one reads its cluster's shape and is correct either way.
    public var cluster: (UInt32, UInt32, UInt32) = (1, 1, 1)
}

public enum EncodedCommand {
    case dispatch(EncodedDispatch)
    /// Later dispatches see the writes of earlier ones.
    case barrier
}

/// Geometry a backend picks for decode: workgroups per sequence, what one
/// workgroup needs, and the kernel variant (PYFA_VEC_VARIANT_*) that runs it.
public struct VecGeometry {
    public var nwg: UInt32
    public var threads: UInt32
    public var threadgroupMemory: Int
    public var variant: Int32 = PYFA_VEC_VARIANT_PORTABLE
}

/// Geometry a backend picks for prefill: the (block_q, block_k) tile, which
/// also fixes the blk layout, and what one threadgroup needs.
public struct PrefillGeometry {
    public var blockQ: UInt32
    public var blockK: UInt32
    public var threads: UInt32
    public var threadgroupMemory: Int
    /// Query heads of one KV head whose threadgroups (of one query tile) the
    /// backend runs as one cluster, co-scheduled: 1 (none) or 2 (the CUDA
    /// kernel's launch order takes pairs). The dispatch asks for it where the
    /// query heads per KV head are a multiple.
    public var clusterHeads: UInt32 = 1
}

/// The per-backend choices dispatchers ask for. Dispatchers stay
/// backend-neutral; a backend answers these from its own limits.
public protocol BackendPlan {
    /// Decode geometry for a K/V cache of dtype kvDType.
    func flashAttnVec(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry
    /// Threads and threadgroup memory of the decode reduce pass.
    func attnReduce(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int)
    /// Threads of a kv_append workgroup (one cache row of headDim elements;
    /// no threadgroup memory).
    func kvAppend(headDim: UInt32) -> UInt32
    /// Prefill tile shape and threadgroup needs in KV mode kvMode
    /// (PYFA_PREFILL_KV_RECT, _VARLEN or _PAGED); depends on head_dim, the I/O
    /// dtype and the mode only, so a blk buffer built from it (rectangular
    /// mode, the one that takes masks) matches every dispatch.
    func flashAttnPrefill(headDim: UInt32, dtype: DType, kvMode: Int32) -> PrefillGeometry
    /// A key split of a rectangular prefill's blocks (flash_attn_prefill_params.h,
    /// pyfa_prefill_split), or nil to run every block whole. `p` with its tile fields filled
    /// (FlashAttnPrefill.plan) and `geometry` that tile's; `masked`: a mask is bound.
    func prefillSplit(_ p: pyfa_flash_attn_prefill_params, dtype: DType, geometry: PrefillGeometry,
                      masked: Bool) -> pyfa_prefill_split?
    /// Persistent blocks for a rectangular prefill that runs whole (flash_attn_prefill_params.h,
    /// pyfa_prefill_persist; FlashAttnPrefill.persistentKernel): the launch's blocks and their
    /// threadgroup memory, or nil to launch the grid. `p` with its tile fields filled and
    /// `geometry` that tile's; `masked`: a mask is bound.
    func prefillPersistent(_ p: pyfa_flash_attn_prefill_params, dtype: DType, geometry: PrefillGeometry,
                           masked: Bool) -> (blocks: UInt32, threadgroupMemory: Int)?
    /// Whether FlashAttnPrefill.persistentKernel serves head_dim at the I/O dtype (the
    /// specialisations a compile check covers).
    func prefillPersistentServes(headDim: UInt32, dtype: DType) -> Bool
    /// Threads and threadgroup memory of the blk pre-pass and of merge_attention_states.
    func prefillAux(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int)
    /// Threads and threadgroup memory of the TurboQuant one-row-per-workgroup
    /// kernels (hadamard_quantize_kv, tq_dequantize_kv, the fwht family).
    func turboquantRows(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int)
    /// Threads and threadgroup memory of flash_attn_vec_reduce_tq_hb_undo.
    func turboquantReduceUndo(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int)
    /// Decode geometry of flash_attn_vec_tq (nwg, threads, threadgroup memory).
    func flashAttnVecTQ(_ p: pyfa_flash_attn_vec_tq_params, maxKvLen: UInt32) -> VecGeometry
    /// Decode geometry of flash_attn_vec over paged pools (paged_kv_params.h);
    /// the grid stays (nwg, num_kv_heads, batch).
    func flashAttnVecPaged(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry
    func wrapAlignment(dtype: DType, data: Bool) -> Int
    /// Whether a split decode of `nwg` workgroups given tickets lets its last workgroup of each
    /// row merge the row (flash_attn_vec's DIRECT_OUT 2: one dispatch instead of the decode
    /// and its reduce).
    func lastWorkgroupMerges(nwg: UInt32) -> Bool
    /// Whether kv_append and hadamard_quantize_kv take K and V in one dispatch (grid z = 2),
    /// advancing a cache's state itself when given tickets (pyfa_params.h, kv_append;
    /// turboquant_params.h, hadamard_quantize_kv).
    var appendsInOneDispatch: Bool { get }
    /// Whether flash_attn_vec_tq of these params rotates q itself (turboquant_params.h,
    /// q_in): the op binds its q and records no fwht_sign_premult.
    func turboquantRotatesQ(_ p: pyfa_flash_attn_vec_tq_params) -> Bool
}

extension BackendPlan {
    /// The alignment (bytes) a caller's memory of `dtype` must have to be
    /// wrapped: `data` for an op's rows (caches, queries, outputs, codes),
    /// which kernels may copy in wide pieces; otherwise values read one at a
    /// time (lengths, tables, masks, scales). 1: any address.
    public func wrapAlignment(dtype: DType, data: Bool) -> Int { 1 }

    /// Prefill blocks run whole unless a backend splits them.
    public func prefillSplit(_ p: pyfa_flash_attn_prefill_params, dtype: DType, geometry: PrefillGeometry,
                             masked: Bool) -> pyfa_prefill_split? { nil }

    /// Prefill launches its grid of blocks unless a backend runs them persistent.
    public func prefillPersistent(_ p: pyfa_flash_attn_prefill_params, dtype: DType, geometry: PrefillGeometry,
                                  masked: Bool) -> (blocks: UInt32, threadgroupMemory: Int)? { nil }
    public func prefillPersistentServes(headDim: UInt32, dtype: DType) -> Bool { false }

    /// Split decodes end with the reduce dispatch unless a backend says otherwise.
    public func lastWorkgroupMerges(nwg: UInt32) -> Bool { false }

    /// Appends are a dispatch for K and one for V (after kv_advance) unless a backend says otherwise.
    public var appendsInOneDispatch: Bool { false }

    /// A TurboQuant decode reads q_rot, rotated by the op's fwht_sign_premult, unless a backend says otherwise.
    public func turboquantRotatesQ(_ p: pyfa_flash_attn_vec_tq_params) -> Bool { false }

    /// Backends whose TurboQuant decode runs the dense decode's body take its geometry.
    public func flashAttnVecTQ(_ p: pyfa_flash_attn_vec_tq_params, maxKvLen: UInt32) -> VecGeometry {
        flashAttnVec(p.attn, kvDType: .u8, maxKvLen: maxKvLen)
    }

    /// Backends whose decode walks a pool as it walks a dense cache take the dense geometry.
    public func flashAttnVecPaged(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        flashAttnVec(p, kvDType: kvDType, maxKvLen: maxKvLen)
    }
}

/// Runs submitted commands in order; one per encoder.
public protocol CommandQueue: AnyObject {
    func submit(_ commands: [EncodedCommand]) throws
    func wait() throws
    func useStream(_ handle: UInt64) throws
    /// Seconds the device spent executing what the last `wait` completed, or
    /// nil where the backend has no device clock.
    var lastDeviceSeconds: Double? { get }
    /// Whether submissions are being captured into a graph instead of run.
    var isCapturing: Bool { get }
}

/// A backend: allocates, compiles and runs. Adding one adds a folder under
/// Backends/ and a case in Device.open; nothing in Ops/ changes.
public protocol Backend: AnyObject {
    var name: String { get }
    var info: pyfa_device_info { get }
    var plan: BackendPlan { get }
    func allocate(bytes: Int, storage: Storage) throws -> BufferMemory
    /// Memory the caller owns (host memory on the CPU; a device address on a GPU).
    func wrap(address: UInt64, bytes: Int) throws -> BufferMemory
    func compile(name: String, constants: FunctionConstants) throws -> Pipeline
    func makeQueue() throws -> CommandQueue
}

extension CommandQueue {
    public var lastDeviceSeconds: Double? { nil }
    public var isCapturing: Bool { false }

    /// Binds the queue to a caller's stream (a CUDA stream handle; 0 = the
    /// queue's own). Backends without streams refuse.
    public func useStream(_ handle: UInt64) throws {
        throw PyfaError.unsupported("stream: this backend has no streams")
    }
}
