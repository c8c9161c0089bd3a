/*
 * pyfa.h: the C ABI of libpyfa. Python (cffi, ABI mode) and Swift apps call
 * only what is declared here. Declarations only: the Python loader strips the
 * preprocessor lines and reads the rest with cffi's cdef.
 *
 * Conventions
 *  - Every call that can fail returns an int status (PYFA_OK = 0). On failure
 *    pyfa_last_error() returns a message for the calling thread, valid until
 *    that thread's next pyfa call. Nothing here aborts the process.
 *  - Handles are opaque; each pyfa_X_new has a pyfa_X_free. Results come back
 *    through a leading out-pointer. A handle is an id, not an address: it is
 *    checked on every use, and a NULL, freed, unknown or other-type handle
 *    gives PYFA_ERR_INVALID_ARGUMENT naming the argument (the free functions
 *    ignore it and leave a message in pyfa_last_error; the buffer getters
 *    return NULL / 0 / -1). Ids are never reused within a process.
 *  - Parameter structs come from pyfa_params.h, shared with the kernels.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>
#include "pyfa_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PYFA_ABI_VERSION 7

/* Status codes. */
#define PYFA_OK 0
#define PYFA_ERR_INVALID_ARGUMENT 1 /* an argument breaks a documented rule */
#define PYFA_ERR_UNSUPPORTED 2      /* valid, but not implemented for this input/backend */
#define PYFA_ERR_OUT_OF_MEMORY 3    /* an allocation failed */
#define PYFA_ERR_BACKEND_UNAVAILABLE 4 /* the backend is not compiled in or has no device */
#define PYFA_ERR_COMPILE 5          /* a kernel failed to compile; the message holds the log */
#define PYFA_ERR_EXECUTION 6        /* a kernel faulted or the device reported an error */
#define PYFA_ERR_INTERNAL 7         /* a bug in pyfa */

/* Element types (values from pyfa_params.h). */
typedef int32_t pyfa_dtype;

/* Buffer storage: shared = CPU-visible contents; private = device-only. */
#define PYFA_STORAGE_SHARED 0
#define PYFA_STORAGE_PRIVATE 1
typedef int32_t pyfa_storage;

#define PYFA_MAX_DIMS 8

typedef struct pyfa_device pyfa_device;
typedef struct pyfa_buffer pyfa_buffer;
typedef struct pyfa_encoder pyfa_encoder;

typedef struct pyfa_device_info {
    char backend[16];                  /* "cpu", "cuda", "metal" */
    char name[128];                    /* human-readable device name */
    uint32_t compute_units;            /* CPU threads / SMs / GPU cores */
    uint32_t max_threads_per_threadgroup;
    uint64_t max_threadgroup_memory;   /* bytes */
    uint64_t memory_bytes;             /* device memory (0 if unknown) */
    uint32_t host_visible;             /* 1: shared buffers' contents are the memory kernels use (no copies) */
    uint32_t simd_width;               /* threads that run in lockstep (1 on the CPU) */
    uint32_t is_gpu;                   /* 1: a GPU runs the kernels; 0: the CPU (CPU backend, Metal executor) */
    uint32_t reserved;                 /* zero */
} pyfa_device_info;

/* ---- library ---- */
uint32_t pyfa_abi_version(void);
const char *pyfa_last_error(void);
/* Comma-separated names of the backends compiled into this library, e.g. "cpu,cuda". */
const char *pyfa_backends(void);
/* What the kernels are built for, as comma-separated values: "head_dims",
 * "tq_head_dims", "tq_bits" or "attn_dtypes" (dtype codes); NULL if unknown. */
const char *pyfa_supported(const char *what);
/* sizeof of a named parameter struct as the library was compiled, 0 if unknown. */
size_t pyfa_struct_size(const char *name);
/* A further place the CUDA backend looks for NVRTC, after $PYFA_NVRTC,
 * libnvrtc.so.13 and libnvrtc.so.12 (Python passes the nvidia-cuda-nvrtc
 * wheel's copy); NULL clears it. */
int pyfa_set_nvrtc_path(const char *path);

/* ---- devices ---- */
/* backend: "auto" (best available), "cpu", "cuda", "metal". */
int pyfa_device_new(pyfa_device **out, const char *backend);
void pyfa_device_free(pyfa_device *device);
int pyfa_device_info_get(pyfa_device *device, pyfa_device_info *out);

/* ---- buffers ---- */
int pyfa_buffer_new(pyfa_buffer **out, pyfa_device *device, pyfa_dtype dtype, uint32_t ndim,
                    const int64_t *shape, pyfa_storage storage);
