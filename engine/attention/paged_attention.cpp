// Paged attention on the CPU, reading K and V where they lie in the hot tier's pages (and in the
// warm tier's, for pages a long sequence spilled there). Built by engine/attention/native.py with
// the system's C++ compiler for this machine (-O3 -march=native -fopenmp) and called through ctypes:
// no PyTorch headers, a build of about a second. Float32 only; GCC/Clang vector extensions, so
// that the same source vectorizes to AVX-512, AVX2 or NEON.
//
// One call runs one layer of one step. Work items are (sequence, KV head, block of query tokens,
// range of keys); a block's rows are its tokens times the KV head's query heads, so each key is
// read once for all the heads that share it. Keys are taken in tiles of KT (the next tile
// prefetched): scores by a register-blocked micro-kernel with the rows in vector lanes (each key
// element broadcast; a decode's few rows take dot products instead), an online softmax (running
// max and sum a row, vectorized across rows), then P.V accumulated into the rows; a block's rows go
// through the three a group at a time, so that the group's scores stay in L1. When there are
// too few items to keep every thread busy, key ranges are split and the splits merged by their
// log-sum-exp.
//
// Causality is bottom-right: query j of a sequence with q_len queries and n keys sees keys
// 0 .. n - q_len + j.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#include "simd.h"

// A query block takes ROWS rows, or WIDE_ROWS when its sequence's cached prefix is at least WIDE_PREFIX
// times its queries (a question after a long document): the prefix's K and V are then read once for
// twice the rows, while a prefill keeps the smaller blocks that balance its causal triangle.
enum { KT = 64, KV = KT / VL, ROWS = 96, WIDE_ROWS = 192, WIDE_PREFIX = 8, MAX_ROWS = WIDE_ROWS, MIN_SPLIT = 256 };
// keys a score block takes (simd.h's VREGS), so that its 2 x SKEYS accumulators stay in registers: 8
// with AVX-512 (32 registers), 4 with AVX2 (16; 6 measured no faster)
enum { SKEYS = VREGS >= 32 ? 8 : 4 };
// rows a group takes through scores, softmax and P.V in turn (a multiple of VL)
enum { GROUP_ROWS = 2 * VL };

struct Args {
    const float *q; int64_t qstride; float *out;   // q: qstride elements between tokens, head_dim between heads
    const float *kb, *vb; int64_t pstride;     // hot K and V planes, elements between pages
    const float *wkb, *wvb; int64_t wpstride;  // warm (page-first) K and V of layer 0 of slot 0, elements between slots
    int nseq; const int32_t *qo, *kvlen, *pindptr, *pages, *nwarm;
    int nh, kvh, d, ps, group; float scale;
    int pshift;   // log2(ps) when ps is a power of two (always, from the engine), else -1
};

// part: where a split item keeps its rows' acc, m and l for the merge (floats into the call's part buffer,
// rows x (d + 2)); -1 for an item that is not split
struct Item { int seq, head, q0, q1, k0, k1, split; int64_t part; };

struct Scratch { float *Q, *Qt, *S, *acc, *m, *l, *pos; const float **kp, **vp; };

// a thread's scratch floats, kept between calls (the pool's threads live as long as the process)
static float *scratch(size_t floats) {
    static thread_local float *buf = NULL;
    static thread_local size_t cap = 0;
    if (floats > cap) {
        free(buf);
        size_t bytes = (sizeof(float) * floats + 63) / 64 * 64;
        buf = (float *)aligned_alloc(64, bytes);
        cap = floats;
    }
    return buf;
}

static inline const float *row_ptr(const Args &a, int seq, int tok, int head, int which) {
    // a shift and a mask, not a division: this runs for every key of every tile (twice, with the prefetch)
    int pg = a.pshift >= 0 ? tok >> a.pshift : tok / a.ps, off = a.pshift >= 0 ? tok & (a.ps - 1) : tok % a.ps;
    int32_t id = a.pages[a.pindptr[seq] + pg];
    const float *base = pg < a.nwarm[seq] ? (which ? a.wvb : a.wkb) + (int64_t)id * a.wpstride
                                          : (which ? a.vb : a.kb) + (int64_t)id * a.pstride;
    return base + (int64_t)off * a.kvh * a.d + (int64_t)head * a.d;
}

