// The cold tier's checksummed copy, a batch of records in one call (kvstore/pages/native_copy.py).
//
// For each record, the xxh3-128 of its head (the bytes between the checksum and the page) and page,
// and the page copied out, so that the digest covers exactly the bytes delivered. Two ways:
//   fused   (x86-64 with AVX-512, a head and page contiguous in memory, a 64-byte aligned target):
//           one pass. Each 64-byte stripe of the record is loaded once into a register, fed to
//           xxh3's accumulators and written to the target from that register with non-temporal
//           stores, so the page is read from memory once and the target's lines are never read
//           for ownership. xxh3 is computed here (its long-input form; the result is python-xxhash's,
//           as the self-test at load checks).
//   chunked (everywhere else): the page copied chunk by chunk (from the map, or from the file with
//           pread), each chunk hashed right after it landed, with xxhash's own functions, which come
//           from the caller (python-xxhash's, or libxxhash, found at run time).
// This library links nothing and builds anywhere.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define KV_FUSED 1
#endif

extern "C" {

struct Hash128 { uint64_t low64, high64; };   // XXH128_hash_t

struct XxhFunctions {                          // XXH3_createState and friends
    void* (*create)();
    int (*release)(void*);
    int (*reset)(void*);
    int (*update)(void*, const void*, size_t);
    Hash128 (*digest)(const void*);
};

int kv_copy_hash_version() { return 4; }

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

__attribute__((target("avx512f"))) static inline __m512i accumulate(__m512i acc, __m512i stripe, __m512i key) {
    __m512i mixed = _mm512_xor_si512(stripe, key);
    __m512i product = _mm512_mul_epu32(mixed, _mm512_srli_epi64(mixed, 32));
    return _mm512_add_epi64(acc, _mm512_add_epi64(product, _mm512_shuffle_epi32(stripe, _MM_PERM_BADC)));
}

__attribute__((target("avx512f"))) static inline __m512i scramble(__m512i acc, __m512i key, __m512i prime) {
    __m512i mixed = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), key);
    __m512i low = _mm512_mul_epu32(mixed, prime), high = _mm512_mul_epu32(_mm512_srli_epi64(mixed, 32), prime);
    return _mm512_add_epi64(low, _mm512_slli_epi64(high, 32));
}

// Whether `copy_hash_fused` may take a record: len hashed bytes of which the last n are the page.
static bool fused_fits(int64_t len, int64_t n, const unsigned char* dst) {
    return n >= 2 * (int64_t)STRIPE && len > 240 && (uintptr_t)dst % STRIPE == 0;
}