/* Wraps caller memory: host memory on host-visible backends (CPU, Metal),
 * device memory on CUDA (checked with the driver: host memory is refused).
 * The memory must stay valid and unmoved until the buffer is freed and every
 * encoder using it has finished. nbytes must cover the shape. On the CPU
 * backend the address cannot be checked: it is the caller's promise (a wrong
 * one crashes, as any C pointer would); the Python API only passes it memory
 * it owns (numpy arrays), and Device.wrap_device refuses host-visible devices. */
int pyfa_buffer_wrap(pyfa_buffer **out, pyfa_device *device, void *data, uint64_t nbytes,
                     pyfa_dtype dtype, uint32_t ndim, const int64_t *shape);
void pyfa_buffer_free(pyfa_buffer *buffer);
/* CPU-visible contents of shared storage; NULL for private storage. */
void *pyfa_buffer_contents(pyfa_buffer *buffer);
uint64_t pyfa_buffer_nbytes(pyfa_buffer *buffer);
/* The address kernels use for the buffer's first byte (a device address on
 * CUDA, a host address on the CPU and Metal backends): what a plan run takes
 * as pyfa_tensor.address. 0 for a bad handle. */
uint64_t pyfa_buffer_address(pyfa_buffer *buffer);
pyfa_dtype pyfa_buffer_dtype(pyfa_buffer *buffer);
/* Copies between host memory and a buffer (any storage). */
int pyfa_buffer_write(pyfa_buffer *buffer, uint64_t offset, const void *src, uint64_t nbytes);
int pyfa_buffer_read(pyfa_buffer *buffer, uint64_t offset, void *dst, uint64_t nbytes);

/* ---- encoders: record dispatches, commit, wait ---- */
int pyfa_encoder_new(pyfa_encoder **out, pyfa_device *device);
void pyfa_encoder_free(pyfa_encoder *encoder);
/* Submits everything recorded so far. */
int pyfa_encoder_commit(pyfa_encoder *encoder);
/* Drops what was recorded and not committed (after a failed call), so a
 * reused encoder starts empty. */
int pyfa_encoder_reset(pyfa_encoder *encoder);
/* Blocks until submitted work finishes; reports execution errors. */
int pyfa_encoder_wait(pyfa_encoder *encoder);
/* Seconds the device spent executing the submissions the last wait
 * completed, as the device measures it (Metal: each command buffer's
 * gpuEndTime - gpuStartTime, summed). PYFA_ERR_UNSUPPORTED where the backend
 * has no such clock (CPU, CUDA: time those with host or CUDA events). */
int pyfa_encoder_device_seconds(pyfa_encoder *encoder, double *seconds);

/* ---- decode: flash_attn_vec (+ reduce) ----
 * Contract in pyfa_params.h. params->nwg == 0 asks the backend's plan for a
 * cache of dtype kv_dtype; the chosen value is written back. tmp may be NULL
 * when the plan picks nwg == 1.
 * out [batch, num_heads, head_dim]: f32, f16 or bf16, its buffer's dtype
 * chooses (accumulation is f32; the result is rounded once, to nearest even).
 * lse (may be NULL): f32 [batch * num_heads], each row's natural-log
 * log-sum-exp of its scores (scale and softcap applied), -inf for a row with
 * no visible key (whose out is zeros); the convention of prefill's lse, so
 * pyfa_merge_attention_states combines decodes over disjoint caches. */
int pyfa_flash_attn_vec_plan(pyfa_device *device, pyfa_flash_attn_vec_params *params, pyfa_dtype kv_dtype,
                             uint32_t max_kv_len, uint64_t *tmp_bytes);
int pyfa_flash_attn_vec(pyfa_encoder *encoder, const pyfa_flash_attn_vec_params *params,
                        pyfa_buffer *q, pyfa_buffer *k, pyfa_buffer *v, pyfa_buffer *kv_len,
                        pyfa_buffer *ring_start, pyfa_buffer *tmp, pyfa_buffer *out, pyfa_buffer *lse);

/* ---- dense KV cache: kv_append (contract in pyfa_params.h) ----
 * Writes src [num_tokens, num_kv_heads, head_dim] into cache
 * [batch, num_kv_heads, kv_capacity, head_dim] at slots (write_pos + i) mod
 * kv_capacity of sequence params->sequence, converting to the cache's dtype,
 * in one dispatch. Call it once for K and once for V. */
int pyfa_kv_append(pyfa_encoder *encoder, const pyfa_kv_append_params *params, pyfa_buffer *src,
                   pyfa_buffer *cache);

