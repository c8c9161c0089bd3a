import CPyfa
import PyfaShaderCommon

/// Dense KV-cache append: num_tokens rows per KV head written (and converted
/// to the cache's dtype) into ring slots of a cache: one dispatch per K or V, or one
/// for both where the backend's plan says so (appendsInOneDispatch).
/// Contract: pyfa_params.h, `pyfa_kv_append_params`.
public enum KVAppend {
    static let kernel = "kv_append"
    static let floatTypes: [DType] = attentionFloatTypes

    static func constants(src: DType, cache: DType) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_KV_APPEND_FC_COUNT, [
            PYFA_KV_APPEND_FC_SRC_DTYPE: src.rawValue,
            PYFA_KV_APPEND_FC_CACHE_DTYPE: cache.rawValue,
        ])
    }

    /// `position`: where the kernels read the slot of token 0; nil sends
    /// p.write_pos with the launch, a buffer is a cache's device state
    /// (pyfa_kv_state, whose first field kv_advance set).
    /// On backends that append in one dispatch (BackendPlan.appendsInOneDispatch):
    /// `v` (V's rows and cache, of src's and cache's dtypes) joins the dispatch, and with
    /// `advance` and `tickets` (u32 [1], zero) the dispatch advances the state at `position`
    /// itself, as kv_advance would, instead of reading the slot kv_advance left there.
    public static func encode(_ encoder: CommandEncoder, _ p: pyfa_kv_append_params, src: Buffer?,
                              cache: Buffer?, position: Buffer? = nil, v: (src: Buffer, cache: Buffer)? = nil,
                              advance: pyfa_kv_advance_params? = nil, tickets: Buffer? = nil) throws {
        try require(p.num_kv_heads > 0, "num_kv_heads: must be > 0")
        try require(p.head_dim > 0, "head_dim: must be > 0")
        try require(p.kv_capacity > 0, "kv_capacity: must be > 0")
        try require(p.kv_capacity <= UInt32(Int32.max),
                    "kv_capacity: \(p.kv_capacity) must be at most \(Int32.max) (slots are int32 positions)")
        try require(p.num_tokens > 0 && p.num_tokens <= p.kv_capacity,
                    "num_tokens: \(p.num_tokens) must be in 1...kv_capacity (\(p.kv_capacity)); one dispatch writes each slot at most once")
        try require(p.write_pos < p.kv_capacity, "write_pos: \(p.write_pos) must be < kv_capacity (\(p.kv_capacity))")
        let srcElements = try checkedProduct([Int(p.num_tokens), Int(p.num_kv_heads), Int(p.head_dim)], what: "src")
        let cacheElements = try checkedProduct([Int(p.sequence) + 1, Int(p.num_kv_heads), Int(p.kv_capacity),
                                                Int(p.head_dim)], what: "cache")
        let src = try Check.buffer(src, "src", dtypes: floatTypes, elements: srcElements, rows: true)
        let cache = try Check.buffer(cache, "cache", dtypes: floatTypes, elements: cacheElements, rows: true)
        try Check.sameDevice([src, cache], encoder.device)
        try Check.noOverlap(cache, "cache", inputs: [("src", src)])
        var args: [SlotArg] = [
            .at(PYFA_KV_APPEND_ARG_PARAMS, .value(p)),
            .at(PYFA_KV_APPEND_ARG_SRC, .buffer(src)),
            .at(PYFA_KV_APPEND_ARG_CACHE, .buffer(cache)),
            .at(PYFA_KV_APPEND_ARG_POSITION, positionArg(position, p.write_pos)),
        ]
        if v != nil || advance != nil || tickets != nil {
            try require(encoder.device.backend.plan.appendsInOneDispatch,
                        "v: this backend appends K and V in dispatches of their own")
        }
        if let v {
            let vs = try Check.buffer(v.src, "src_v", dtypes: [src.dtype], elements: srcElements, rows: true)
            let vc = try Check.buffer(v.cache, "cache_v", dtypes: [cache.dtype], elements: cacheElements, rows: true)
            try Check.sameDevice([vs, vc], encoder.device)
            try Check.noOverlap(vc, "cache_v", inputs: [("src", src), ("src_v", vs), ("cache", cache)])
            try Check.noOverlap(cache, "cache", inputs: [("src_v", vs)])
            args += [.at(PYFA_KV_APPEND_ARG_SRC_V, .buffer(vs)), .at(PYFA_KV_APPEND_ARG_CACHE_V, .buffer(vc))]
        }
        args += try advanceArgs(advance, tickets: tickets, state: position, capacity: p.kv_capacity,
                                numTokens: p.num_tokens, slots: (PYFA_KV_APPEND_ARG_ADVANCE, PYFA_KV_APPEND_ARG_TICKETS))
        let pipeline = try encoder.device.registry.pipeline(kernel, constants: constants(src: src.dtype,
                                                                                        cache: cache.dtype))
        encoder.setOpKind(.other)
        try encoder.dispatch(pipeline, args: args, grid: (p.num_tokens, p.num_kv_heads, v == nil ? 1 : 2),
                             threads: (encoder.device.backend.plan.kvAppend(headDim: p.head_dim), 1, 1))
    }

    /// The arguments of an append dispatch that advances the cache's `state` itself (none
    /// without `advance` and `tickets`), checked: all three or none, `advance` describing
    /// this append (kv_append's and hadamard_quantize_kv's rule; `slots`: their ADVANCE and
    /// TICKETS argument slots).
    static func advanceArgs(_ advance: pyfa_kv_advance_params?, tickets: Buffer?, state: Buffer?, capacity: UInt32,
                            numTokens: UInt32, slots: (advance: Int32, tickets: Int32)) throws -> [SlotArg] {
        guard advance != nil || tickets != nil else { return [] }
        guard let advance, let tickets, let state else {
            throw PyfaError.invalid("advance: needs tickets and a state as the position (all three or none)")
        }
        try require(advance.kv_capacity == capacity && advance.ring <= 1 && advance.num_tokens >= numTokens,
                    "advance: must describe this append's cache (kv_capacity, ring 0 or 1, num_tokens)")
        let t = try Check.buffer(tickets, "tickets", dtypes: [.u32], elements: 1)
        _ = try Check.buffer(state, "state", dtypes: [.i32], elements: 4)
        return [.at(slots.advance, .value(advance)), .at(slots.tickets, .buffer(t))]
    }

    /// The position argument of an append: the state's write_pos, or the
    /// host slot as launch bytes.
    static func positionArg(_ state: Buffer?, _ writePos: UInt32) -> KernelArg {
        if let state { return .buffer(state, offset: 0) }
        return .value(Int32(bitPattern: writePos))
    }
}

