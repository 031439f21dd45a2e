/* SCAPE's CPU fast path: the fused step's O(k) passes and the mask codings as plain C loops.
 *
 * Loaded by ``native.py`` (compiled on first use with the system C compiler, cached by source
 * hash), called through ctypes on raw pointers of contiguous CPU tensors. Every function here
 * mirrors a torch sequence in ``fused.py`` / ``mask_coding.py``, which stays the reference and
 * the path for CUDA; ``tests/test_scape_native.py`` checks each against it.
 *
 * Why C: at 10% density a step touches ~5M mask positions. Through torch each of its ~20
 * index ops is a separate pass over int64 index vectors (the gathers, scatters, the
 * Elias-Fano field reads); here each phase is one loop over the indices, with no temporaries.
 *
 * Compiled with -ffp-contract=off: a multiply and an add stay two roundings, as the reference
 * path's separate torch ops round them (no silent FMA contraction). Little-endian hosts only
 * (the loader checks): bit streams are little-endian inside bytes and fields (kernels.pack_bits).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;
typedef uint64_t u64;
typedef uint8_t u8;

/* segment kinds, as mask_coding's table rows give them */
enum { K_ALL = 0, K_BITMAP = 1, K_INDICES = 2, K_EF = 3 };

/* ``width`` (<= 33) bits at bit ``pos`` of ``buf`` (``len`` bytes), little-endian */
static inline u64 read_field(const u8 *buf, i64 len, i64 pos, int width) {
    i64 byte = pos >> 3;
    u64 w = 0;
    if (byte + 8 <= len) {
        memcpy(&w, buf + byte, 8);
    } else {
        for (int i = 0; i < 8 && byte + i < len; i++) w |= (u64)buf[byte + i] << (8 * i);
    }
    w >>= (pos & 7);
    return width >= 64 ? w : (w & ((1ULL << width) - 1));
}

/* OR ``value`` (< 2^width, width <= 33) into the zeroed bit stream ``buf`` at bit ``pos`` */
static inline void write_field(u8 *buf, i64 len, i64 pos, int width, u64 value) {
    i64 byte = pos >> 3;
    u64 v = value << (pos & 7);
    int nbytes = ((pos & 7) + width + 7) >> 3;
    for (int i = 0; i < nbytes && byte + i < len; i++) buf[byte + i] |= (u8)(v >> (8 * i));
}

/* Decode a whole mask. ``tab``: 8 int64 per segment, in flat order:
 *   kind, flat_start, numel, k, width, low (byte offset of the field stream in ``buf``),
 *   high (byte offset of the bitmap / upper bit vector), high_bytes.
 * Writes the bool mask (``total`` bytes) and the sorted flat indices of its ones into ``idx``
 * (room for ``cap``). Returns the number of ones, or -1 - s when segment s is corrupt (a count,
 * position or length that does not match its plan): nothing is written out of bounds. */