/* ---- prefill: flash_attn_prefill (+ blk pre-pass), merge_attention_states ----
 * Contracts in flash_attn_prefill_params.h.
 * _plan fills params->block_q/block_k (when both are 0; otherwise checks them),
 * num_q_blocks and num_k_blocks for I/O dtype `dtype`, and the bytes a blk
 * buffer needs for params->mask_strides (one byte per tile per mask plane).
 * _blk encodes the pre-pass for the prefill dispatch of I/O dtype `dtype`,
 * followed by a barrier (at most INT32_MAX tiles, num_q_blocks * num_k_blocks);
 * blk requires a mask in pyfa_flash_attn_prefill.
 * mask, blk and lse may be NULL. out is in the I/O dtype, or f32 with f16 /
 * bf16 I/O (its buffer's dtype chooses). */
int pyfa_flash_attn_prefill_plan(pyfa_device *device, pyfa_flash_attn_prefill_params *params, pyfa_dtype dtype,
                                 uint64_t *blk_bytes);
int pyfa_flash_attn_prefill_blk(pyfa_encoder *encoder, const pyfa_flash_attn_prefill_params *params,
                                pyfa_dtype dtype, pyfa_buffer *mask, pyfa_buffer *blk);
int pyfa_flash_attn_prefill(pyfa_encoder *encoder, const pyfa_flash_attn_prefill_params *params, pyfa_buffer *q,
                            pyfa_buffer *k, pyfa_buffer *v, pyfa_buffer *mask, pyfa_buffer *blk, pyfa_buffer *out,
                            pyfa_buffer *lse);
/* lse_out may be NULL; out is in o_a's dtype or f32 (its buffer's dtype chooses). */
int pyfa_merge_attention_states(pyfa_encoder *encoder, const pyfa_merge_attn_params *params, pyfa_buffer *o_a,
                                pyfa_buffer *lse_a, pyfa_buffer *o_b, pyfa_buffer *lse_b, pyfa_buffer *out,
                                pyfa_buffer *lse_out);
/* ---- packed prefill: varlen and paged (flash_attn_prefill's KV modes) ----
 * Contract in flash_attn_prefill_params.h ("Packed sequences") and
 * paged_kv_params.h. params->batch is the number of sequences, q_len /
 * kv_len the longest sequence's; head and row strides of q, k, v, out as in
 * the rectangular op (batch strides not read); mask_strides and q_offset 0
 * (masks are refused). Metadata buffers are int32; host-visible values are
 * checked (cu_seqlens from 0, non-decreasing, ending at packed->total_q /
 * total_k; q_len_b <= kv_len_b; block_table entries in range), device values
 * clamped. The launch tiles every sequence as the longest: query tiles of
 * q_len x num_heads x batch must be at most 2^32 - 1. lse (may be NULL): f32
 * [num_heads, total_q]. */
int pyfa_flash_attn_prefill_varlen(pyfa_encoder *encoder, const pyfa_flash_attn_prefill_params *params,
                                   const pyfa_prefill_packed *packed, pyfa_buffer *q, pyfa_buffer *k, pyfa_buffer *v,
                                   pyfa_buffer *cu_seqlens_q, pyfa_buffer *cu_seqlens_k, pyfa_buffer *out,
                                   pyfa_buffer *lse);
/* k_pages / v_pages: pools [num_pages, page_size, num_kv_heads, head_dim] (NHD)
 * or [num_pages, num_kv_heads, page_size, head_dim] (HND), contiguous;
 * kv_len [batch] includes the new rows (appended before the call). */
int pyfa_flash_attn_prefill_paged(pyfa_encoder *encoder, const pyfa_flash_attn_prefill_params *params,
                                  const pyfa_prefill_packed *packed, const pyfa_kv_pages *pages, pyfa_buffer *q,
                                  pyfa_buffer *k_pages, pyfa_buffer *v_pages, pyfa_buffer *cu_seqlens_q,
                                  pyfa_buffer *kv_len, pyfa_buffer *block_table, pyfa_buffer *out, pyfa_buffer *lse);
/* ---- TurboQuant compressed KV cache (codec and contracts: turboquant_params.h) ----
 * Every encode call records dispatches on the encoder; commit + wait run them. */
/* The f32 Lloyd-Max codebook of N(0,1) at bits in {2, 3, 4, 8}: count = 2^bits
 * sorted centroids, computed by the library (Newton-accelerated Lloyd). */
int pyfa_turboquant_codebook(uint32_t bits, float *centroids, uint32_t count);
/* Encodes src [num_tokens, num_kv_heads, head_dim] into codes/scales slots
 * (write_pos + i) mod kv_capacity, in one dispatch. */
int pyfa_hadamard_quantize_kv(pyfa_encoder *encoder, const pyfa_tq_quantize_params *params, pyfa_buffer *src,
                              pyfa_buffer *codes, pyfa_buffer *scales);
/* Decodes num_tokens slots from first_slot (ring order) into out [num_tokens, num_kv_heads, head_dim] f32,
 * original domain. */
int pyfa_tq_dequantize_kv(pyfa_encoder *encoder, const pyfa_tq_dequantize_params *params, pyfa_buffer *codes,
                          pyfa_buffer *scales, pyfa_buffer *out);