// online softmax of scores by rows (S[r][t], a decode's few rows): P = exp(S - running max), masked
// keys 0; what was accumulated is rescaled
template <int D16>
static void softmax_rows(Scratch &w, int rows, int first_pos, int g, int t0, int tn) {
    enum { DV = D16 * 16 / VL };
    const int d = D16 * 16;
    const vf lane = iota();
    for (int r = 0; r < rows; r++) {
        int pos = first_pos + r / g;
        int vis = pos - t0 + 1 < tn ? pos - t0 + 1 : tn;
        float *srow = w.S + r * KT;
        if (vis <= 0) { memset(srow, 0, sizeof(float) * KT); continue; }
        vf sv[KV], vm = bc(-INFINITY), vv = bc((float)vis);
        for (int j = 0; j < KV; j++) {
            sv[j] = ld(srow + VL * j);
            if (vis < KT) sv[j] = (lane + (float)(VL * j)) < vv ? sv[j] : bc(-INFINITY);
            vm = sv[j] > vm ? sv[j] : vm;
        }
        float mx = hmax(vm);
        float m_new = mx > w.m[r] ? mx : w.m[r];
        float corr = expf(w.m[r] - m_new);
        vf sum = (vf){};
        for (int j = 0; j < KV; j++) {
            vf p = vexp(sv[j] - m_new);
            if (vis < KT) p = (lane + (float)(VL * j)) < vv ? p : (vf){};
            st(srow + VL * j, p);
            sum += p;
        }
        w.l[r] = w.l[r] * corr + hsum(sum);
        w.m[r] = m_new;
        if (corr != 1.0f) {
            float *acc = w.acc + (int64_t)r * d;
            for (int j = 0; j < DV; j++) st(acc + VL * j, ld(acc + VL * j) * corr);
        }
    }
}

// scores by keys for NG groups of VL rows at rows0 and keys tb..tb+SKEYS-1: St[t][r] = Q[r] . K[t], the
// rows in lanes (Qt), each key element broadcast; keys past tn read a zero row
template <int D16, int NG>
static void scores_block(Scratch &w, int R16, int rows0, int tb, int tn) {
    static const float zero[256] = {0};
    const int d = D16 * 16;
    const float *k[SKEYS];
    for (int i = 0; i < SKEYS; i++) k[i] = tb + i < tn ? w.kp[tb + i] : zero;
    vf acc[NG][SKEYS];
    for (int gi = 0; gi < NG; gi++)
        for (int i = 0; i < SKEYS; i++) acc[gi][i] = (vf){};
    for (int dd = 0; dd < d; dd++) {
        vf q[NG];
        for (int gi = 0; gi < NG; gi++) {
            q[gi] = ld(w.Qt + dd * R16 + rows0 + VL * gi);
            IN_REG(q[gi]);
        }
        for (int i = 0; i < SKEYS; i++) {
            vf kb = bc(k[i][dd]);
            for (int gi = 0; gi < NG; gi++) acc[gi][i] += q[gi] * kb;
        }
    }
    for (int gi = 0; gi < NG; gi++)
        for (int i = 0; i < SKEYS; i++) st(w.S + (tb + i) * R16 + rows0 + VL * gi, acc[gi][i]);
}

// scores of rows r_begin .. r_end - 1 (multiples of VL) for the tile's keys
template <int D16>
static void scores_t(Scratch &w, int R16, int r_begin, int r_end, int tn) {
    for (int tb = 0; tb < tn; tb += SKEYS) {
        int r0 = r_begin;
        for (; r0 + 2 * VL <= r_end; r0 += 2 * VL) scores_block<D16, 2>(w, R16, r0, tb, tn);
        if (r0 < r_end) scores_block<D16, 1>(w, R16, r0, tb, tn);
    }
}

