// The vectors the CPU kernels use (paged_attention.cpp, layer_ops.cpp, linear.cpp): `vf`, VL float
// lanes in GCC/Clang vector extensions at the machine's own width (16 with AVX-512, 8 with AVX2, 4
// with SSE or NEON), so that each vector is one register; loads, stores, broadcast, exp and the
// horizontal max and sum. A wider type than the registers (16 lanes on AVX2) is split by GCC into
// pieces that go through memory at every operation: several times slower than the native width.

#pragma once

#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

// how many vectors the registers hold, for the kernels' register blocking: 32 zmm with AVX-512, 32 q
// with NEON, 16 ymm or xmm otherwise
#if defined(__AVX512F__) || defined(__aarch64__)
enum { VREGS = 32 };
#else
enum { VREGS = 16 };
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vfi __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));

static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf x) { *(vfu *)p = x; }
static inline vf bc(float x) { return x - (vf){}; }   // x in every lane (x - 0 is x, -0 included)
static inline vf iota() {   // 0, 1, .., VL - 1
    vf r;
    for (int i = 0; i < VL; i++) r[i] = (float)i;
    return r;
}

// keep a vector in a register: the compiler would otherwise fold its load into every use
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
#define IN_REG(x) __asm__("" : "+v"(x))
#else
#define IN_REG(x) (void)0
#endif

// exp of each lane (Cephes' single-precision polynomial, about 1 ulp); lanes below -87 give ~1e-38
static inline vf vexp(vf x) {
    const vf lo = bc(-87.3f), hi = bc(88.3f);
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    vf fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round(x / ln 2)
    vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vf p = bc(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    vfi n = __builtin_convertvector(fn, vfi);
    vfi bits = (n + 127) << 23;
    return p * (vf)bits;
}

// the largest and the sum of a vector's lanes (a tree of shuffles: halves, quarters, ..)
#if defined(__clang__)
#define SHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUF(v, ...) __builtin_shuffle(v, (vfi){__VA_ARGS__})
#endif
#if VL == 16
#define FOLDS(F, v) F(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); \
    F(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); F(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#elif VL == 8
#define FOLDS(F, v) F(v, 4, 5, 6, 7, 0, 1, 2, 3); F(v, 2, 3, 0, 1, 6, 7, 4, 5)
#else
#define FOLDS(F, v) F(v, 2, 3, 0, 1)
#endif
#define MAX_FOLD(v, ...) v = v > SHUF(v, __VA_ARGS__) ? v : SHUF(v, __VA_ARGS__)
#define SUM_FOLD(v, ...) v += SHUF(v, __VA_ARGS__)
static inline float hmax(vf v) {
    FOLDS(MAX_FOLD, v);
    return v[0] > v[1] ? v[0] : v[1];
}
static inline float hsum(vf v) {
    FOLDS(SUM_FOLD, v);
    return v[0] + v[1];
}