/* fwht / fwht_sign_premult / fwht_sign_undo by params->transform; dst is f32 and may equal an f32 src. */
int pyfa_fwht(pyfa_encoder *encoder, const pyfa_tq_fwht_params *params, pyfa_buffer *src, pyfa_buffer *dst);
/* Like pyfa_flash_attn_vec_plan; tmp_bytes is never 0 (tmp also holds the rotated q). */
int pyfa_flash_attn_vec_tq_plan(pyfa_device *device, pyfa_flash_attn_vec_tq_params *params, uint32_t max_kv_len,
                                uint64_t *tmp_bytes);
/* Decode over codes: q [batch, num_heads, head_dim] (f32/f16/bf16, original domain) -> out (f32, f16 or
 * bf16: its buffer's dtype chooses), original domain. Runs premult -> flash_attn_vec_tq -> reduce (+) undo,
 * fused when params->fused. lse (may be NULL): as pyfa_flash_attn_vec's; the rotation is orthogonal, so the
 * rotated-domain scores it sums are the original-domain ones. */
int pyfa_flash_attn_vec_tq(pyfa_encoder *encoder, const pyfa_flash_attn_vec_tq_params *params, pyfa_buffer *q,
                           pyfa_buffer *k_codes, pyfa_buffer *k_scales, pyfa_buffer *v_codes, pyfa_buffer *v_scales,
                           pyfa_buffer *kv_len, pyfa_buffer *ring_start, pyfa_buffer *tmp, pyfa_buffer *out,
                           pyfa_buffer *lse);
/* ---- paged appends (contracts in paged_kv_params.h) ----
 * K and V rows of a batch of tokens into a pool pair in one dispatch, token
 * i to flat slot slot_mapping[i] (int32 [num_tokens]; negative: padding,
 * nothing written). Where the library can read slot_mapping (host-visible
 * memory, shared buffers) it refuses a slot outside the pool and two tokens
 * naming one slot; device values outside the pool write nothing, and the
 * last writer of a duplicated slot is unspecified. Call it with the
 * encoder's stream bound to order it with a caller's work (no wait). */
int pyfa_kv_append_paged(pyfa_encoder *encoder, const pyfa_kv_append_paged_params *params, pyfa_buffer *src_k,
                         pyfa_buffer *src_v, pyfa_buffer *k_pages, pyfa_buffer *v_pages, pyfa_buffer *slot_mapping);
/* Encodes as pyfa_hadamard_quantize_kv (K stream with k_bits, V stream with
 * v_bits): the codes and scales of a row are the same bytes. */
int pyfa_tq_quantize_paged(pyfa_encoder *encoder, const pyfa_tq_quantize_paged_params *params, pyfa_buffer *src_k,
                           pyfa_buffer *src_v, pyfa_buffer *k_codes, pyfa_buffer *k_scales, pyfa_buffer *v_codes,
                           pyfa_buffer *v_scales, pyfa_buffer *slot_mapping);

/* ---- plans: an op prepared once for its shapes and dtypes, run many times ----
 * A plan checks every option and shape rule, picks the geometry (nwg, tiles)
 * and kernels, and owns a workspace for the partial results. A run checks
 * the memory it is given, records the op's dispatches on an encoder (commit
 * submits them; with a stream bound, on that stream, without waiting) and
 * allocates nothing in steady state.
 *
 * Memory is passed as pyfa_tensor: the address kernels use (a device
 * address on CUDA, checked with the driver to be device memory covering
 * nbytes; a host address on the CPU and Metal backends, the caller's promise
 * as for pyfa_buffer_wrap) and its size. A run may change the memory, the
 * per-sequence values and kv_capacity (the row stride of the cache) from run
 * to run; everything else is the plan's.
 *
 * Per-sequence values (kv_len, ring_start) are pyfa_seq_values: either host
 * values (`host` non-NULL: `batch` int32 values, read and checked during the
 * run and sent with the launch, so a CUDA graph captures them by value) or
 * device int32 memory read when the kernels run (`host` NULL; the kernels
 * clamp what they read as pyfa_params.h says, so a graph replay sees the
 * values the caller wrote before it).
 *
 * Workspace: a run with workspace.address == 0 uses the plan's own. Runs on
 * different streams at the same time need a workspace each (pass one of
 * pyfa_plan_workspace_bytes). Such a run also leaves out what counts on the
 * plan's own tickets, which one run at a time uses: a split decode ends with
 * its reduce dispatch instead of merging in its last workgroups, and a
 * prefill runs its blocks whole instead of split over their keys. A plan's own workspace that a CUDA graph
 * captured stays allocated after pyfa_plan_free until the process exits,
 * since the graph may replay later. */
