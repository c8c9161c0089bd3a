/*
 * The CUDA driver API and NVRTC, declared here and loaded with dlopen at run
 * time: libpyfa needs no CUDA SDK to build and loads on machines without a
 * GPU. Only the entry points the CUDA backend calls are declared, with the
 * driver's versioned symbol names resolved by the loader.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>
#include "../../../shaders/cuda/pyfa_cuda_args.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

#define PYFA_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK 1
#define PYFA_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define PYFA_CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE 38
#define PYFA_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define PYFA_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define PYFA_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
#define PYFA_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define PYFA_CU_STREAM_NON_BLOCKING 1
#define PYFA_CU_MEMHOSTALLOC_PORTABLE 1
#define PYFA_CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define PYFA_CU_MEMORYTYPE_HOST 1
#define PYFA_CU_MEMORYTYPE_DEVICE 2
#define PYFA_CU_MEMORYTYPE_UNIFIED 4
#define PYFA_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define PYFA_CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define PYFA_CU_STREAM_CAPTURE_STATUS_NONE 0
#define PYFA_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION 4
#define PYFA_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6

/* cuLaunchKernelEx's configuration (cuda.h's CUlaunchAttribute and
 * CUlaunchConfig, same layout): the attributes pyfa sets. */
typedef struct pyfa_cu_launch_attribute {
    int id;
    char pad[4];
    union {
        char pad[64];
        unsigned long long align; /* cuda.h's union holds 8-byte members */
        int programmatic_stream_serialization_allowed;
        struct {
            unsigned int x, y, z;
        } cluster_dim; /* blocks a cluster along each grid axis */
    } value;
} pyfa_cu_launch_attribute;

typedef struct pyfa_cu_launch_config {
    unsigned int grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    CUstream stream;
    pyfa_cu_launch_attribute *attrs;
    unsigned int num_attrs;
} pyfa_cu_launch_config;

_Static_assert(sizeof(pyfa_cu_launch_attribute) == 72 && offsetof(pyfa_cu_launch_attribute, value) == 8,
               "CUlaunchAttribute layout");
_Static_assert(sizeof(pyfa_cu_launch_config) == 56 && offsetof(pyfa_cu_launch_config, stream) == 32 &&
                   offsetof(pyfa_cu_launch_config, attrs) == 40 && offsetof(pyfa_cu_launch_config, num_attrs) == 48,
               "CUlaunchConfig layout");

