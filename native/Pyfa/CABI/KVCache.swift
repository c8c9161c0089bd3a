import CPyfa
import PyfaShaderCommon

@_cdecl("pyfa_kv_append")
public func pyfa_kv_append_impl(_ encoder: OpaquePointer?, _ params: UnsafePointer<pyfa_kv_append_params>?,
                                _ src: OpaquePointer?, _ cache: OpaquePointer?) -> Int32 {
    abiCall {
        let e: CommandEncoder = try object(encoder, "encoder")
        try KVAppend.encode(e, try value(params, "params"), src: optionalObject(src, "src"),
                            cache: optionalObject(cache, "cache"))
    }
}

@_cdecl("pyfa_kv_append_plan_new")
public func pyfa_kv_append_plan_new_impl(_ out: UnsafeMutablePointer<OpaquePointer?>?, _ device: OpaquePointer?,
                                         _ desc: UnsafePointer<pyfa_kv_append_plan_desc>?) -> Int32 {
    newPlan(out, device, desc) { try KVAppendPlan(device: $0, desc: $1) }
}

@_cdecl("pyfa_kv_append_run")
public func pyfa_kv_append_run_impl(_ plan: OpaquePointer?, _ encoder: OpaquePointer?,
                                    _ args: UnsafePointer<pyfa_kv_append_run_args>?) -> Int32 {
    runPlan(plan, encoder, args, flags: \.flags) { (p: KVAppendPlan, e, a) in
        try p.run(e, k: TensorRef(a.k), v: TensorRef(a.v), kCache: TensorRef(a.k_cache), vCache: TensorRef(a.v_cache),
                  kScales: TensorRef(a.k_scales), vScales: TensorRef(a.v_scales), numTokens: a.num_tokens,
                  writePos: a.write_pos, state: TensorRef(a.state), ring: a.ring)
    }
}