i64 scape_mask_decode(i64 nseg, const i64 *tab, const u8 *buf, i64 len, u8 *mask, i64 total,
                      i64 *idx, i64 cap) {
    memset(mask, 0, (size_t)total);
    i64 at = 0;
    for (i64 s = 0; s < nseg; s++) {
        const i64 *r = tab + 8 * s;
        i64 kind = r[0], flat = r[1], numel = r[2], k = r[3];
        int width = (int)r[4];
        i64 low = r[5], high = r[6], hbytes = r[7];
        if (flat < 0 || numel < 0 || flat + numel > total) return -1 - s;
        if (kind == K_ALL) {
            if (at + numel > cap) return -1 - s;
            memset(mask + flat, 1, (size_t)numel);
            for (i64 i = 0; i < numel; i++) idx[at++] = flat + i;
            continue;
        }
        if (at + k > cap) return -1 - s;
        i64 start = at;
        if (kind == K_BITMAP) {
            if (high + hbytes > len) return -1 - s;
            for (i64 b = 0; b < hbytes; b++) {
                unsigned v = buf[high + b];
                while (v) {
                    i64 p = 8 * b + __builtin_ctz(v);
                    v &= v - 1;
                    if (p >= numel || at - start >= k) return -1 - s;
                    mask[flat + p] = 1;
                    idx[at++] = flat + p;
                }
            }
        } else if (kind == K_INDICES) {
            if (low + ((k * width + 7) >> 3) > len) return -1 - s;
            i64 prev = -1;
            for (i64 j = 0; j < k; j++) {
                i64 p = (i64)read_field(buf, len, 8 * low + j * width, width);
                if (p >= numel || p <= prev) return -1 - s;
                prev = p;
                mask[flat + p] = 1;
                idx[at++] = flat + p;
            }
        } else if (kind == K_EF) {
            if (high + hbytes > len || low + ((k * width + 7) >> 3) > len) return -1 - s;
            i64 j = 0, prev = -1;
            for (i64 b = 0; b < hbytes; b++) {
                unsigned v = buf[high + b];
                while (v) {
                    i64 pos = 8 * b + __builtin_ctz(v);
                    v &= v - 1;
                    if (j >= k) return -1 - s;
                    i64 lo = width ? (i64)read_field(buf, len, 8 * low + j * width, width) : 0;
                    i64 p = ((pos - j) << width) | lo;
                    if (p >= numel || p <= prev) return -1 - s;
                    prev = p;
                    mask[flat + p] = 1;
                    idx[at++] = flat + p;
                    j++;
                }
            }
        } else {
            return -1 - s;
        }
        if (at - start != k) return -1 - s;
    }
    return at;
}

/* Encode an owner's segments. ``tab``: 8 int64 per segment:
 *   kind, start (in ``bits``), numel, k, width, off (byte offset in ``shard``), low_bytes,
 *   high_bytes.
 * ``bits``: the owner's bool mask over its range. Returns 0, or -1 - s when segment s holds
 * another number of ones than its plan says. */
i64 scape_mask_encode(i64 nseg, const i64 *tab, const u8 *bits, u8 *shard, i64 len) {
    memset(shard, 0, (size_t)len);
    for (i64 s = 0; s < nseg; s++) {
        const i64 *r = tab + 8 * s;
        i64 kind = r[0], start = r[1], numel = r[2], k = r[3];
        int width = (int)r[4];
        i64 off = r[5], lbytes = r[6], hbytes = r[7];
        const u8 *b = bits + start;
        if (kind == K_ALL) continue;
        if (kind == K_BITMAP) {
            u8 *out = shard + off;
            for (i64 i = 0; i < numel; i++)
                if (b[i]) out[i >> 3] |= (u8)(1u << (i & 7));
            continue;
        }
        u8 *lowp = shard + off;
        u8 *up = shard + off + lbytes;
        u64 lmask = width >= 64 ? ~0ULL : ((1ULL << width) - 1);
        i64 j = 0;
        for (i64 i = 0; i < numel; i++) {
            if (!b[i]) continue;
            if (j >= k) return -1 - s;
            if (kind == K_INDICES) {
                write_field(lowp, lbytes, j * width, width, (u64)i);
            } else {
                if (width) write_field(lowp, lbytes, j * width, width, (u64)i & lmask);
                i64 u = (i >> width) + j;
                if ((u >> 3) >= hbytes) return -1 - s;
                up[u >> 3] |= (u8)(1u << (u & 7));
            }
            j++;
        }
        if (j != k) return -1 - s;
    }
    return 0;
}

/* The full-size prepare passes, over every tensor (``gtab``: 2 int64 per tensor: gradient
 * pointer, flat offset; ``numels`` per tensor; the gradients are read, not changed):
 *   ADD      e += round(s·g)                                   (Σ e², the new residual's)
 *   GENERAL  e = (β1·m + s·g) + e                              (Σ c²)
 *   CAND     e += round(s·g), and on the own flat range [lo, hi) cand[f - lo] = ρ[f - lo] + e
 * Split over ``nthreads`` threads by contiguous flat ranges (torch's intra-op thread count, from
 * the caller): elementwise, so e and cand do not depend on the split; the double sum is added
 * per thread, then in thread order (fixed for a given thread count). */
