// The vectors both CPU kernels use (paged_attention.cpp, layer_ops.cpp): 16 float lanes in GCC/Clang
// vector extensions, so that one source vectorizes to AVX-512, AVX2 or NEON; loads, stores,
// broadcast, exp and the horizontal max and sum.

#pragma once

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static inline v16 ld(const float *p) { return *(const v16u *)p; }
static inline void st(float *p, v16 x) { *(v16u *)p = x; }
static inline v16 bc(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// keep a vector in a register: the compiler would otherwise fold its load into every use. Only
// where one register holds a whole v16 (AVX-512); elsewhere (AVX2, NEON) a v16 spans several and
// the constraint cannot be met, so the compiler is left to it
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512F__)
#define IN_REG(x) __asm__("" : "+v"(x))
#else
#define IN_REG(x) (void)0
#endif

// exp of each lane (Cephes' single-precision polynomial, about 1 ulp); lanes below -87 give ~1e-38
static inline v16 vexp(v16 x) {
    const v16 lo = bc(-87.3f), hi = bc(88.3f);
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    v16 fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round(x / ln 2)
    v16 r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    v16 p = bc(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    v16i n = __builtin_convertvector(fn, v16i);
    v16i bits = (n + 127) << 23;
    return p * (v16)bits;
}

// the largest and the sum of a vector's lanes (a tree of shuffles)
#if defined(__clang__)
#define SHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUF(v, ...) __builtin_shuffle(v, (v16i){__VA_ARGS__})
#endif
static inline float hmax(v16 v) {
    v = v > SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) ? v : SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v > SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) ? v : SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v > SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) ? v : SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return v[0] > v[1] ? v[0] : v[1];
}
static inline float hsum(v16 v) {
    v += SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return v[0] + v[1];
}
