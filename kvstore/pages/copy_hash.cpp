// The cold tier's checksummed copy, a batch of records in one call (kvstore/pages/native_copy.py).
//
// For each record: the xxh3-128 of its head (the bytes between the checksum and the page), then its
// page copied out chunk by chunk, each chunk hashed right after it is copied, while it is still in
// cache, so that the digest covers exactly the bytes delivered. xxhash's functions come from the
// caller (python-xxhash's, or libxxhash, found at run time), so this library links nothing and builds anywhere.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <unistd.h>

extern "C" {

struct Hash128 { uint64_t low64, high64; };   // XXH128_hash_t

struct XxhFunctions {                          // XXH3_createState and friends
    void* (*create)();
    int (*release)(void*);
    int (*reset)(void*);
    int (*update)(void*, const void*, size_t);
    Hash128 (*digest)(const void*);
};

int kv_copy_hash_version() { return 3; }

static void put_digest(Hash128 h, unsigned char* out) {   // xxhash's canonical form
    for (int b = 0; b < 8; ++b) {
        out[b] = (unsigned char)(h.high64 >> (56 - 8 * b));
        out[8 + b] = (unsigned char)(h.low64 >> (56 - 8 * b));
    }
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
// copied to dsts[i]; its digest, in xxhash's canonical form, into digests[16 * i]. With fd >= 0 the
// records are values in an LMDB map of that file (page size psize): a page in overflow pages is read
// from the file with pread, the kernel's copy out of the page cache (no page faults on the map, no
// TLB misses on its 4 KiB pages), each chunk hashed after it landed; any other page, the rest of one
// whose pread came up short, and every page when fd < 0, is copied from the map. from_file[i]: 1
// where page i came from the file. 0, or -1 when xxhash could not allocate its state (nothing copied).
int kv_copy_hash(const XxhFunctions* x, int fd, int64_t psize, int64_t n, const unsigned char* const* values,
                      const unsigned char* const* heads, const int64_t* head_lens,
                      const unsigned char* const* srcs, unsigned char* const* dsts, int64_t nbytes, int64_t chunk,
                      unsigned char* digests, unsigned char* from_file) {
    void* state = x->create();
    if (!state) return -1;
    for (int64_t i = 0; i < n; ++i) {
        x->reset(state);
        x->update(state, heads[i], (size_t)head_lens[i]);
        int64_t offset = fd >= 0 ? lmdb_value_offset(values[i], psize) : -1;
        if (offset >= 0) offset += srcs[i] - values[i];
        from_file[i] = offset >= 0;
        for (int64_t a = 0; a < nbytes; a += chunk) {
            size_t len = (size_t)(nbytes - a < chunk ? nbytes - a : chunk);
            if (offset < 0 || pread(fd, dsts[i] + a, len, offset + a) != (ssize_t)len) {
                offset = -1;
                from_file[i] = 0;
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
