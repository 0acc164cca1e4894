// The engine's projections on the CPU (float32): out = x . W^T (+ bias), W packed once at load.
// Built into the same library as paged_attention.cpp (see native.py).
//
// Packed layout: W [n, k] (row-major, as nn.Linear keeps it) becomes blocks of NB output columns,
// each [k][NB]: one block is one forward stream through memory. A block's columns are computed
// for up to 8 rows of x at a time, 3 x 8 vector accumulators, each weight vector loaded once for
// the 8 rows and the stream prefetched PREFETCH k-rows ahead (without it the loads wait on
// memory: a third slower at 8 rows); rows past 8 take the block again from the cache. Threads
// take blocks (static schedule).
//
// Why: decode multiplies a few rows by every weight of the model, so a step is a pass over the
// weights at memory speed. oneDNN's prepacked linear reached 17-18 GB/s at 8 rows on two cores
// of the machine in BENCHMARKS.md, this one 22-23 (1.3x); it is also faster at 512 rows (1.15x).
//
// Arithmetic: every output is one chain of fused multiply-adds over k in order, then the bias:
// the same bits whatever the number of rows, their position in the batch or the threads, so a
// token's projections in a prefill and in a decode step are identical.

#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { NB = 48, ROWS = 8, PREFETCH = 16 };

extern "C" {

int64_t kv_packed_linear_floats(int64_t n, int64_t k) { return (n + NB - 1) / NB * k * NB; }

// w [n, k] row-major -> out (kv_packed_linear_floats(n, k) floats), columns past n zero
void kv_pack_linear(const float *w, int64_t n, int64_t k, float *out, int threads) {
    const int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        float *o = out + b * k * NB;
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NB; j++) {
                const int64_t col = b * NB + j;
                o[kk * NB + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

}  // extern "C"

// acc [M][NB] = x [M rows at stride xs][k] . one packed block [k][NB]
template <int M>
static void block_rows(const float *x, int64_t xs, const float *wp, int64_t k, float *acc) {
    v16 a[M][3];
    for (int m = 0; m < M; m++) a[m][0] = a[m][1] = a[m][2] = bc(0.0f);
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = wp + kk * NB;
        __builtin_prefetch(w + PREFETCH * NB, 0, 3);
        __builtin_prefetch(w + PREFETCH * NB + 16, 0, 3);
        __builtin_prefetch(w + PREFETCH * NB + 32, 0, 3);
        const v16 w0 = ld(w), w1 = ld(w + 16), w2 = ld(w + 32);
        for (int m = 0; m < M; m++) {
            const v16 xv = bc(x[m * xs + kk]);
            a[m][0] += xv * w0;
            a[m][1] += xv * w1;
            a[m][2] += xv * w2;
        }
    }
    for (int m = 0; m < M; m++) {
        st(acc + m * NB, a[m][0]);
        st(acc + m * NB + 16, a[m][1]);
        st(acc + m * NB + 32, a[m][2]);
    }
}

typedef void (*BlockFn)(const float *, int64_t, const float *, int64_t, float *);
static const BlockFn BLOCK_FNS[ROWS + 1] = {0, block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>,
                                            block_rows<5>, block_rows<6>, block_rows<7>, block_rows<8>};

extern "C" {

// out [m rows at stride os][n] = x [m rows at stride xs][k] . W^T (+ bias [n]); wp packed by kv_pack_linear
void kv_linear(const float *x, int64_t xs, int64_t m, const float *wp, const float *bias, int64_t n, int64_t k,
               float *out, int64_t os, int threads) {
    const int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[ROWS * NB] __attribute__((aligned(64)));
        const int64_t c0 = b * NB, cols = n - c0 < NB ? n - c0 : NB;
        for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
            const int rows = m - m0 < ROWS ? (int)(m - m0) : ROWS;
            BLOCK_FNS[rows](x + m0 * xs, xs, wp + b * k * NB, k, acc);
            for (int r = 0; r < rows; r++) {
                float *o = out + (m0 + r) * os + c0;
                if (bias)
                    for (int64_t j = 0; j < cols; j++) o[j] = acc[r * NB + j] + bias[c0 + j];
                else
                    memcpy(o, acc + r * NB, sizeof(float) * cols);
            }
        }
    }
}

}  // extern "C"