enum { P_ADD = 0, P_GENERAL = 1, P_CAND = 2 };

typedef struct {
    int kind;
    i64 ntensor;
    const i64 *gtab, *numels;
    float *e, *rho, *cand;
    const float *m;
    float beta1, s;
    i64 lo, hi;             /* CAND: the own range */
    i64 start, end;         /* this worker's flat range */
    double sq;
} prep_job;

static double prep_span(const prep_job *j, const float *g, float *et, const float *mt, i64 a,
                        i64 b) {
    double sq = 0.0;
    const float s = j->s, beta1 = j->beta1;
    if (j->kind == P_GENERAL) {
#pragma omp simd reduction(+ : sq)
        for (i64 i = a; i < b; i++) {
            float c = mt[i] * beta1 + s * g[i];
            c = c + et[i];
            et[i] = c;
            sq += (double)c * (double)c;
        }
    } else {
#pragma omp simd reduction(+ : sq)
        for (i64 i = a; i < b; i++) {
            float y = et[i] + s * g[i];
            et[i] = y;
            sq += (double)y * (double)y;
        }
    }
    return sq;
}

static void *prep_run(void *arg) {
    prep_job *j = (prep_job *)arg;
    double sq = 0.0;
    for (i64 t = 0; t < j->ntensor; t++) {
        i64 off = j->gtab[2 * t + 1], n = j->numels[t];
        i64 a = j->start - off, b = j->end - off;          /* this worker's part of tensor t */
        a = a < 0 ? 0 : a;
        b = b > n ? n : b;
        if (a >= b) continue;
        const float *g = (const float *)(intptr_t)j->gtab[2 * t];
        float *et = j->e + off;
        const float *mt = j->m ? j->m + off : NULL;
        if (j->kind != P_CAND) {
            sq += prep_span(j, g, et, mt, a, b);
            continue;
        }
        i64 oa = j->lo - off, ob = j->hi - off;             /* the own range, clipped */
        oa = oa < a ? a : (oa > b ? b : oa);
        ob = ob < oa ? oa : (ob > b ? b : ob);
        sq += prep_span(j, g, et, mt, a, oa);
        const float *rt = j->rho + (off - j->lo);
        float *ct = j->cand + (off - j->lo);
        const float s = j->s;
#pragma omp simd reduction(+ : sq)
        for (i64 i = oa; i < ob; i++) {
            float y = et[i] + s * g[i];
            et[i] = y;
            ct[i] = rt[i] + y;
            sq += (double)y * (double)y;
        }
        sq += prep_span(j, g, et, mt, ob, b);
    }
    j->sq = sq;
    return NULL;
}

#define MAX_THREADS 64
#define MIN_PER_THREAD (1 << 18)   /* below this, a thread costs more than it saves */

static double prep_parallel(prep_job base, int nthreads) {
    i64 total = 0;
    for (i64 t = 0; t < base.ntensor; t++) {
        i64 end = base.gtab[2 * t + 1] + base.numels[t];
        total = end > total ? end : total;
    }
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if ((i64)nthreads > total / MIN_PER_THREAD) nthreads = (int)(total / MIN_PER_THREAD);
    if (nthreads < 1) nthreads = 1;
    prep_job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    i64 chunk = (total + nthreads - 1) / nthreads;
    for (int w = 0; w < nthreads; w++) {
        jobs[w] = base;
        jobs[w].start = w * chunk;
        jobs[w].end = (w + 1) * chunk < total ? (w + 1) * chunk : total;
        started[w] = w > 0 && pthread_create(&tid[w], NULL, prep_run, &jobs[w]) == 0;
    }
    prep_run(&jobs[0]);
    double sq = jobs[0].sq;
    for (int w = 1; w < nthreads; w++) {
        if (started[w]) pthread_join(tid[w], NULL);
        else prep_run(&jobs[w]);           /* no thread: the caller does its part */
        sq += jobs[w].sq;
    }
    return sq;
}