typedef struct pyfa_plan pyfa_plan;

/* Run flag: finish the encoder after recording (pyfa_encoder_finish), which
 * saves a synchronous caller one more call. */
#define PYFA_RUN_FINISH 1

typedef struct pyfa_tensor {
    uint64_t address; /* 0 = absent (optional arguments) */
    uint64_t nbytes;
} pyfa_tensor;

typedef struct pyfa_seq_values {
    const int32_t *host; /* batch values on the host, or NULL to use `device` */
    pyfa_tensor device;  /* int32 [batch] the kernels read */
} pyfa_seq_values;

/* Decode over a dense cache (pyfa_flash_attn_vec). attn.kv_capacity is the
 * capacity the plan is checked with (runs may pass another); attn.nwg 0 asks
 * the backend for a split sized for max_kv_len (0 = kv_capacity). */
typedef struct pyfa_decode_plan_desc {
    pyfa_flash_attn_vec_params attn;
    pyfa_dtype q_dtype;
    pyfa_dtype kv_dtype;
    pyfa_dtype out_dtype;
    uint32_t max_kv_len;
    uint32_t return_lse;   /* 1: runs write lse [batch, num_heads] f32 (natural log; -inf: no key) */
    uint32_t reserved;
} pyfa_decode_plan_desc;

typedef struct pyfa_decode_run_args {
    pyfa_tensor q;         /* [batch, num_heads, head_dim] */
    pyfa_tensor k_cache;   /* [batch, num_kv_heads, kv_capacity, head_dim] */
    pyfa_tensor v_cache;
    pyfa_tensor out;       /* [batch, num_heads, head_dim] of out_dtype */
    pyfa_tensor lse;       /* [batch, num_heads] f32 when planned with return_lse */
    pyfa_tensor workspace; /* optional */
    pyfa_seq_values kv_len;
    pyfa_seq_values ring_start;
    uint32_t kv_capacity;  /* 0 = the plan's */
    uint32_t flags;        /* PYFA_RUN_FINISH, or 0 */
} pyfa_decode_run_args;

/* Decode over a TurboQuant cache (pyfa_flash_attn_vec_tq); as above. */
typedef struct pyfa_tq_decode_plan_desc {
    pyfa_flash_attn_vec_tq_params tq;
    pyfa_dtype q_dtype;
    pyfa_dtype out_dtype;
    uint32_t max_kv_len;
    uint32_t return_lse;
} pyfa_tq_decode_plan_desc;

typedef struct pyfa_tq_decode_run_args {
    pyfa_tensor q;
    pyfa_tensor k_codes, k_scales, v_codes, v_scales;
    pyfa_tensor out;
    pyfa_tensor lse;
    pyfa_tensor workspace; /* optional */
    pyfa_seq_values kv_len;
    pyfa_seq_values ring_start;
    uint32_t kv_capacity;  /* 0 = the plan's */
    uint32_t flags;        /* PYFA_RUN_FINISH, or 0 */
} pyfa_tq_decode_run_args;

/* Prefill (pyfa_flash_attn_prefill, after the blk pre-pass when use_blk):
 * attn's shapes, strides and options are the plan's (block_q / block_k 0:
 * the backend's tile); mask_dtype is -1 without a mask, PYFA_DTYPE_U8 for a
 * boolean mask or `dtype` for an additive one. The workspace holds blk, or
 * where the backend splits the blocks' keys (CUDA: flash_attn_prefill_params.h,
 * pyfa_prefill_split) the parts' states; those parts count on tickets of the
 * plan's own, so a run given its own workspace runs its blocks whole. */
typedef struct pyfa_prefill_plan_desc {
    pyfa_flash_attn_prefill_params attn;
    pyfa_dtype dtype;      /* of q, k and v */
    pyfa_dtype out_dtype;  /* dtype or f32 */
    pyfa_dtype mask_dtype;
    uint32_t use_blk;
    uint32_t return_lse;
    uint32_t reserved;
} pyfa_prefill_plan_desc;

typedef struct pyfa_prefill_run_args {
    pyfa_tensor q, k, v;
    pyfa_tensor mask;      /* when planned with one */
    pyfa_tensor out;
    pyfa_tensor lse;       /* [batch, num_heads, q_len] f32 when planned with return_lse */
    pyfa_tensor workspace; /* optional */
    uint32_t flags;        /* PYFA_RUN_FINISH, or 0 */
    uint32_t reserved;
} pyfa_prefill_run_args;

/* Packed prefill (pyfa_flash_attn_prefill_varlen / _paged), one plan for
 * either kv_mode: attn and pages as those calls take them (pages zero for
 * varlen); a run gives the memory and the packed lengths. */
