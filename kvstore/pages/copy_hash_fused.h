// The one-pass read of copy_hash.cpp, for one instruction set: included once per set, inside a
// namespace that defines KV_TARGET (the set's target attribute) and `Ops`, its operations on a
// 64-byte stripe held in registers (V): load, accumulate and scramble (xxh3's), join (bytes
// [r, r + 64) of two stripes, r set by Ops::Join), stream (a non-temporal store to an aligned
// target), store and lanes. Uses copy_hash.cpp's constants and merge.

// The xxh3-128 of in[0, len) (len > 240: xxh3's long form, default secret), copying in[head, len)
// to dst (64-byte aligned) on the way. Stripe k is in[64k, 64k + 64); target block m, in[head + 64m,
// head + 64m + 64), is the last 64 - r bytes of stripe head/64 + m and the first r of the next one
// (r = head % 64), joined in registers.
KV_TARGET static Hash128 copy_hash_fused(const unsigned char* in, size_t len, size_t head, unsigned char* dst) {
    const size_t n = len - head;
    const size_t stripes = (len - 1) / STRIPE;   // taken in order; then the last 64 bytes once more
    const size_t k0 = head / STRIPE, r = head % STRIPE;
    size_t blocks = stripes - k0 - (r != 0);     // target blocks written from the stripes
    if (blocks > n / STRIPE) blocks = n / STRIPE;
    Ops::V keys[STRIPES_PER_BLOCK];
    for (size_t j = 0; j < STRIPES_PER_BLOCK; ++j) keys[j] = Ops::load(SECRET + 8 * j);
    const Ops::V scramble_key = Ops::load(SECRET + sizeof(SECRET) - STRIPE);
    const Ops::V last_key = Ops::load(SECRET + sizeof(SECRET) - STRIPE - 7);
    const Ops::Join join(r);
    alignas(64) static const uint64_t start[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    Ops::V acc = Ops::load((const unsigned char*)start), prev = acc;
    for (size_t k = 0; k < stripes; ++k) {
        // a 4 KiB page ahead: the hardware's prefetchers stop at page boundaries
        _mm_prefetch((const char*)(in + STRIPE * k + PREFETCH), _MM_HINT_T0);
        Ops::V stripe = Ops::load(in + STRIPE * k);
        acc = Ops::accumulate(acc, stripe, keys[k % STRIPES_PER_BLOCK]);
        if (k % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1) acc = Ops::scramble(acc, scramble_key);
        if (r == 0 ? k >= k0 : k > k0) {
            size_t m = k - k0 - (r != 0);
            if (m < blocks) Ops::stream(dst + STRIPE * m, r == 0 ? stripe : join(prev, stripe));
        }
        prev = stripe;
    }
    Ops::V last = Ops::load(in + len - STRIPE);
    acc = Ops::accumulate(acc, last, last_key);
    // The rest of the target (at most 128 bytes) from the registers: the last stripe taken in order
    // (in[64(stripes - 1), 64 stripes)) and the last 64 bytes, which reach the end.
    alignas(64) unsigned char tail[2 * STRIPE];
    const size_t tail_start = STRIPE * (stripes - 1), done = head + STRIPE * blocks;
    Ops::store(tail, prev);
    Ops::store(tail + (len - STRIPE - tail_start), last);
    memcpy(dst + STRIPE * blocks, tail + (done - tail_start), len - done);
    _mm_sfence();   // the streamed stores are ordered before whatever the caller does next
    alignas(64) uint64_t lanes[8];
    Ops::store((unsigned char*)lanes, acc);
    return Hash128{merge(lanes, SECRET + 11, (uint64_t)len * P64_1),
                   merge(lanes, SECRET + sizeof(SECRET) - sizeof(lanes) - 11, ~((uint64_t)len * P64_2))};
}

// n bytes (a multiple of 64) from src to dst (64-byte aligned), with non-temporal stores.
KV_TARGET static void stream_copy(unsigned char* dst, const unsigned char* src, size_t n) {
    for (size_t a = 0; a < n; a += STRIPE) {
        _mm_prefetch((const char*)(src + a + PREFETCH), _MM_HINT_T0);
        Ops::stream(dst + a, Ops::load(src + a));
    }
}
