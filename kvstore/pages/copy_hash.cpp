// The cold tier's checksummed copy, a batch of records in one call, or shared by threads that copy
// while another fills it (kvstore/pages/native_copy.py).
//
// For each record, the xxh3-128 of its head (the bytes between the checksum and the page) and page,
// and the page copied out, so that the digest covers exactly the bytes delivered. Two ways:
//   fused   (x86-64 with AVX-512 or AVX2, a head and page contiguous in memory, a 64-byte aligned
//           target): one pass (copy_hash_fused.h). Each 64-byte stripe of the record is loaded
//           once into registers, fed to xxh3's accumulators and written to the target from those
//           registers with non-temporal stores, so the page is read from memory once and the
//           target's lines are never read for ownership. xxh3 is computed here (its long-input
//           form; the result is python-xxhash's, as the self-test at load checks).
//   chunked (everywhere else): the page copied chunk by chunk (from the map, or from the file with
//           pread), each chunk hashed right after it landed, with xxhash's own functions, which come
//           from the caller (python-xxhash's, or libxxhash, found at run time).
// This library links nothing and builds anywhere.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sched.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define KV_FUSED 1
#endif


struct Hash128 { uint64_t low64, high64; };   // XXH128_hash_t

struct XxhFunctions {                          // XXH3_createState and friends
    void* (*create)();
    int (*release)(void*);
    int (*reset)(void*);
    int (*update)(void*, const void*, size_t);
    Hash128 (*digest)(const void*);
};

extern "C" int kv_copy_hash_version() { return 5; }

static void put_digest(Hash128 h, unsigned char* out) {   // xxhash's canonical form
    for (int b = 0; b < 8; ++b) {
        out[b] = (unsigned char)(h.high64 >> (56 - 8 * b));
        out[8 + b] = (unsigned char)(h.low64 >> (56 - 8 * b));
    }
}

#if KV_FUSED
// xxh3's constants (the xxhash specification): its primes and default secret.
constexpr uint64_t P32_1 = 0x9E3779B1U, P32_2 = 0x85EBCA77U, P32_3 = 0xC2B2AE3DU;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL, P64_3 = 0x165667B19E3779F9ULL,
                   P64_4 = 0x85EBCA77C2B2AE63ULL, P64_5 = 0x27D4EB2F165667C5ULL, MIX = 0x165667919E3779F9ULL;
alignas(64) static const unsigned char SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
constexpr size_t STRIPE = 64, STRIPES_PER_BLOCK = 16;   // a block: 16 stripes, then a scramble
constexpr size_t PREFETCH = 4096;                       // how far ahead of the stripe being read

static uint64_t read64(const unsigned char* p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint64_t merge(const uint64_t* acc, const unsigned char* secret, uint64_t h) {
    for (int i = 0; i < 4; ++i) {
        unsigned __int128 product = (unsigned __int128)(acc[2 * i] ^ read64(secret + 16 * i))
                                    * (acc[2 * i + 1] ^ read64(secret + 16 * i + 8));
        h += (uint64_t)product ^ (uint64_t)(product >> 64);
    }
    h ^= h >> 37;
    h *= MIX;
    return h ^ (h >> 32);
}

// Whether `copy_hash_fused` may take a record: len hashed bytes of which the last n are the page.
static bool fused_fits(int64_t len, int64_t n, const unsigned char* dst) {
    return n >= 2 * (int64_t)STRIPE && len > 240 && (uintptr_t)dst % STRIPE == 0;
}

namespace avx512 {   // a stripe in one register
#define KV_TARGET __attribute__((target("avx512f")))
struct Ops {
    using V = __m512i;
    KV_TARGET static V load(const unsigned char* p) { return _mm512_loadu_si512(p); }
    KV_TARGET static void store(unsigned char* p, V v) { _mm512_storeu_si512(p, v); }
    KV_TARGET static void stream(unsigned char* p, V v) { _mm512_stream_si512((__m512i*)p, v); }
    KV_TARGET static V accumulate(V acc, V stripe, V key) {
        V mixed = _mm512_xor_si512(stripe, key);
        V product = _mm512_mul_epu32(mixed, _mm512_srli_epi64(mixed, 32));
        return _mm512_add_epi64(acc, _mm512_add_epi64(product, _mm512_shuffle_epi32(stripe, _MM_PERM_BADC)));
    }
    KV_TARGET static V scramble(V acc, V key) {
        const V prime = _mm512_set1_epi64((long long)P32_1);
        V mixed = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), key);
        V low = _mm512_mul_epu32(mixed, prime), high = _mm512_mul_epu32(_mm512_srli_epi64(mixed, 32), prime);
        return _mm512_add_epi64(low, _mm512_slli_epi64(high, 32));
    }
    struct Join {   // bytes [r, r + 64) of a, b: the dwords from r/4 on and from the next, shifted
        V low_words, high_words;
        __m128i right, left;
        KV_TARGET explicit Join(size_t r)
            : low_words(_mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)(r / 4)))),
              high_words(_mm512_add_epi32(low_words, _mm512_set1_epi32(1))),
              right(_mm_cvtsi32_si128((int)(8 * (r % 4)))), left(_mm_cvtsi32_si128((int)(32 - 8 * (r % 4)))) {}
        KV_TARGET V operator()(V a, V b) const {
            V low = _mm512_permutex2var_epi32(a, low_words, b), high = _mm512_permutex2var_epi32(a, high_words, b);
            return _mm512_or_si512(_mm512_srl_epi32(low, right), _mm512_sll_epi32(high, left));
        }
    };
};
#include "copy_hash_fused.h"
#undef KV_TARGET
}