typedef struct pyfa_varlen_prefill_plan_desc {
    pyfa_flash_attn_prefill_params attn;
    pyfa_kv_pages pages;
    uint32_t kv_mode;      /* PYFA_PREFILL_KV_VARLEN or PYFA_PREFILL_KV_PAGED */
    pyfa_dtype dtype;      /* of q, k and v (or the pools) */
    pyfa_dtype out_dtype;  /* dtype or f32 */
    uint32_t return_lse;
} pyfa_varlen_prefill_plan_desc;

typedef struct pyfa_varlen_prefill_run_args {
    pyfa_tensor q, k, v;     /* varlen: packed k, v; paged: k_pages, v_pages */
    pyfa_tensor cu_seqlens_q;
    pyfa_tensor seq_k;       /* varlen: cu_seqlens_k [batch + 1]; paged: kv_len [batch] */
    pyfa_tensor block_table; /* paged: [batch, pages_per_seq] */
    pyfa_tensor out;
    pyfa_tensor lse;         /* [num_heads, total_q] f32 when planned with return_lse */
    uint32_t total_q, total_k; /* packed rows of q (and of k / v for varlen; 0 paged) */
    uint32_t flags;          /* PYFA_RUN_FINISH, or 0 */
    uint32_t reserved;
} pyfa_varlen_prefill_run_args;

int pyfa_varlen_prefill_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_varlen_prefill_plan_desc *desc);
int pyfa_varlen_prefill_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_varlen_prefill_run_args *args);

int pyfa_decode_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_decode_plan_desc *desc);
int pyfa_prefill_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_prefill_plan_desc *desc);
int pyfa_prefill_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_prefill_run_args *args);
int pyfa_tq_decode_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_tq_decode_plan_desc *desc);
void pyfa_plan_free(pyfa_plan *plan);
/* Bytes of a workspace a run may pass instead of the plan's own. */
int pyfa_plan_workspace_bytes(pyfa_plan *plan, uint64_t *bytes);
int pyfa_decode_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_decode_run_args *args);
int pyfa_tq_decode_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_tq_decode_run_args *args);
/* ---- paged decode: decode over paged KV pools (paged_kv_params.h) ----
 * One dispatch (plus the reduce) decodes a batch of sequences of different
 * lengths whose K and V rows live in shared pools of pages: k_pages /
 * v_pages [num_pages, page_size, num_kv_heads, head_dim] (PYFA_PAGES_NHD) or
 * [num_pages, num_kv_heads, page_size, head_dim] (PYFA_PAGES_HND); for
 * TurboQuant codes [..., row_bytes] u8 and scales [...] f32 in the same
 * layout. attn (tq.attn) holds the shapes and options as for decode;
 * attn.kv_capacity is not read (a sequence holds pages_per_seq * page_size
 * positions), nor is there a ring_start (paged sequences are not rings).
 * Semantics otherwise decode's: window, softcap, GQA, out dtype, lse.
 * The split (attn.nwg 0: the backend's) is sized for max_kv_len (0 =
 * pages_per_seq * page_size) and split_batch (0 = batch): a batch whose
 * lengths sum to S with the longest L should pass ceil(S / L), the work in
 * units of its longest sequence, so a few long sequences among many short
 * ones still split enough to keep the GPU busy.
 * Run values: kv_len as pyfa_seq_values of `batch` int32 values; block_table
 * as pyfa_seq_values of batch * pages_per_seq int32 values (row-major
 * [batch, pages_per_seq]). Host values (and device memory the host can read:
 * CPU, Metal) are checked: kv_len in 0...pages_per_seq * page_size (0 = an
 * empty sequence: out zeros, lse -inf), every block_table entry in
 * 0..<num_pages. Device values are clamped by the kernels as
 * paged_kv_params.h says. */
typedef struct pyfa_paged_decode_plan_desc {
    pyfa_flash_attn_vec_params attn;
    pyfa_kv_pages pages;
    pyfa_dtype q_dtype;
    pyfa_dtype kv_dtype;
    pyfa_dtype out_dtype;
    uint32_t max_kv_len;   /* 0 = pages_per_seq * page_size */
    uint32_t split_batch;  /* 0 = batch */
    uint32_t return_lse;   /* 1: runs write lse [batch, num_heads] f32 */
} pyfa_paged_decode_plan_desc;

typedef struct pyfa_paged_decode_run_args {
    pyfa_tensor q;         /* [batch, num_heads, head_dim] of q_dtype */
    pyfa_tensor k_pages;   /* the K pool (above), kv_dtype */
    pyfa_tensor v_pages;
    pyfa_tensor out;       /* [batch, num_heads, head_dim] of out_dtype */
    pyfa_tensor lse;       /* [batch, num_heads] f32 when planned with return_lse */
    pyfa_tensor workspace; /* optional */
    pyfa_seq_values kv_len;      /* batch values */
    pyfa_seq_values block_table; /* batch * pages_per_seq values */
    uint32_t flags;        /* PYFA_RUN_FINISH, or 0 */
    uint32_t reserved;
} pyfa_paged_decode_run_args;

