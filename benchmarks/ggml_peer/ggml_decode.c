/* One decode step of attention through ggml's CPU backend (llama.cpp's kernels):
 * ggml_flash_attn_ext over a K/V cache in f16 with a query row per head, as
 * llama.cpp builds a layer's attention, without its mask (llama.cpp passes
 * one) and with the precision it sets (GGML_PREC_F32, which the CPU kernel
 * does not read: V is summed in f16), timed as ggml_graph_compute on ggml's
 * threads (an OpenMP team where ggml was built with OpenMP, the default; a
 * ggml threadpool otherwise). Inputs come from the
 * files the driver wrote (benchmarks/ggml_peer/compare.py), so pyfa and ggml
 * read the same numbers; the output is written back for the driver to check.
 *
 *   ggml_decode HQ HKV D L THREADS ITERS DIR
 *   DIR/q.f32: [HQ][D] f32; DIR/k.f16, DIR/v.f16: [HKV][L][D] f16
 *   prints "median_us <x>" and writes DIR/out_ggml.f32 ([HQ][D] f32)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static void read_into(const char *dir, const char *name, void *dst, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f || fread(dst, 1, bytes, f) != bytes) {
        fprintf(stderr, "ggml_decode: cannot read %zu bytes of %s\n", bytes, path);
        exit(2);
    }
    fclose(f);
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: ggml_decode HQ HKV D L THREADS ITERS DIR\n");
        return 2;
    }
    const int hq = atoi(argv[1]), hkv = atoi(argv[2]), d = atoi(argv[3]), len = atoi(argv[4]);
    const int threads = atoi(argv[5]), iters = atoi(argv[6]);
    const char *dir = argv[7];
    ggml_cpu_init();
    const size_t kv_bytes = (size_t)hkv * len * d * sizeof(ggml_fp16_t);
    struct ggml_init_params ip = {.mem_size = 2 * kv_bytes + (size_t)4 * hq * d * sizeof(float) + (64u << 20),
                                  .mem_buffer = NULL, .no_alloc = false};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_tensor *q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, 1, hq, 1);
    struct ggml_tensor *k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, d, len, hkv, 1);
    struct ggml_tensor *v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, d, len, hkv, 1);
    read_into(dir, "q.f32", q->data, ggml_nbytes(q));
    read_into(dir, "k.f16", k->data, ggml_nbytes(k));
    read_into(dir, "v.f16", v->data, ggml_nbytes(v));
    struct ggml_tensor *out = ggml_flash_attn_ext(ctx, q, k, v, NULL, 1.0f / sqrtf((float)d), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);

    struct ggml_threadpool_params tp = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *pool = ggml_threadpool_new(&tp);
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    plan.work_data = plan.work_size ? malloc(plan.work_size) : NULL;

    double *times = malloc(sizeof(double) * (size_t)iters);
    for (int i = 0; i < 3; i++) ggml_graph_compute(graph, &plan);
    for (int i = 0; i < iters; i++) {
        const double t0 = now_us();
        if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "ggml_decode: compute failed\n");
            return 1;
        }
        times[i] = now_us() - t0;
    }
    qsort(times, (size_t)iters, sizeof(double), by_value);
    printf("median_us %.2f\n", times[iters / 2]);

    /* res: [D, HQ, 1, 1], contiguous f32 */
    char path[4096];
    snprintf(path, sizeof path, "%s/out_ggml.f32", dir);
    FILE *f = fopen(path, "wb");
    fwrite(out->data, 1, ggml_nbytes(out), f);
    fclose(f);
    free(times);
    free(plan.work_data);
    ggml_threadpool_free(pool);
    ggml_free(ctx);
    return 0;
}