namespace avx2 {   // a stripe in two registers
#define KV_TARGET __attribute__((target("avx2")))
struct Ops {
    struct V { __m256i lo, hi; };
    KV_TARGET static V load(const unsigned char* p) {
        return V{_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
    }
    KV_TARGET static void store(unsigned char* p, V v) {
        _mm256_storeu_si256((__m256i*)p, v.lo);
        _mm256_storeu_si256((__m256i*)(p + 32), v.hi);
    }
    KV_TARGET static void stream(unsigned char* p, V v) {
        _mm256_stream_si256((__m256i*)p, v.lo);
        _mm256_stream_si256((__m256i*)(p + 32), v.hi);
    }
    KV_TARGET static __m256i accumulate(__m256i acc, __m256i stripe, __m256i key) {
        __m256i mixed = _mm256_xor_si256(stripe, key);
        __m256i product = _mm256_mul_epu32(mixed, _mm256_srli_epi64(mixed, 32));
        return _mm256_add_epi64(acc, _mm256_add_epi64(product, _mm256_shuffle_epi32(stripe, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    KV_TARGET static V accumulate(V acc, V stripe, V key) {
        return V{accumulate(acc.lo, stripe.lo, key.lo), accumulate(acc.hi, stripe.hi, key.hi)};
    }
    KV_TARGET static __m256i scramble(__m256i acc, __m256i key) {
        const __m256i prime = _mm256_set1_epi64x((long long)P32_1);
        __m256i mixed = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)), key);
        __m256i low = _mm256_mul_epu32(mixed, prime), high = _mm256_mul_epu32(_mm256_srli_epi64(mixed, 32), prime);
        return _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
    }
    KV_TARGET static V scramble(V acc, V key) { return V{scramble(acc.lo, key.lo), scramble(acc.hi, key.hi)}; }
    struct Join {   // bytes [r, r + 64) of a, b, in 32-byte halves: bytes [s, s + 32) of two halves
        __m256i low_index, low_from_second, high_index, high_from_second;
        __m128i right, left;
        bool far;   // r >= 32: the halves start in a's second half
        KV_TARGET explicit Join(size_t r) : far(r >= 32) {
            const int q = (int)(r % 32 / 4);
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), seven = _mm256_set1_epi32(7);
            const __m256i low = _mm256_add_epi32(lane, _mm256_set1_epi32(q)), high = _mm256_add_epi32(low, _mm256_set1_epi32(1));
            low_index = _mm256_and_si256(low, seven);
            low_from_second = _mm256_cmpgt_epi32(low, seven);
            high_index = _mm256_and_si256(high, seven);
            high_from_second = _mm256_cmpgt_epi32(high, seven);
            right = _mm_cvtsi32_si128((int)(8 * (r % 4)));
            left = _mm_cvtsi32_si128((int)(32 - 8 * (r % 4)));
        }
        KV_TARGET __m256i half(__m256i a, __m256i b) const {   // bytes [r % 32, r % 32 + 32) of a, b
            __m256i low = _mm256_blendv_epi8(_mm256_permutevar8x32_epi32(a, low_index),
                                             _mm256_permutevar8x32_epi32(b, low_index), low_from_second);
            __m256i high = _mm256_blendv_epi8(_mm256_permutevar8x32_epi32(a, high_index),
                                              _mm256_permutevar8x32_epi32(b, high_index), high_from_second);
            return _mm256_or_si256(_mm256_srl_epi32(low, right), _mm256_sll_epi32(high, left));
        }
        KV_TARGET V operator()(V a, V b) const {
            return far ? V{half(a.hi, b.lo), half(b.lo, b.hi)} : V{half(a.lo, a.hi), half(a.hi, b.lo)};
        }
    };
};
#include "copy_hash_fused.h"
#undef KV_TARGET
}

static int widest() {
    static const int level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    return level;
}
#endif

// Block i: n bytes from srcs[i] to dsts[i] (not overlapping), with non-temporal stores where this
// CPU has AVX2 or AVX-512 and dsts[i] is 64-byte aligned, prefetching a 4 KiB page ahead: copies
// between tiers, far larger than the cache, whose target lines are then not read for ownership.
// Else memcpy.
extern "C" void kv_copy_blocks(unsigned char* const* dsts, const unsigned char* const* srcs, int64_t count,
                               int64_t n) {
    for (int64_t i = 0; i < count; ++i) {
        unsigned char* dst = dsts[i];
        const unsigned char* src = srcs[i];
#if KV_FUSED
        if (widest() && (uintptr_t)dst % STRIPE == 0) {
            const int64_t whole = n / (int64_t)STRIPE * (int64_t)STRIPE;
            if (widest() == 2) avx512::stream_copy(dst, src, (size_t)whole);
            else avx2::stream_copy(dst, src, (size_t)whole);
            memcpy(dst + whole, src + whole, (size_t)(n - whole));
            continue;
        }
#endif
        memcpy(dst, src, (size_t)n);
    }
#if KV_FUSED
    _mm_sfence();   // the streamed stores are ordered before whatever the caller does next
#endif
}

// The widest one pass this CPU runs: 2 (AVX-512), 1 (AVX2), 0 (none: records are copied in chunks).
extern "C" int kv_copy_hash_fused_available() {
#if KV_FUSED
    return widest();
#else
    return 0;
#endif
}

// Where a value that starts at `value` in an LMDB map lies in the map's file: LMDB stores a large
// value in overflow pages, 16 bytes (the page header) into the first one, whose header holds the
// page's number (8 bytes at 0) and its flags (2 bytes at 10; P_OVERFLOW is 4). -1 when the value is
// not at the start of an overflow page (a small value, in a leaf page among others).
static int64_t lmdb_value_offset(const unsigned char* value, int64_t psize) {
    const unsigned char* page = value - 16;
    if ((uintptr_t)page % (uintptr_t)psize) return -1;
    uint64_t pgno;
    uint16_t flags;
    memcpy(&pgno, page, 8);
    memcpy(&flags, page + 10, 2);
    return (flags & 4) ? (int64_t)(pgno * (uint64_t)psize) + 16 : -1;
}

// Record i starts at values[i]: its head heads[i] (head_lens[i] bytes), its page srcs[i] (nbytes),
// copied to dsts[i]; its digest, in xxhash's canonical form, into digests[16 * i]; how[i], how page i
// was read. With `fused` 2 (AVX-512) or 1 (AVX2; the widest this CPU runs, at most), a record that
// copy_hash_fused can take is read that way (2). Any other is copied chunk by chunk: with fd >= 0 the
// records are values in an LMDB map of that file (page size psize), and a page in overflow pages is
// read from the file with pread, the kernel's copy out of the page cache (1); any other page, the rest
// of one whose pread came up short, and every page when fd < 0, is copied from the map (0).
static void copy_one(const XxhFunctions* x, void* state, int fused, int fd, int64_t psize, int64_t i,
                     const unsigned char* const* values, const unsigned char* const* heads, const int64_t* head_lens,
                     const unsigned char* const* srcs, unsigned char* const* dsts, int64_t nbytes, int64_t chunk,
                     unsigned char* digests, unsigned char* how) {
#if KV_FUSED
    int64_t len = head_lens[i] + nbytes;
    if (fused && heads[i] + head_lens[i] == srcs[i] && fused_fits(len, nbytes, dsts[i])) {
        put_digest((fused == 2 ? avx512::copy_hash_fused : avx2::copy_hash_fused)(
                       heads[i], (size_t)len, (size_t)head_lens[i], dsts[i]), digests + 16 * i);
        how[i] = 2;
        return;
    }
#endif
    x->reset(state);
    x->update(state, heads[i], (size_t)head_lens[i]);
    int64_t offset = fd >= 0 ? lmdb_value_offset(values[i], psize) : -1;
    if (offset >= 0) offset += srcs[i] - values[i];
    how[i] = offset >= 0;
    for (int64_t a = 0; a < nbytes; a += chunk) {
        size_t len = (size_t)(nbytes - a < chunk ? nbytes - a : chunk);
        if (offset < 0 || pread(fd, dsts[i] + a, len, offset + a) != (ssize_t)len) {
            offset = -1;
            how[i] = 0;
            memcpy(dsts[i] + a, srcs[i] + a, len);
        }
        x->update(state, dsts[i] + a, len);
    }
    put_digest(x->digest(state), digests + 16 * i);
}

static int clamp_fused(int fused) {
#if KV_FUSED
    return fused > widest() ? widest() : fused;
#else
    (void)fused;
    return 0;
#endif
}

// Records 0 to n - 1, each as copy_one says. Returns 0, or -1 when xxhash could not allocate its
// state (nothing copied).
extern "C" int kv_copy_hash(const XxhFunctions* x, int fused, int fd, int64_t psize, int64_t n, const unsigned char* const* values,
                      const unsigned char* const* heads, const int64_t* head_lens,
                      const unsigned char* const* srcs, unsigned char* const* dsts, int64_t nbytes, int64_t chunk,
                      unsigned char* digests, unsigned char* how) {
    void* state = x->create();
    if (!state) return -1;
    fused = clamp_fused(fused);
    for (int64_t i = 0; i < n; ++i)
        copy_one(x, state, fused, fd, psize, i, values, heads, head_lens, srcs, dsts, nbytes, chunk, digests, how);
    x->release(state);
    return 0;
}

// A batch that one thread fills while several copy it: shared[0] the next record to take, shared[1]
// how many are published (their entries in the arrays written before), shared[2] nonzero once no
// more will be. The filling thread publishes with kv_copy_publish; each copying thread calls
// kv_copy_hash_shared, which takes published records one at a time (as copy_one says) until the
// batch is closed and none is left, and waits (spinning briefly, then yielding the CPU) while the
// filler is behind. So no copying thread needs the interpreter between records. Returns 0, or -1 when
// xxhash could not allocate its state (then this thread copied nothing; the others go on).
extern "C" void kv_copy_publish(int64_t* shared, int64_t published, int closed) {
    __atomic_store_n(&shared[1], published, __ATOMIC_RELEASE);
    if (closed) __atomic_store_n(&shared[2], (int64_t)1, __ATOMIC_RELEASE);
}

extern "C" int kv_copy_hash_shared(const XxhFunctions* x, int fused, int fd, int64_t psize, int64_t* shared,
                                   const unsigned char* const* values, const unsigned char* const* heads,
                                   const int64_t* head_lens, const unsigned char* const* srcs,
                                   unsigned char* const* dsts, int64_t nbytes, int64_t chunk, unsigned char* digests,
                                   unsigned char* how) {
    void* state = x->create();
    if (!state) return -1;
    fused = clamp_fused(fused);
    for (int idle = 0;;) {
        const bool closed = __atomic_load_n(&shared[2], __ATOMIC_ACQUIRE) != 0;   // before published: its last value
        const int64_t published = __atomic_load_n(&shared[1], __ATOMIC_ACQUIRE);
        int64_t i = __atomic_load_n(&shared[0], __ATOMIC_RELAXED);
        if (i < published) {
            if (__atomic_compare_exchange_n(&shared[0], &i, i + 1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
                copy_one(x, state, fused, fd, psize, i, values, heads, head_lens, srcs, dsts, nbytes, chunk, digests, how);
                idle = 0;
            }
            continue;
        }
        if (closed) break;
        if (++idle < 64) {
#if KV_FUSED
            for (int k = 0; k < 32; ++k) _mm_pause();
#endif
        } else {
            sched_yield();   // the filler may share this CPU
        }
    }
    x->release(state);
    return 0;
}