// The xxh3-128 of in[0, len) (len > 240: xxh3's long form, default secret), copying in[head, len)
// to dst (64-byte aligned) on the way. Stripe k is in[64k, 64k + 64); target block m, in[head + 64m,
// head + 64m + 64), is the last 64 - r bytes of stripe head/64 + m and the first r of the next one
// (r = head % 64), put together in registers (two dword permutes, two shifts).
__attribute__((target("avx512f"))) static Hash128 copy_hash_fused(const unsigned char* in, size_t len, size_t head,
                                                                    unsigned char* dst) {
    const size_t n = len - head;
    const size_t stripes = (len - 1) / STRIPE;   // taken in order; then the last 64 bytes once more
    const size_t k0 = head / STRIPE, r = head % STRIPE;
    size_t blocks = stripes - k0 - (r != 0);     // target blocks written from the stripes
    if (blocks > n / STRIPE) blocks = n / STRIPE;
    __m512i keys[STRIPES_PER_BLOCK];
    for (size_t j = 0; j < STRIPES_PER_BLOCK; ++j) keys[j] = _mm512_loadu_si512(SECRET + 8 * j);
    const __m512i scramble_key = _mm512_loadu_si512(SECRET + sizeof(SECRET) - STRIPE);
    const __m512i last_key = _mm512_loadu_si512(SECRET + sizeof(SECRET) - STRIPE - 7);
    const __m512i prime = _mm512_set1_epi64((long long)P32_1);
    const __m512i low_words = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)(r / 4)));
    const __m512i high_words = _mm512_add_epi32(low_words, _mm512_set1_epi32(1));
    const __m128i right = _mm_cvtsi32_si128((int)(8 * (r % 4))), left = _mm_cvtsi32_si128((int)(32 - 8 * (r % 4)));
    __m512i acc = _mm512_setr_epi64((long long)P32_3, (long long)P64_1, (long long)P64_2, (long long)P64_3,
                                    (long long)P64_4, (long long)P32_2, (long long)P64_5, (long long)P32_1);
    __m512i prev = _mm512_setzero_si512();
    for (size_t k = 0; k < stripes; ++k) {
        // a 4 KiB page ahead: the hardware's prefetchers stop at page boundaries
        _mm_prefetch((const char*)(in + STRIPE * k + PREFETCH), _MM_HINT_T0);
        __m512i stripe = _mm512_loadu_si512(in + STRIPE * k);
        acc = accumulate(acc, stripe, keys[k % STRIPES_PER_BLOCK]);
        if (k % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1) acc = scramble(acc, scramble_key, prime);
        if (r == 0 ? k >= k0 : k > k0) {
            size_t m = k - k0 - (r != 0);
            if (m < blocks) {
                __m512i block = stripe;
                if (r != 0) {
                    __m512i low = _mm512_permutex2var_epi32(prev, low_words, stripe);
                    __m512i high = _mm512_permutex2var_epi32(prev, high_words, stripe);
                    block = _mm512_or_si512(_mm512_srl_epi32(low, right), _mm512_sll_epi32(high, left));
                }
                _mm512_stream_si512((__m512i*)(dst + STRIPE * m), block);
            }
        }
        prev = stripe;
    }
    __m512i last = _mm512_loadu_si512(in + len - STRIPE);
    acc = accumulate(acc, last, last_key);
    // The rest of the target (at most 128 bytes) from the registers: the last stripe taken in order
    // (in[64(stripes - 1), 64 stripes)) and the last 64 bytes, which reach the end.
    alignas(64) unsigned char tail[2 * STRIPE];
    const size_t tail_start = STRIPE * (stripes - 1), done = head + STRIPE * blocks;
    _mm512_store_si512(tail, prev);
    _mm512_storeu_si512(tail + (len - STRIPE - tail_start), last);
    memcpy(dst + STRIPE * blocks, tail + (done - tail_start), len - done);
    _mm_sfence();   // the streamed stores are ordered before whatever the caller does next
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, acc);
    return Hash128{merge(lanes, SECRET + 11, (uint64_t)len * P64_1),
                   merge(lanes, SECRET + sizeof(SECRET) - sizeof(lanes) - 11, ~((uint64_t)len * P64_2))};
}

static bool have_avx512() {
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes;
}
#endif

int kv_copy_hash_fused_available() {
#if KV_FUSED
    return have_avx512();
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
// was read. With `fused` set, a record that copy_hash_fused can take is read that way (2). Any other
// is copied chunk by chunk: with fd >= 0 the records are values in an LMDB map of that file (page
// size psize), and a page in overflow pages is read from the file with pread, the kernel's copy out
// of the page cache (1); any other page, the rest of one whose pread came up short, and every page
// when fd < 0, is copied from the map (0). Returns 0, or -1 when xxhash could not allocate its state
// (nothing copied).
int kv_copy_hash(const XxhFunctions* x, int fused, int fd, int64_t psize, int64_t n, const unsigned char* const* values,
                      const unsigned char* const* heads, const int64_t* head_lens,
                      const unsigned char* const* srcs, unsigned char* const* dsts, int64_t nbytes, int64_t chunk,
                      unsigned char* digests, unsigned char* how) {
    void* state = x->create();
    if (!state) return -1;
#if KV_FUSED
    fused = fused && have_avx512();
#else
    fused = 0;
#endif
    for (int64_t i = 0; i < n; ++i) {
#if KV_FUSED
        int64_t len = head_lens[i] + nbytes;
        if (fused && heads[i] + head_lens[i] == srcs[i] && fused_fits(len, nbytes, dsts[i])) {
            put_digest(copy_hash_fused(heads[i], (size_t)len, (size_t)head_lens[i], dsts[i]), digests + 16 * i);
            how[i] = 2;
            continue;
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
    x->release(state);
    return 0;
}

}
