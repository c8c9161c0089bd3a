/* dlopen loaders for the CUDA driver and NVRTC (see pyfa_cuda_driver.h). */
#include "pyfa_cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pyfa_cuda_driver_api pyfa_cu;
pyfa_nvrtc_api pyfa_nvrtc;

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static int driver_state; /* 0 = not tried, 1 = loaded, -1 = failed */
static char driver_error[512];
static int nvrtc_state;
static char nvrtc_error[1024];
static char nvrtc_path[1024];

/* Resolves one symbol into a table slot; records the first missing name. */
static int bind(void *lib, const char *symbol, void **slot, char *err, size_t err_len, const char *libname) {
    *slot = dlsym(lib, symbol);
    if (*slot) return 0;
    snprintf(err, err_len, "%s has no symbol %s (driver too old?)", libname, symbol);
    return -1;
}

int pyfa_cuda_driver_load(char *err, size_t err_len) {
    pthread_mutex_lock(&load_lock);
    if (driver_state == 0) {
        driver_state = -1;
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *why = dlerror();
            snprintf(driver_error, sizeof driver_error,
                     "no NVIDIA driver: dlopen(libcuda.so.1) failed (%s)", why ? why : "unknown");
        } else {
            pyfa_cuda_driver_api t;
            int bad = 0;
#define BIND(field, sym) bad = bad || bind(lib, sym, (void **)&t.field, driver_error, sizeof driver_error, "libcuda.so.1")
            BIND(cuInit, "cuInit");
            BIND(cuDriverGetVersion, "cuDriverGetVersion");
            BIND(cuGetErrorString, "cuGetErrorString");
            BIND(cuGetErrorName, "cuGetErrorName");
            BIND(cuDeviceGetCount, "cuDeviceGetCount");
            BIND(cuDeviceGet, "cuDeviceGet");
            BIND(cuDeviceGetName, "cuDeviceGetName");
            BIND(cuDeviceGetAttribute, "cuDeviceGetAttribute");
            BIND(cuDeviceTotalMem, "cuDeviceTotalMem_v2");
            BIND(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
            BIND(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
            BIND(cuCtxSetCurrent, "cuCtxSetCurrent");
            BIND(cuMemAlloc, "cuMemAlloc_v2");
            BIND(cuMemFree, "cuMemFree_v2");
            BIND(cuMemHostAlloc, "cuMemHostAlloc");
            BIND(cuMemFreeHost, "cuMemFreeHost");
            BIND(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
            BIND(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
            BIND(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
            BIND(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
            BIND(cuPointerGetAttribute, "cuPointerGetAttribute");
            BIND(cuPointerGetAttributes, "cuPointerGetAttributes");
            BIND(cuStreamIsCapturing, "cuStreamIsCapturing");
            BIND(cuModuleLoadData, "cuModuleLoadData");
            BIND(cuModuleUnload, "cuModuleUnload");
            BIND(cuModuleGetFunction, "cuModuleGetFunction");
            BIND(cuFuncSetAttribute, "cuFuncSetAttribute");
            BIND(cuLaunchKernel, "cuLaunchKernel");
            BIND(cuStreamCreate, "cuStreamCreate");
            BIND(cuStreamDestroy, "cuStreamDestroy_v2");
            BIND(cuStreamSynchronize, "cuStreamSynchronize");
            BIND(cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
#undef BIND
            t.cuLaunchKernelEx = (CUresult(*)(const pyfa_cu_launch_config *, CUfunction, void **, void **))dlsym(
                lib, "cuLaunchKernelEx");
            t.cuTensorMapEncodeTiled = (CUresult(*)(void *, int, uint32_t, void *, const uint64_t *, const uint64_t *,
                                                    const uint32_t *, const uint32_t *, int, int, int, int))dlsym(
                lib, "cuTensorMapEncodeTiled");
            if (!bad) {
                CUresult r = t.cuInit(0);
                if (r != 0) {
                    const char *name = NULL;
                    t.cuGetErrorName(r, &name);
                    snprintf(driver_error, sizeof driver_error,
                             "cuInit failed with %s (%d): no usable NVIDIA GPU or driver", name ? name : "?", r);
                } else {
                    pyfa_cu = t;
                    driver_state = 1;
                }
            }
            if (driver_state != 1) dlclose(lib);
        }
    }
    int ok = driver_state == 1;
    if (!ok && err && err_len) snprintf(err, err_len, "%s", driver_error);
    pthread_mutex_unlock(&load_lock);
    return ok ? 0 : -1;
}

static int try_nvrtc(const char *path, char *tried, size_t tried_len) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        size_t used = strlen(tried);
        snprintf(tried + used, tried_len - used, "%s%s (%s)", used ? "; " : "", path, why ? why : "not found");
        return -1;
    }
    pyfa_nvrtc_api t;
    int bad = 0;
#define BIND(field) bad = bad || bind(lib, #field, (void **)&t.field, nvrtc_error, sizeof nvrtc_error, path)
    BIND(nvrtcGetErrorString);
    BIND(nvrtcVersion);
    BIND(nvrtcCreateProgram);
    BIND(nvrtcDestroyProgram);
    BIND(nvrtcCompileProgram);
    BIND(nvrtcGetCUBINSize);
    BIND(nvrtcGetCUBIN);
    BIND(nvrtcGetProgramLogSize);
    BIND(nvrtcGetProgramLog);
#undef BIND
    if (bad) {
        size_t used = strlen(tried);
        snprintf(tried + used, tried_len - used, "%s%s", used ? "; " : "", nvrtc_error);
        dlclose(lib);
        return -1;
    }
    pyfa_nvrtc = t;
    snprintf(nvrtc_path, sizeof nvrtc_path, "%s", path);
    return 0;
}

int pyfa_cuda_nvrtc_load(const char *fallback_path, char *err, size_t err_len, char *loaded_from,
                         size_t loaded_len) {
    pthread_mutex_lock(&load_lock);
    if (nvrtc_state != 1) {
        /* Retried while it fails: the Python side may set the wheel path later. */
        char tried[1024] = "";
        const char *env = getenv("PYFA_NVRTC");
        const char *candidates[] = {env && *env ? env : NULL, "libnvrtc.so.13", "libnvrtc.so.12",
                                    fallback_path && *fallback_path ? fallback_path : NULL};
        nvrtc_state = -1;
        for (size_t i = 0; i < sizeof candidates / sizeof candidates[0]; i++) {
            if (candidates[i] && try_nvrtc(candidates[i], tried, sizeof tried) == 0) {
                nvrtc_state = 1;
                break;
            }
        }
        if (nvrtc_state != 1)
            snprintf(nvrtc_error, sizeof nvrtc_error,
                     "NVRTC not found (tried %s); install the nvidia-cuda-nvrtc wheel or set PYFA_NVRTC", tried);
    }
    int ok = nvrtc_state == 1;
    if (!ok && err && err_len) snprintf(err, err_len, "%s", nvrtc_error);
    if (ok && loaded_from && loaded_len) snprintf(loaded_from, loaded_len, "%s", nvrtc_path);
    pthread_mutex_unlock(&load_lock);
    return ok ? 0 : -1;
}