// online softmax of scores by keys, VL rows at a time in lanes: masked keys (past a row's position, or
// past tn) get P = 0; rows whose running max rises have their accumulators rescaled
template <int D16>
static void softmax_t(Scratch &w, int R16, int r_begin, int r_end, int t0, int tn) {
    enum { DV = D16 * 16 / VL };
    const int d = D16 * 16;
    const vf ninf = bc(-INFINITY);
    for (int r0 = r_begin; r0 < r_end; r0 += VL) {
        vf pos = ld(w.pos + r0), m = ld(w.m + r0), mx = ninf;
        for (int t = 0; t < tn; t++) {
            float *sp = w.S + t * R16 + r0;
            vf sv = pos >= (float)(t0 + t) ? ld(sp) : ninf;
            st(sp, sv);
            mx = sv > mx ? sv : mx;
        }
        vf m_new = mx > m ? mx : m;
        vf corr = m_new == ninf ? bc(1.0f) : vexp(m - m_new);
        vf sum = (vf){};
        for (int t = 0; t < tn; t++) {
            float *sp = w.S + t * R16 + r0;
            vf sv = ld(sp);
            vf p = sv == ninf ? (vf){} : vexp(sv - m_new);
            st(sp, p);
            sum += p;
        }
        for (int t = tn; t < KT; t++) st(w.S + t * R16 + r0, (vf){});
        st(w.l + r0, ld(w.l + r0) * corr + sum);
        st(w.m + r0, m_new);
        for (int i = 0; i < VL; i++)
            if (corr[i] != 1.0f) {
                float *acc = w.acc + (int64_t)(r0 + i) * d;
                for (int j = 0; j < DV; j++) st(acc + VL * j, ld(acc + VL * j) * corr[i]);
            }
    }
}

// acc[r] += sum_t P[r][t] V[t] for rows r_begin .. r_end - 1 (multiples of 4); P is S, prs floats
// between rows and pts between keys (by rows for a decode, by keys otherwise)
template <int D16>
static void pv(Scratch &w, int r_begin, int r_end, int tn, int prs, int pts) {
    enum { DV = D16 * 16 / VL };
    const int d = D16 * 16;
    // RB rows by CV vectors of columns a pass, their accumulators in registers, and the value row's
    // CV vectors too where they fit: with AVX-512 a whole row (CV = DV up to 128 dims); with 16
    // registers a part of it, so that each value load serves two or four rows
    enum { CV = VREGS >= 32 ? DV : DV % 4 == 0 ? 4 : DV % 3 == 0 ? 3 : DV % 2 == 0 ? 2 : 1,
           RB = CV <= VREGS / 8 ? 4 : CV <= VREGS / 4 ? 2 : 1, KEEP_V = CV * (RB + 1) + 1 <= VREGS };
    for (int c0 = 0; c0 < d; c0 += CV * VL)
        for (int r0 = r_begin; r0 < r_end; r0 += RB) {
            vf acc[RB][CV];
            for (int i = 0; i < RB; i++)
                for (int j = 0; j < CV; j++) acc[i][j] = ld(w.acc + (int64_t)(r0 + i) * d + c0 + VL * j);
            for (int t = 0; t < tn; t++) {
                vf v[CV];
                const float *vr = w.vp[t] + c0;
                for (int j = 0; j < CV; j++) {
                    v[j] = ld(vr + VL * j);
                    if (KEEP_V) IN_REG(v[j]);
                }
                for (int i = 0; i < RB; i++) {
                    vf p = bc(w.S[(r0 + i) * prs + t * pts]);
                    for (int j = 0; j < CV; j++) acc[i][j] += p * v[j];
                }
            }
            for (int i = 0; i < RB; i++)
                for (int j = 0; j < CV; j++) st(w.acc + (int64_t)(r0 + i) * d + c0 + VL * j, acc[i][j]);
        }
}