static prep_job prep_job_of(int kind, i64 ntensor, const i64 *gtab, const i64 *numels, float *e,
                            const float *m, float beta1, float s) {
    prep_job j;
    memset(&j, 0, sizeof j);
    j.kind = kind;
    j.ntensor = ntensor;
    j.gtab = gtab;
    j.numels = numels;
    j.e = e;
    j.m = m;
    j.beta1 = beta1;
    j.s = s;
    return j;
}

/* Replicated prepare, m's support known (``pidx``: the previous mask's sorted flat indices):
 *   e += round(s·g) on every tensor;  e[pidx] = β1·m[pidx] + s·g[pidx]   (there e_{t-1} = 0).
 * ``ptab``: 4 int64 per segment of pidx: gradient pointer, flat offset, a, b. Returns Σ c²
 * over the whole candidate c (= e on return). */
double scape_prepare_replicated(i64 ntensor, const i64 *gtab, const i64 *numels, float *e,
                                const float *m, const i64 *pidx, i64 kp, const i64 *ptab,
                                i64 npseg, float beta1, float s, int nthreads) {
    double sq = prep_parallel(prep_job_of(P_ADD, ntensor, gtab, numels, e, NULL, 0.0f, s),
                              nthreads);
    (void)kp;
    for (i64 q = 0; q < npseg; q++) {
        const i64 *r = ptab + 4 * q;
        const float *g = (const float *)(intptr_t)r[0];
        i64 off = r[1];
        for (i64 j = r[2]; j < r[3]; j++) {
            i64 i = pidx[j];
            float a = m[i] * beta1;
            float b = s * g[i - off];
            float c = a + b;
            sq += (double)c * (double)c - (double)e[i] * (double)e[i];
            e[i] = c;
        }
    }
    return sq;
}

/* Replicated prepare, m's support unknown (the first step, after a load): the GENERAL pass */
double scape_prepare_replicated_general(i64 ntensor, const i64 *gtab, const i64 *numels,
                                        float *e, const float *m, float beta1, float s,
                                        int nthreads) {
    return prep_parallel(prep_job_of(P_GENERAL, ntensor, gtab, numels, e, m, beta1, s),
                         nthreads);
}

/* Sharded prepare: ρ[i] = β1·m[i] at the owner's m support ``pidx_own`` (indices into the own
 * range [lo, hi), which ρ and m cover); then the CAND pass. Returns Σ ε² (new ε). */
double scape_prepare_sharded(i64 ntensor, const i64 *gtab, const i64 *numels, float *e,
                             float *rho, const float *m, const i64 *pidx_own, i64 kp, i64 lo,
                             i64 hi, float *cand, float beta1, float s, int nthreads) {
    for (i64 j = 0; j < kp; j++) {
        i64 i = pidx_own[j];
        rho[i] = m[i] * beta1;
    }
    prep_job job = prep_job_of(P_CAND, ntensor, gtab, numels, e, NULL, 0.0f, s);
    job.rho = rho;
    job.cand = cand;
    job.lo = lo;
    job.hi = hi;
    return prep_parallel(job, nthreads);
}

/* values[j] = src[idx[j] - base] (a gather: the payload, or the candidate at the mask); returns
 * Σ values² (the mask's share of ‖c‖², for the residual-norm metric) */
double scape_gather(i64 k, const i64 *idx, i64 base, const float *src, float *values) {
    double sq = 0.0;
    for (i64 j = 0; j < k; j++) {
        float v = src[idx[j] - base];
        values[j] = v;
        sq += (double)v * (double)v;
    }
    return sq;
}

/* values[j] = src[idx[j]], then src[idx[j]] = 0: the sharded payload gathered and ε folded,
 * ε = (1-M)⊙x, in one pass; returns Σ values² */
double scape_take(i64 k, const i64 *idx, float *src, float *values) {
    double sq = 0.0;
    for (i64 j = 0; j < k; j++) {
        float v = src[idx[j]];
        values[j] = v;
        src[idx[j]] = 0.0f;
        sq += (double)v * (double)v;
    }
    return sq;
}

/* ĝ from the averaged payload, in place: with t = b[j] (+ ρ[i], sharded, then ρ[i] = 0),
 *   ĝ[j] = (m[i]·(-β1) + t) / (1-β1),   i = idx[j] - base;
 * returns Σ ĝ² (double). */