/// Moves a cache's device-resident length (pyfa_kv_state) past an append,
/// before the append's kernels read its write_pos. Contract: pyfa_params.h,
/// `pyfa_kv_advance_params`.
public enum KVAdvance {
    static let kernel = "kv_advance"
    static func constants() throws -> FunctionConstants { try FunctionConstants(count: 0, [:]) }

    public static func encode(_ encoder: CommandEncoder, _ p: pyfa_kv_advance_params, state: Buffer?) throws {
        try require(p.kv_capacity > 0 && p.kv_capacity <= UInt32(Int32.max),
                    "kv_capacity: \(p.kv_capacity) must be in 1...\(Int32.max)")
        try require(p.num_tokens > 0, "num_tokens: must be > 0")
        try require(p.ring <= 1, "ring: \(p.ring) must be 0 or 1")
        try require(p.reserved == 0, "reserved: must be 0")
        let state = try Check.buffer(state, "state", dtypes: [.i32], elements: 4)
        try Check.sameDevice([state], encoder.device)
        let pipeline = try encoder.device.registry.pipeline(kernel, constants: constants())
        encoder.setOpKind(.other)
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_KV_ADVANCE_ARG_PARAMS, .value(p)),
            .at(PYFA_KV_ADVANCE_ARG_STATE, .buffer(state)),
        ], grid: (1, 1, 1), threads: (encoder.device.backend.plan.kvAppend(headDim: 1), 1, 1))
    }
}