template <int D16>
static void run_item(const Args &a, const Item &it, Scratch &w, float *part) {
    enum { DV = D16 * 16 / VL };   // vectors a row
    const int d = D16 * 16, g = a.group;
    const int q_len = a.qo[it.seq + 1] - a.qo[it.seq], n = a.kvlen[it.seq];
    const int rows = (it.q1 - it.q0) * g, rows4 = (rows + 3) & ~3;
    // the block's query rows, scaled, zero-padded to a multiple of 4 (16 for the transposed scores)
    for (int r = 0; r < ((rows + 15) & ~15); r++) {
        float *dst = w.Q + (int64_t)r * d;
        if (r >= rows) { memset(dst, 0, sizeof(float) * d); continue; }
        int tok = a.qo[it.seq] + it.q0 + r / g, head = it.head * g + r % g;
        const float *src = a.q + (int64_t)tok * a.qstride + (int64_t)head * d;
        for (int j = 0; j < DV; j++) st(dst + VL * j, ld(src + VL * j) * a.scale);
    }
    const int R16 = (rows + 15) & ~15;
    for (int r = 0; r < R16; r++) {
        w.m[r] = -INFINITY;
        w.l[r] = 0.0f;
        w.pos[r] = r < rows ? (float)(n - q_len + it.q0 + r / g) : -1.0f;   // the last key row r sees
    }
    if (rows4 > 4)   // Qt[dd][r]: the rows in lanes, for scores by keys
        for (int dd = 0; dd < d; dd++)
            for (int r = 0; r < R16; r++) w.Qt[dd * R16 + r] = r < rows ? w.Q[(int64_t)r * d + dd] : 0.0f;
    memset(w.acc, 0, sizeof(float) * ((rows + 15) & ~15) * d);
    const int last_pos = n - q_len + it.q1 - 1;            // the block's last query sees keys up to here
    const int kend = it.k1 < last_pos + 1 ? it.k1 : last_pos + 1;
    for (int t0 = it.k0; t0 < kend; t0 += KT) {
        const int tn = kend - t0 < KT ? kend - t0 : KT;
        for (int t = 0; t < tn; t++) {
            w.kp[t] = row_ptr(a, it.seq, t0 + t, it.head, 0);
            w.vp[t] = row_ptr(a, it.seq, t0 + t, it.head, 1);
        }
        // the next tile's keys and values start coming from memory while this one is computed
        for (int t = t0 + KT; t < kend && t < t0 + 2 * KT; t++) {
            const char *k = (const char *)row_ptr(a, it.seq, t, it.head, 0);
            const char *v = (const char *)row_ptr(a, it.seq, t, it.head, 1);
            for (int off = 0; off < d * 4; off += 64) {
                __builtin_prefetch(k + off, 0, 2);
                __builtin_prefetch(v + off, 0, 2);
            }
        }
        if (rows4 == 4) {   // a decode (up to 4 rows): dot products
            const float *q0 = w.Q;
            for (int t = 0; t < tn; t++) {
                const float *k = w.kp[t];
                vf kv[DV];
                for (int j = 0; j < DV; j++) {
                    kv[j] = ld(k + VL * j);
                    if (DV + 2 <= VREGS) IN_REG(kv[j]);
                }
                for (int i = 0; i < 4; i++) {
                    vf acc = ld(q0 + i * d) * kv[0];
                    for (int j = 1; j < DV; j++) acc += ld(q0 + i * d + VL * j) * kv[j];
                    w.S[i * KT + t] = hsum(acc);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int t = tn; t < KT; t++) w.S[i * KT + t] = 0.0f;
            softmax_rows<D16>(w, rows, n - q_len + it.q0, g, t0, tn);
            pv<D16>(w, 0, 4, tn, KT, 1);
            continue;
        }
        // the rows a group at a time (scores, softmax, P.V), so that the group's scores stay in the
        // L1 cache between the three and the tile's keys and values in L2 across the groups
        for (int rg = 0; rg < R16; rg += GROUP_ROWS) {
            const int re = rg + GROUP_ROWS < R16 ? rg + GROUP_ROWS : R16;
            scores_t<D16>(w, R16, rg, re, tn);
            softmax_t<D16>(w, R16, rg, re, t0, tn);
            if (rg < rows4) pv<D16>(w, rg, re < rows4 ? re : rows4, tn, 1, R16);
        }
    }
    if (it.part >= 0) {   // a split: keep acc, m and l for the merge
        float *p = part + it.part;
        for (int r = 0; r < rows; r++) {
            memcpy(p + (int64_t)r * (d + 2), w.acc + (int64_t)r * d, sizeof(float) * d);
            p[(int64_t)r * (d + 2) + d] = w.m[r];
            p[(int64_t)r * (d + 2) + d + 1] = w.l[r];
        }
        return;
    }
    for (int r = 0; r < rows; r++) {
        int tok = a.qo[it.seq] + it.q0 + r / g, head = it.head * g + r % g;
        float *dst = a.out + ((int64_t)tok * a.nh + head) * d;
        float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
        const float *acc = w.acc + (int64_t)r * d;
        for (int j = 0; j < DV; j++) st(dst + VL * j, ld(acc + VL * j) * inv);
    }
}

// the splits of one (sequence, head, query block): items first .. first+count-1
static void merge_splits(const Args &a, const Item *items, int first, int count, const float *part) {
    const Item &it = items[first];
    const int d = a.d, g = a.group, rows = (it.q1 - it.q0) * g;
    for (int r = 0; r < rows; r++) {
        float M = -INFINITY;
        for (int s = 0; s < count; s++) {
            float m = part[items[first + s].part + (int64_t)r * (d + 2) + d];
            M = m > M ? m : M;
        }
        int tok = a.qo[it.seq] + it.q0 + r / g, head = it.head * g + r % g;
        float *dst = a.out + ((int64_t)tok * a.nh + head) * d;
        for (int x = 0; x < d; x++) dst[x] = 0.0f;
        float L = 0.0f;
        for (int s = 0; s < count; s++) {
            const float *p = part + items[first + s].part + (int64_t)r * (d + 2);
            if (p[d + 1] == 0.0f) continue;
            float wgt = expf(p[d] - M);
            L += p[d + 1] * wgt;
            for (int x = 0; x < d; x++) dst[x] += p[x] * wgt;
        }
        float inv = L > 0.0f ? 1.0f / L : 0.0f;
        for (int x = 0; x < d; x++) dst[x] *= inv;
    }
}

extern "C" {

int kv_attention_version(void) { return 2; }

// q: [tokens, nh, d] with qstride elements between tokens; out: [tokens, nh, d] contiguous; hot K/V planes: page p's token t of head h at kb + p*pstride + (t*kvh + h)*d;
// warm likewise from wkb/wvb with wpstride. Sequence i: queries qo[i]..qo[i+1]-1, kvlen[i] keys on pages
// pages[pindptr[i]..], the first nwarm[i] of them warm slots. Runs on `threads` threads. Returns 0, or -1 for
// a head_dim not built here (multiples of 16 up to 128, 192 and 256).
int kv_paged_attention(const float *q, int64_t qstride, float *out, const float *kb, const float *vb, int64_t pstride,
                       const float *wkb, const float *wvb, int64_t wpstride, int nseq, const int32_t *qo,
                       const int32_t *kvlen, const int32_t *pindptr, const int32_t *pages, const int32_t *nwarm,
                       int nh, int kvh, int d, int ps, float scale, int threads) {
    if (d % 16 || d < 16 || (d > 128 && d != 192 && d != 256)) return -1;
    if (threads < 1) threads = 1;
    Args a = {q, qstride, out, kb, vb, pstride, wkb, wvb, wpstride, nseq, qo, kvlen, pindptr, pages, nwarm,
              nh, kvh, d, ps, nh / kvh, scale, ps > 0 && (ps & (ps - 1)) == 0 ? __builtin_ctz(ps) : -1};
    const int g = a.group;
    // query tokens a block of sequence i takes
    auto block_of = [&](int i) {
        int q_len = qo[i + 1] - qo[i], rows = kvlen[i] - q_len >= WIDE_PREFIX * q_len ? WIDE_ROWS : ROWS;
        return rows / g > 0 ? rows / g : 1;
    };
    // blocks without splits, then split key ranges while there are too few items for the threads
    int blocks = 0;
    for (int i = 0; i < nseq; i++) {
        int qb = block_of(i);
        blocks += (qo[i + 1] - qo[i] + qb - 1) / qb * kvh;
    }
    int target = 8 * threads, nsplit_max = blocks >= target ? 1 : (target + blocks - 1) / blocks;
    int cap = blocks * nsplit_max + 1;
    Item *items = (Item *)malloc(sizeof(Item) * cap);
    int *groups = (int *)malloc(sizeof(int) * (blocks + 1));
    int ni = 0, ng = 0;
    int64_t part_floats = 0;
    for (int i = 0; i < nseq; i++) {
        int q_len = qo[i + 1] - qo[i], n = kvlen[i], qb = block_of(i);
        for (int h = 0; h < kvh; h++)
            for (int b0 = 0; b0 < q_len; b0 += qb) {
                int b1 = b0 + qb < q_len ? b0 + qb : q_len;
                int keys = n - q_len + b1;
                int ns = nsplit_max;
                if (ns > 1) {
                    int by_len = keys / MIN_SPLIT;
                    ns = ns < by_len ? ns : by_len;
                    if (ns < 1) ns = 1;
                }
                groups[ng++] = ni;
                int step = (keys + ns - 1) / ns;
                step = (step + KT - 1) / KT * KT;
                for (int s = 0; s < ns; s++) {
                    int k0 = s * step, k1 = k0 + step < keys ? k0 + step : keys;
                    if (k0 >= keys) break;
                    items[ni++] = (Item){i, h, b0, b1, k0, k1, s, ns > 1 ? part_floats : -1};
                    if (ns > 1) part_floats += (int64_t)(b1 - b0) * g * (d + 2);
                }
            }
    }
    groups[ng] = ni;
    float *part = part_floats ? (float *)malloc(sizeof(float) * (size_t)part_floats) : NULL;
#pragma omp parallel num_threads(threads)
    {
        Scratch w;
        const int rows4 = MAX_ROWS + 4;
        float *buf = scratch((size_t)(rows4 * d + d * rows4 + rows4 * KT + rows4 * d + 3 * rows4));
        w.Q = buf; w.Qt = w.Q + rows4 * d; w.S = w.Qt + d * rows4; w.acc = w.S + rows4 * KT;
        w.m = w.acc + rows4 * d; w.l = w.m + rows4; w.pos = w.l + rows4;
        const float *ptrs[2 * KT];
        w.kp = ptrs; w.vp = ptrs + KT;
#pragma omp for schedule(dynamic, 1)
        for (int x = 0; x < ni; x++) {
            switch (d / 16) {
            case 1: run_item<1>(a, items[x], w, part); break;
            case 2: run_item<2>(a, items[x], w, part); break;
            case 3: run_item<3>(a, items[x], w, part); break;
            case 4: run_item<4>(a, items[x], w, part); break;
            case 5: run_item<5>(a, items[x], w, part); break;
            case 6: run_item<6>(a, items[x], w, part); break;
            case 7: run_item<7>(a, items[x], w, part); break;
            case 8: run_item<8>(a, items[x], w, part); break;
            case 12: run_item<12>(a, items[x], w, part); break;
            default: run_item<16>(a, items[x], w, part); break;
            }
        }
        if (part_floats) {
#pragma omp for schedule(dynamic, 1)
            for (int x = 0; x < ng; x++)
                if (groups[x + 1] - groups[x] > 1 || items[groups[x]].part >= 0)
                    merge_splits(a, items, groups[x], groups[x + 1] - groups[x], part);
        }
    }
    free(part);
    free(groups);
    free(items);
    return 0;
}

}  // extern "C"