double scape_ghat(i64 k, const i64 *idx, i64 base, float *b, float *rho, const float *m,
                  float beta1, float d) {
    const float nb = -beta1;
    double sq = 0.0;
    for (i64 j = 0; j < k; j++) {
        i64 i = idx[j] - base;
        float t = b[j];
        if (rho) {
            t = t + rho[i];
            rho[i] = 0.0f;
        }
        float g = m[i] * nb + t;
        g = g / d;
        b[j] = g;
        sq += (double)g * (double)g;
    }
    return sq;
}

/* AdamS on the k mask positions (adams_update_'s ops; the weight decay already applied to θ):
 *   ĝ ← coef·ĝ;  prev = m (or m/bc1);  v = β2·prev² + (1-β2)·ĝ²;  m' = β1·m + (1-β1)·ĝ;
 *   θ ← θ + ns·m' / (sqrt(v)/sqrt(bc2) (adam only) + eps), ns = -step;  ĝ[j] ← m' (the new
 *   momentum); omb1, omb2 = 1-β1, 1-β2.
 * θ: parameters by segment (``ttab``: 4 int64 per segment: pointer, flat offset, a, b, over
 * the index list), read and, when ``out`` is NULL, written back; else the new θ goes to
 * out[j - j0] (a sharded owner's contiguous shard). ``ghat`` holds index-list entries
 * [j0, j0 + k); ``m`` is indexed by flat index - ``base``. ``bias``: 0 none, 1 adam, 2 official.
 * The momentum is set here too: m ← 0 on ``zidx`` (or everywhere, kz < 0), m[i] ← m'.
 * ``work``: room for k floats. Loops: gather m, the arithmetic on contiguous arrays, then θ by
 * segment. */
void scape_adams(const i64 *idx, i64 j0, i64 k, i64 base, float *ghat, float *m, i64 mlen,
                 const i64 *zidx, i64 kz, const i64 *ttab, i64 nseg, float *out, float *work,
                 float coef, int clip, float beta1, float beta2, float omb1, float omb2,
                 float bc1, float sqrt_bc2, float eps, float ns, int bias) {
    const i64 *ix = idx + j0;
    for (i64 j = 0; j < k; j++) work[j] = m[ix[j] - base];
    /* the old momentum is read: m <- 0 off the new mask (on m's old support ``zidx``, indices
     * into m; all of m when its support is unknown, kz < 0), the new values land below */
    if (kz < 0) memset(m, 0, sizeof(float) * (size_t)mlen);
    for (i64 j = 0; j < kz; j++) m[zidx[j]] = 0.0f;
    for (i64 j = 0; j < k; j++) {
        float g = ghat[j];
        if (clip) g = g * coef;
        float mc = work[j];
        float prev = bias == 2 ? mc / bc1 : mc;
        float v = prev * prev;
        v = v * beta2;
        float gg = omb2 * g;
        gg = gg * g;
        v = v + gg;
        float mn = mc * beta1;
        float add = omb1 * g;
        mn = mn + add;
        float den = sqrtf(v);
        if (bias == 1) den = den / sqrt_bc2;
        den = den + eps;
        float upd = ns * mn;
        work[j] = upd / den;
        ghat[j] = mn;
    }
    for (i64 q = 0; q < nseg; q++) {
        const i64 *r = ttab + 4 * q;
        float *theta = (float *)(intptr_t)r[0];
        i64 off = r[1];
        for (i64 j = r[2]; j < r[3]; j++) {
            float *th = theta + (idx[j] - off);
            float nt = *th + work[j - j0];
            if (out) out[j - j0] = nt; else *th = nt;
            m[idx[j] - base] = ghat[j - j0];
        }
    }
}

/* how many of ``idx``'s positions are set in the bool ``mask`` (the masks' overlap metric) */
i64 scape_count_at(const u8 *mask, const i64 *idx, i64 k) {
    i64 n = 0;
    for (i64 j = 0; j < k; j++) n += mask[idx[j]] != 0;
    return n;
}

