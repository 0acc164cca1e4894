// The element-wise work of a decoder layer on the CPU, one call where PyTorch takes several: the
// residual add with the RMSNorm after it, RoPE with the write of K and V into their pages, and
// SwiGLU's silu(gate) * up. Built into the same library as paged_attention.cpp (see native.py).
//
// Why: between two projections of a decode step PyTorch dispatches five to twelve small ops, each
// a few microseconds plus the cost of running the interpreter again from caches the projection's
// weights have just swept; at batch 8 these took about a fifth of a step. Float32 only.
//
// Arithmetic: RoPE and the K/V write give the bits PyTorch gives (products rounded apart, as
// `x * cos + rotate_half(x) * sin`: no fused multiply-add), so pages are the same whichever
// backend wrote them. RMSNorm and silu differ from PyTorch's only in the order of a row's sum
// and in exp's last bit.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { PARALLEL_FROM = 1 << 16 };   // elements: below this a call stays on the calling thread

extern "C" {

// x[r] += delta[r] (when delta is given), then out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w.
// x and delta: rows of dim at stride xs; out: rows of dim, contiguous.
void kv_add_rms_norm(float *x, const float *delta, int64_t xs, const float *w, float *out, int64_t rows,
                     int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * xs;
        if (delta) {
            const float *dr = delta + r * xs;
            for (int64_t j = 0; j < dim; j++) xr[j] += dr[j];
        }
        vf acc = bc(0.0f);
        int64_t j = 0;
        for (; j + VL <= dim; j += VL) {
            vf v = ld(xr + j);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (; j < dim; j++) ss += xr[j] * xr[j];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t j = 0; j < dim; j++) o[j] = (xr[j] * inv) * w[j];
    }
}

// out[r, j] = silu(gu[r, j]) * gu[r, inter + j]: gate and up side by side in rows of 2 * inter.
void kv_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t j = 0;
        for (; j + VL <= inter; j += VL) {
            vf x = ld(g + j);
            st(o + j, x / (1.0f + vexp(-x)) * ld(u + j));
        }
        for (; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

// RoPE on the query and key heads of qkv [tokens, (nh + 2 kvh) d] (rows at stride qs; q, k, v heads
// side by side), cos and sin [tokens, d]: the rotated queries into q [tokens, nh, d]; the rotated
// keys and the values into the K and V planes of the hot layer, token t at row rows[t] (a row is
// kvh * d elements).
__attribute__((optimize("fp-contract=off")))
void kv_rope_write(const float *qkv, int64_t qs, const float *cos_, const float *sin_, float *q, float *kb,
                   float *vb, const int64_t *rows, int64_t tokens, int nh, int kvh, int d, int threads) {
    const int half = d / 2;
#pragma omp parallel for num_threads(threads) if (tokens * (nh + 2 * kvh) * d >= PARALLEL_FROM)
    for (int64_t t = 0; t < tokens; t++) {
        const float *src = qkv + t * qs, *c = cos_ + t * d, *s = sin_ + t * d;
        for (int h = 0; h < nh + kvh; h++) {
            const float *x = src + (int64_t)h * d;
            float *o = h < nh ? q + (t * nh + h) * d : kb + rows[t] * kvh * d + (int64_t)(h - nh) * d;
            for (int i = 0; i < half; i++) {
                float a = x[i] * c[i], b = -x[i + half] * s[i];
                o[i] = a + b;
            }
            for (int i = half; i < d; i++) {
                float a = x[i] * c[i], b = x[i - half] * s[i];
                o[i] = a + b;
            }
        }
        memcpy(vb + rows[t] * kvh * d, src + (int64_t)(nh + kvh) * d, sizeof(float) * kvh * d);
    }
}

}  // extern "C"
