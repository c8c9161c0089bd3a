/*
 * Lloyd-Max codebooks for N(0,1) at 2, 3, 4 and 8 bits, computed here (not
 * tabulated) and cached per process.
 *
 * Method, all in double precision and deterministic:
 *  1. start from the high-resolution (companding) solution: centroid i of L is
 *     sqrt(3) * Phi^-1((i + 1/2) / L), Phi^-1 found by bisection on erfc;
 *  2. Newton's method on the Lloyd fixed point c = m(c), where m_i is the mean
 *     of N(0,1) over the cell between the midpoints of c_{i-1}, c_i and
 *     c_i, c_{i+1}; its Jacobian is tridiagonal. Cell masses use the tail
 *     (erfc) of the side the cell lies on, so 8-bit tail cells keep their
 *     precision. Stops when the largest step is below 1e-15 (or 100 steps);
 *  3. the positive half is mirrored, so the table is exactly symmetric.
 * Plain Lloyd iteration reaches the same fixed point (it converges in ~700
 * steps at 4 bits, ~10^5 at 8 bits); Newton gets there in a handful.
 * The f32 rounding of the result is the codec's table (turboquant_params.h).
 */
#include "pyfa_internal.h"
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define MAX_LEVELS 256

static const double INV_SQRT2 = 0.70710678118654752440;
static const double INV_SQRT2PI = 0.39894228040143267794;

static double pdf(double x) { return isinf(x) ? 0.0 : INV_SQRT2PI * exp(-0.5 * x * x); }

/* P(a < X < b) for a < b, from the tail on the cell's side. */
static double mass(double a, double b) {
    if (a >= 0) return 0.5 * (erfc(a * INV_SQRT2) - erfc(b * INV_SQRT2));
    if (b <= 0) return 0.5 * (erfc(-b * INV_SQRT2) - erfc(-a * INV_SQRT2));
    return 1.0 - 0.5 * erfc(-a * INV_SQRT2) - 0.5 * erfc(b * INV_SQRT2);
}

/* Phi^-1(p) by bisection (p in (0, 1)). */
static double inv_cdf(double p) {
    double lo = -40.0, hi = 40.0;
    for (int i = 0; i < 200; i++) {
        double mid = 0.5 * (lo + hi);
        if (0.5 * erfc(-mid * INV_SQRT2) < p) lo = mid; else hi = mid;
    }
    return 0.5 * (lo + hi);
}

static void lloyd_max(int levels, double *c) {
    double t[MAX_LEVELS + 1], m[MAX_LEVELS], dm_da[MAX_LEVELS], dm_db[MAX_LEVELS];
    double lower[MAX_LEVELS], diag[MAX_LEVELS], upper[MAX_LEVELS], rhs[MAX_LEVELS];
    for (int i = 0; i < levels; i++) c[i] = sqrt(3.0) * inv_cdf((i + 0.5) / levels);
    for (int iter = 0; iter < 100; iter++) {
        t[0] = -INFINITY;
        t[levels] = INFINITY;
        for (int i = 1; i < levels; i++) t[i] = 0.5 * (c[i - 1] + c[i]);
        for (int i = 0; i < levels; i++) {
            double a = t[i], b = t[i + 1], P = mass(a, b);
            m[i] = (pdf(a) - pdf(b)) / P;
            dm_da[i] = isinf(a) ? 0.0 : pdf(a) * (m[i] - a) / P;
            dm_db[i] = isinf(b) ? 0.0 : pdf(b) * (b - m[i]) / P;
        }
        /* Solve (I - dm/dc) delta = m - c; dm_i/dc_{i-1} = dm_da/2,
         * dm_i/dc_i = (dm_da + dm_db)/2, dm_i/dc_{i+1} = dm_db/2. */
        for (int i = 0; i < levels; i++) {
            lower[i] = -0.5 * dm_da[i];
            diag[i] = 1.0 - 0.5 * (dm_da[i] + dm_db[i]);
            upper[i] = -0.5 * dm_db[i];
            rhs[i] = m[i] - c[i];
        }
        for (int i = 1; i < levels; i++) { /* Thomas algorithm */
            double f = lower[i] / diag[i - 1];
            diag[i] -= f * upper[i - 1];
            rhs[i] -= f * rhs[i - 1];
        }
        double step = 0.0;
        for (int i = levels - 1; i >= 0; i--) {
            double delta = (rhs[i] - (i + 1 < levels ? upper[i] * rhs[i + 1] : 0.0)) / diag[i];
            rhs[i] = delta;
            step = fmax(step, fabs(delta));
        }
        for (int i = 0; i < levels; i++) c[i] += rhs[i];
        if (step < 1e-15) break;
    }
    for (int i = 0; i < levels / 2; i++) { /* exact symmetry */
        double v = 0.5 * (c[levels - 1 - i] - c[i]);
        c[i] = -v;
        c[levels - 1 - i] = v;
    }
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static float tables[9][MAX_LEVELS];
static int ready[9];

const float *pyfa_turboquant_codebook_table(uint32_t bits) {
    if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return NULL;
    pthread_mutex_lock(&lock);
    if (!ready[bits]) {
        double c[MAX_LEVELS];
        int levels = 1 << bits;
        lloyd_max(levels, c);
        for (int i = 0; i < levels; i++) tables[bits][i] = (float)c[i];
        ready[bits] = 1;
    }
    pthread_mutex_unlock(&lock);
    return tables[bits];
}

int pyfa_turboquant_codebook(uint32_t bits, float *centroids, uint32_t count) {
    char msg[160];
    const float *t = pyfa_turboquant_codebook_table(bits);
    if (!t) {
        snprintf(msg, sizeof msg, "bits: %u is not supported (TurboQuant bit widths: 2, 3, 4, 8)", bits);
        pyfa_set_last_error(msg);
        return PYFA_ERR_INVALID_ARGUMENT;
    }
    if (count != (1u << bits)) {
        snprintf(msg, sizeof msg, "count: %u must equal 2^bits = %u", count, 1u << bits);
        pyfa_set_last_error(msg);
        return PYFA_ERR_INVALID_ARGUMENT;
    }
    if (!centroids) {
        pyfa_set_last_error("centroids: NULL");
        return PYFA_ERR_INVALID_ARGUMENT;
    }
    memcpy(centroids, t, (size_t)count * sizeof(float));
    pyfa_set_last_error(NULL);
    return PYFA_OK;
}