/* θ ← gathered values at the mask positions. ``stab``: 5 int64 per segment: pointer, flat
 * offset, a, b, src (where the segment's values start in ``values``). */
void scape_scatter_params(const i64 *idx, const i64 *stab, i64 nseg, const float *values) {
    for (i64 q = 0; q < nseg; q++) {
        const i64 *r = stab + 5 * q;
        float *theta = (float *)(intptr_t)r[0];
        i64 off = r[1], src = r[4] - r[2];
        for (i64 j = r[2]; j < r[3]; j++) theta[idx[j] - off] = values[src + j];
    }
}

/* The k-th largest of the non-negative ``v[0:n]`` (1 <= k <= n) by radix selection on
 * the float's bits (for non-negative floats their order is the unsigned integers' order; a NaN's
 * bits sort above every number): three
 * rounds of an 11/11/10-bit histogram, each keeping (compacted in place) the values of the bin
 * that holds the k-th. ``*gt``: how many values are strictly larger. Destroys ``v``. */
static float radix_select_desc(float *v, i64 n, i64 k, i64 *gt) {
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    i64 hist[2048];
    i64 above = 0, need = k;
    for (int level = 0; level < 3; level++) {
        const int sh = shift[level], nb = 1 << width[level];
        const uint32_t bm = (uint32_t)nb - 1;
        memset(hist, 0, sizeof(i64) * (size_t)nb);
        for (i64 i = 0; i < n; i++) {
            uint32_t b;
            memcpy(&b, v + i, 4);
            hist[(b >> sh) & bm]++;
        }
        int bin = nb - 1;
        i64 cum = 0;
        for (; bin > 0; bin--) {
            if (cum + hist[bin] >= need) break;
            cum += hist[bin];
        }
        above += cum;
        need -= cum;
        i64 w = 0;
        for (i64 i = 0; i < n; i++) {
            uint32_t b;
            memcpy(&b, v + i, 4);
            if (((b >> sh) & bm) == (uint32_t)bin) v[w++] = v[i];
        }
        n = w;
    }
    *gt = above;
    return v[0];
}

/* Top-k of |c| over one segment of ``n`` entries, as bits: exactly the k largest |c| (ties at
 * the k-th value broken towards lower indices), what torch.topk selects as a set.
 *  1. threshold: the ``rank``-th largest |c| of a fixed sample (``sample``: ``ssize`` indices)
 *     -- about 1.25k entries of the segment lie at or above it;
 *  2. one pass copies those entries' |c| into ``work`` (room for ``cap``), the k-th largest of
 *     them (radix selection) is the segment's k-th largest;
 *  3. one pass writes every bit.
 * Returns 0, or -1 when the sample's threshold kept fewer than k or more than ``cap`` entries
 * (or a NaN): nothing written, the caller takes torch.topk. */
i64 scape_topk_bits(const float *c, i64 n, i64 k, const i64 *sample, i64 ssize, i64 rank,
                    u8 *bits, float *work, i64 cap) {
    if (k <= 0 || k > n || ssize <= rank || cap < ssize) return -1;
    for (i64 j = 0; j < ssize; j++) work[j] = fabsf(c[sample[j]]);
    i64 above;              /* a NaN sorts above every number: caught below, or in the pass */
    float thr = radix_select_desc(work, ssize, rank + 1, &above);
    if (!(thr == thr)) return -1;
    i64 m = 0;
    for (i64 i = 0; i < n; i++) {
        float v = fabsf(c[i]);
        if (v >= thr) {
            if (m == cap) return -1;
            work[m++] = v;
        } else if (!(v == v)) {
            return -1;
        }
    }
    if (m < k) return -1;
    i64 gt;
    float kth = radix_select_desc(work, m, k, &gt);
    i64 eq_left = k - gt;
    for (i64 i = 0; i < n; i++) {
        float v = fabsf(c[i]);
        u8 b = v > kth;
        if (!b && v == kth && eq_left > 0) {
            b = 1;
            eq_left--;
        }
        bits[i] = b;
    }
    return 0;
}
