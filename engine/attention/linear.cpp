// The engine's projections on the CPU (float32): out = x . W^T (+ bias), W packed once at load.
// Built into the same library as paged_attention.cpp (see native.py).
//
// Packed layout: W [n, k] (row-major, as nn.Linear keeps it) becomes blocks of NB output columns,
// each [k][NB]: one block is one forward stream through memory. A block's columns are computed
// for up to ROWS rows of x at a time, NV x ROWS vector accumulators, each weight vector loaded
// once for the rows and the stream prefetched about 3 KiB ahead (without it the loads wait on
// memory: a third slower at 8 rows); rows past ROWS take the block again from the cache. Threads
// take blocks (static schedule). With AVX-512 a block is 48 columns by 8 rows (24 accumulators in
// 32 registers), with 8-lane vectors (AVX2) 24 columns by 4 rows (12 in 16).
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

enum { NV = 3, ROWS = VREGS >= 32 ? 8 : 4, NB = VL * NV, PREFETCH = 3072 / (4 * NB) };   // PREFETCH: k-rows ahead

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
    vf a[M][NV];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NV; j++) a[m][j] = bc(0.0f);
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = wp + kk * NB;
        for (int off = 0; off < NB; off += 16) __builtin_prefetch(w + PREFETCH * NB + off, 0, 3);   // a line each
        vf wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = ld(w + VL * j);
        for (int m = 0; m < M; m++) {
            const vf xv = bc(x[m * xs + kk]);
            for (int j = 0; j < NV; j++) a[m][j] += xv * wv[j];
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NV; j++) st(acc + m * NB + VL * j, a[m][j]);
}

typedef void (*BlockFn)(const float *, int64_t, const float *, int64_t, float *);
static const BlockFn BLOCK_FNS[9] = {0, block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>,
                                    block_rows<5>, block_rows<6>, block_rows<7>, block_rows<8>};   // up to ROWS

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