typedef struct pyfa_paged_tq_decode_plan_desc {
    pyfa_flash_attn_vec_tq_params tq;
    pyfa_kv_pages pages;
    pyfa_dtype q_dtype;
    pyfa_dtype out_dtype;
    uint32_t max_kv_len;   /* 0 = pages_per_seq * page_size */
    uint32_t split_batch;  /* 0 = batch */
    uint32_t return_lse;
    uint32_t reserved;
} pyfa_paged_tq_decode_plan_desc;

typedef struct pyfa_paged_tq_decode_run_args {
    pyfa_tensor q;
    pyfa_tensor k_codes, k_scales, v_codes, v_scales; /* the pools (above) */
    pyfa_tensor out;
    pyfa_tensor lse;
    pyfa_tensor workspace; /* optional */
    pyfa_seq_values kv_len;
    pyfa_seq_values block_table;
    uint32_t flags;        /* PYFA_RUN_FINISH, or 0 */
    uint32_t reserved;
} pyfa_paged_tq_decode_run_args;

int pyfa_paged_decode_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_paged_decode_plan_desc *desc);
int pyfa_paged_decode_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_paged_decode_run_args *args);
int pyfa_paged_tq_decode_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_paged_tq_decode_plan_desc *desc);
int pyfa_paged_tq_decode_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_paged_tq_decode_run_args *args);
/* ---- end of paged decode ---- */

/* pyfa_encoder_commit, then pyfa_encoder_wait unless the encoder runs on a
 * caller's stream: what a synchronous call does after a run, in one call. */
int pyfa_encoder_finish(pyfa_encoder *encoder);

/* Paged appends prepared (pyfa_kv_append_paged / pyfa_tq_quantize_paged):
 * the pool geometry, dtypes and (k_bits, v_bits 0: dense pools; else the
 * TurboQuant widths, norm_correction and seed) are the plan's; a run passes
 * the memory and num_tokens. pool_dtype is the dense pools' dtype (U8 for
 * TurboQuant pools). slot_mapping is int32 [num_tokens] memory, checked
 * during the run where the library can read it (CPU, Metal), else read and
 * clamped by the kernels. No workspace. */
typedef struct pyfa_paged_append_plan_desc {
    pyfa_kv_pages pages;   /* page_size, num_pages, layout (pages_per_seq not read) */
    uint32_t num_kv_heads;
    uint32_t head_dim;
    pyfa_dtype src_dtype;  /* of the k and v rows */
    pyfa_dtype pool_dtype;
    uint32_t k_bits;       /* 0: dense pools */
    uint32_t v_bits;
    uint32_t norm_correction;
    uint32_t seed_lo;
    uint32_t seed_hi;
    uint32_t reserved;
} pyfa_paged_append_plan_desc;

typedef struct pyfa_paged_append_run_args {
    pyfa_tensor k, v;               /* [num_tokens, num_kv_heads, head_dim] of src_dtype */
    pyfa_tensor k_pages, v_pages;   /* dense pools, or TurboQuant codes */
    pyfa_tensor k_scales, v_scales; /* TurboQuant scales (absent for dense pools) */
    /* int32 [num_tokens]: host values (checked, sent with the launch; Metal's
     * setBytes carries at most 4 KB, 1024 tokens: pass memory for more there) or memory. */
    pyfa_seq_values slot_mapping;
    uint32_t num_tokens;
    uint32_t flags;                 /* PYFA_RUN_FINISH, or 0 */
} pyfa_paged_append_run_args;

int pyfa_paged_append_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_paged_append_plan_desc *desc);
int pyfa_paged_append_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_paged_append_run_args *args);

/* Appends to a single-sequence ring cache prepared (pyfa_kv_append, or
 * pyfa_hadamard_quantize_kv when k_bits != 0, for K and V in one run): the
 * cache geometry (kv_capacity <= INT32_MAX), dtypes and TurboQuant options
 * (widths, norm_correction, seed; all 0 for a dense cache) are the plan's; a
 * run passes the memory, num_tokens and write_pos, the slot of the first row
 * (rows wrap around the ring), or instead of write_pos the cache's length
 * state in memory (`state`, a pyfa_kv_state of int32 [4], pyfa_params.h):
 * the run then records kv_advance, which moves the state past num_tokens
 * rows, and the appends write where it says, all when the kernels run, so a
 * CUDA graph that captured the run appends after the rows of the replay
 * before it. A decode reads the same state's kv_len and ring_start as its
 * device per-sequence values. With a state, num_tokens (the rows appended)
 * may pass kv_capacity, and k and v hold its last min(num_tokens,
 * kv_capacity) rows: a ring keeps only those, and without a ring such an
 * append is dropped, as every append past capacity is (state.write_pos -1,
 * dropped + 1); `ring` says whether the cache is a ring buffer. cache_dtype is the dense cache's dtype (U8 for
 * TurboQuant codes, which k_cache / v_cache then hold, as k_codes / v_codes
 * of pyfa_tq_decode_run_args). A run binds and checks all its memory before
 * recording anything, so a refused run leaves the encoder as it was. No
 * workspace. */
