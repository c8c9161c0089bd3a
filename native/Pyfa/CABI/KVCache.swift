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