typedef struct pyfa_cuda_driver_api {
    CUresult (*cuInit)(unsigned int flags);
    CUresult (*cuDriverGetVersion)(int *version);
    CUresult (*cuGetErrorString)(CUresult error, const char **str);
    CUresult (*cuGetErrorName)(CUresult error, const char **str);
    CUresult (*cuDeviceGetCount)(int *count);
    CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
    CUresult (*cuDeviceGetName)(char *name, int len, CUdevice dev);
    CUresult (*cuDeviceGetAttribute)(int *value, int attrib, CUdevice dev);
    CUresult (*cuDeviceTotalMem)(size_t *bytes, CUdevice dev);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice dev);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice dev);
    CUresult (*cuCtxSetCurrent)(CUcontext ctx);
    CUresult (*cuMemAlloc)(CUdeviceptr *dptr, size_t bytes);
    CUresult (*cuMemFree)(CUdeviceptr dptr);
    CUresult (*cuMemHostAlloc)(void **pp, size_t bytes, unsigned int flags);
    CUresult (*cuMemFreeHost)(void *p);
    CUresult (*cuMemcpyHtoD)(CUdeviceptr dst, const void *src, size_t bytes);
    CUresult (*cuMemcpyDtoH)(void *dst, CUdeviceptr src, size_t bytes);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
    CUresult (*cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
    CUresult (*cuPointerGetAttribute)(void *data, int attribute, CUdeviceptr ptr);
    CUresult (*cuPointerGetAttributes)(unsigned int count, int *attributes, void **data, CUdeviceptr ptr);
    CUresult (*cuStreamIsCapturing)(CUstream stream, int *status);
    CUresult (*cuModuleLoadData)(CUmodule *module, const void *image);
    CUresult (*cuModuleUnload)(CUmodule module);
    CUresult (*cuModuleGetFunction)(CUfunction *fn, CUmodule module, const char *name);
    CUresult (*cuFuncSetAttribute)(CUfunction fn, int attrib, int value);
    CUresult (*cuLaunchKernel)(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                               unsigned int by, unsigned int bz, unsigned int shared_bytes, CUstream stream,
                               void **kernel_params, void **extra);
    CUresult (*cuStreamCreate)(CUstream *stream, unsigned int flags);
    CUresult (*cuStreamDestroy)(CUstream stream);
    CUresult (*cuStreamSynchronize)(CUstream stream);
    CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int *blocks, CUfunction fn, int block_size,
                                                            size_t dynamic_smem);
    /* Optional (CUDA 12 drivers and later): NULL where the driver lacks it. */
    CUresult (*cuLaunchKernelEx)(const pyfa_cu_launch_config *config, CUfunction f, void **kernel_params,
                                 void **extra);
    /* Optional (NULL when the driver lacks it): a TMA tensor map (128 bytes,
     * 64-byte aligned) for a tiled region; cuda.h's enums as ints. */
    CUresult (*cuTensorMapEncodeTiled)(void *tensor_map, int data_type, uint32_t rank, void *global_address,
                                       const uint64_t *global_dim, const uint64_t *global_strides,
                                       const uint32_t *box_dim, const uint32_t *element_strides, int interleave,
                                       int swizzle, int l2_promotion, int oob_fill);
} pyfa_cuda_driver_api;

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

typedef struct pyfa_nvrtc_api {
    const char *(*nvrtcGetErrorString)(nvrtcResult result);
    nvrtcResult (*nvrtcVersion)(int *major, int *minor);
    nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram *prog, const char *src, const char *name, int num_headers,
                                      const char *const *headers, const char *const *include_names);
    nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram *prog);
    nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram prog, int num_options, const char *const *options);
    nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram prog, size_t *size);
    nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram prog, char *cubin);
    nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram prog, size_t *size);
    nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram prog, char *log);
} pyfa_nvrtc_api;

/* Loaded tables; valid after a successful load call. */
extern pyfa_cuda_driver_api pyfa_cu;
extern pyfa_nvrtc_api pyfa_nvrtc;

/* Loads libcuda.so.1 once (thread-safe) and calls cuInit(0). Returns 0, or
 * non-zero with a reason in err. Later calls return the first outcome. */
int pyfa_cuda_driver_load(char *err, size_t err_len);

/* Loads NVRTC once: $PYFA_NVRTC, then libnvrtc.so.13, libnvrtc.so.12, then
 * fallback_path (the Python side passes the nvidia-cuda-nvrtc wheel's copy).
 * Writes the path that loaded into loaded_from. */
int pyfa_cuda_nvrtc_load(const char *fallback_path, char *err, size_t err_len, char *loaded_from,
                         size_t loaded_len);

/* Embedded kernel sources (shaders/cuda/ and shaders/common/ headers), by file
 * name; NULL if unknown. */
const char *pyfa_cuda_source(const char *file, size_t *length);
/* The i-th embedded file name (for NVRTC's header list), NULL past the end. */
const char *pyfa_cuda_source_name(size_t i);

/* Kernel table from shaders/cuda/kernel_list.h: source file and the block size
 * bound of a registry name; NULL if the name has no CUDA kernel. */
const char *pyfa_cuda_kernel_file(const char *name, uint32_t *max_threads);
/* The i-th kernel name, NULL past the end. */
const char *pyfa_cuda_kernel_name(size_t i);