typedef struct pyfa_kv_append_plan_desc {
    uint32_t num_kv_heads;
    uint32_t head_dim;
    uint32_t kv_capacity;
    pyfa_dtype k_dtype;     /* of the k rows: f32, f16 or bf16 */
    pyfa_dtype v_dtype;     /* of the v rows */
    pyfa_dtype cache_dtype;
    uint32_t k_bits;        /* 0: a dense cache */
    uint32_t v_bits;
    uint32_t norm_correction;
    uint32_t seed_lo;
    uint32_t seed_hi;
    uint32_t reserved;
} pyfa_kv_append_plan_desc;

typedef struct pyfa_kv_append_run_args {
    pyfa_tensor k, v;               /* [num_tokens (with a state: at most kv_capacity), num_kv_heads, head_dim] */
    pyfa_tensor k_cache, v_cache;   /* [num_kv_heads, kv_capacity, head_dim] of cache_dtype, or the codes */
    pyfa_tensor k_scales, v_scales; /* TurboQuant scales [num_kv_heads, kv_capacity] f32 (absent when dense) */
    pyfa_tensor state;              /* pyfa_kv_state int32 [4], or absent: write_pos is used */
    uint32_t num_tokens;            /* 1 ... kv_capacity (any >= 1 with a state) */
    uint32_t write_pos;             /* < kv_capacity; 0 with a state */
    uint32_t flags;                 /* PYFA_RUN_FINISH, or 0 */
    uint32_t ring;                  /* with a state: 1 for a ring buffer (sliding window); else 0 */
} pyfa_kv_append_run_args;

int pyfa_kv_append_plan_new(pyfa_plan **out, pyfa_device *device, const pyfa_kv_append_plan_desc *desc);
int pyfa_kv_append_run(pyfa_plan *plan, pyfa_encoder *encoder, const pyfa_kv_append_run_args *args);

/* ---- counters: what calls cost beyond their kernels (for tests) ----
 * Process-wide totals since the library loaded. */
typedef struct pyfa_counters {
    uint64_t device_allocations;    /* device memory (cuMemAlloc, a new MTLBuffer) */
    uint64_t pinned_allocations;    /* page-locked host memory (CUDA shared buffers) */
    uint64_t host_allocations;      /* host memory of CPU-backend buffers */
    uint64_t synchronizations;      /* host waits for a GPU (stream syncs, command-buffer waits) */
    uint64_t host_to_device_copies; /* copies of host bytes to a GPU */
    uint64_t device_to_host_copies;
    uint64_t kernel_launches;       /* GPU launches (CUDA) */
    uint64_t plans_created;
    uint64_t cluster_launches;      /* of the kernel launches, those of clusters of blocks (CUDA, sm_90) */
    uint64_t split_launches;        /* prefill dispatches whose blocks' keys were split (CUDA, sm_90) */
    uint64_t persistent_launches;   /* prefill dispatches of persistent blocks, each running several of the grid's (CUDA, sm_90) */
} pyfa_counters;
int pyfa_counters_get(pyfa_counters *out);

/* ---- CUDA ----
 * Binds an encoder to a caller's CUDA stream (cudaStream_t / CUstream as an
 * integer; 0 = the encoder's own stream; the legacy default stream is
 * CU_STREAM_LEGACY, 1): later commits launch on it, so work orders with the
 * caller's (torch, cupy), and pyfa_encoder_finish does not wait. Backends
 * without streams return PYFA_ERR_UNSUPPORTED. */
int pyfa_encoder_set_stream(pyfa_encoder *encoder, uint64_t stream);
/* *out = 1 while the encoder's stream is being captured into a CUDA graph
 * (what it records then runs only when the graph replays), else 0; 0 on
 * backends without streams. */
int pyfa_encoder_is_capturing(pyfa_encoder *encoder, uint32_t *out);
/* Compiles every CUDA kernel specialisation the dispatchers can request for
 * arch ("sm_80", "sm_90a", ...) with NVRTC; needs no GPU or driver. Uses the
 * disk cache. count receives the number of specialisations (may be NULL). */
int pyfa_cuda_compile_all(const char *arch, uint32_t *count);

#ifdef __cplusplus
}
#endif
