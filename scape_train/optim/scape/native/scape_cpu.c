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
#include <stdlib.h>
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

/* ---------------------------------------------------------------------------------------------
 * Threads. Every threaded loop here is a list of independent jobs (contiguous ranges of the flat
 * space, of an index list, or a top-k's parts) run on up to ``nthreads`` threads (torch's
 * intra-op thread count, from the caller), each thread a contiguous run of jobs, the caller's
 * thread one of them. Nothing that is written depends on the split: the elementwise passes write
 * disjoint elements (the index lists hold each index once), and a double sum is taken per block
 * of SUM_BLOCK entries (a constant), the blocks' partial sums then added in block order, however
 * the blocks fell to threads. */
#define MAX_THREADS 64
#define MIN_PER_THREAD (1 << 18)   /* full-size passes: less per thread costs more than it saves */
#define SUM_BLOCK ((i64)1 << 16)   /* entries per partial sum (and per job of a k-sized pass) */

/* jobs [first, end) of a pass; ``part`` (NULL for a pass without a sum): one double per job */
typedef void (*jobs_fn)(void *ctx, i64 first, i64 end, double *part);

typedef struct {
    jobs_fn fn;
    void *ctx;
    i64 first, end;
    double *part;
} worker;

static void *worker_main(void *arg) {
    worker *w = (worker *)arg;
    w->fn(w->ctx, w->first, w->end, w->part ? w->part + w->first : NULL);
    return NULL;
}

/* threads for a full-size pass over ``n`` elements */
static int full_threads(int nthreads, i64 n) {
    i64 most = n / MIN_PER_THREAD;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    return (i64)nthreads > most ? (int)(most > 1 ? most : 1) : (nthreads < 1 ? 1 : nthreads);
}

static int clamp_threads(int nthreads, i64 njobs) {
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if ((i64)nthreads > njobs) nthreads = (int)njobs;
    return nthreads < 1 ? 1 : nthreads;
}

/* workers 1.. on threads of their own, worker 0 on the caller's; all done on return */
static void launch(worker *w, int nthreads) {
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&tid[t], NULL, worker_main, &w[t]) == 0;
    worker_main(&w[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else worker_main(&w[t]);           /* no thread: the caller does its part */
    }
}

/* jobs [0, njobs) in equal runs */
static void run_jobs(i64 njobs, int nthreads, jobs_fn fn, void *ctx, double *part) {
    worker w[MAX_THREADS];
    nthreads = clamp_threads(nthreads, njobs);
    for (int t = 0; t < nthreads; t++)
        w[t] = (worker){fn, ctx, njobs * t / nthreads, njobs * (t + 1) / nthreads, part};
    launch(w, nthreads);
}

/* jobs [0, njobs) in runs of about equal weight (``cum``: njobs + 1 ascending totals, cum[0] =
 * 0), at most one thread per MIN_PER_THREAD of weight */
static void run_weighted(i64 njobs, const i64 *cum, int nthreads, jobs_fn fn, void *ctx) {
    worker w[MAX_THREADS];
    nthreads = clamp_threads(full_threads(nthreads, cum[njobs]), njobs);
    i64 j = 0;
    for (int t = 0; t < nthreads; t++) {
        i64 first = j, goal = cum[njobs] / nthreads * (t + 1);
        if (t == nthreads - 1) j = njobs;
        while (j < njobs && cum[j] + cum[j + 1] <= 2 * goal) j++;   /* by the jobs' midpoints */
        w[t] = (worker){fn, ctx, first, j, NULL};
    }
    launch(w, nthreads);
}

/* the jobs' partial sums added in job order (the jobs: blocks of SUM_BLOCK entries) */
static double blocked_sum(i64 nblocks, int nthreads, jobs_fn fn, void *ctx) {
    double local[256];
    double *part = nblocks <= 256 ? local : (double *)malloc(sizeof(double) * (size_t)nblocks);
    double sq = 0.0;
    if (!part) {            /* no room for the partials: the blocks one after another */
        for (i64 b = 0; b < nblocks; b++) {
            double p;
            fn(ctx, b, b + 1, &p);
            sq += p;
        }
        return sq;
    }
    run_jobs(nblocks, nthreads, fn, ctx, part);
    for (i64 b = 0; b < nblocks; b++) sq += part[b];
    if (part != local) free(part);
    return sq;
}

static inline i64 nblocks_of(i64 n) { return n > 0 ? (n + SUM_BLOCK - 1) / SUM_BLOCK : 0; }
static inline i64 min64(i64 a, i64 b) { return a < b ? a : b; }
static inline i64 max64(i64 a, i64 b) { return a > b ? a : b; }

/* The full-size prepare passes, over every tensor (``gtab``: 2 int64 per tensor: gradient
 * pointer, flat offset; ``numels`` per tensor; the gradients are read, not changed):
 *   ADD      e += round(s·g)                                   (Σ e², the new residual's)
 *   GENERAL  e = (β1·m + s·g) + e                              (Σ c²)
 *   CAND     e += round(s·g), and on the own flat range [lo, hi) cand[f - lo] = ρ[f - lo] + e
 * Jobs: the flat blocks of SUM_BLOCK entries (elementwise, so e and cand do not depend on the
 * split; each block's sum over its tensors' pieces in table order). */
enum { P_ADD = 0, P_GENERAL = 1, P_CAND = 2 };

typedef struct {
    int kind;
    i64 ntensor;
    const i64 *gtab, *numels;
    float *e, *rho, *cand;
    const float *m;
    float beta1, s;
    i64 lo, hi;             /* CAND: the own range */
    i64 total;              /* the flat size */
} prep_job;

/* x[a, b) += round(s·g[a, b)); returns Σ of the new x² (the prepares' full-size line) */
static inline double add_scaled(float *x, const float *g, float s, i64 a, i64 b) {
    double sq = 0.0;
#pragma omp simd reduction(+ : sq)
    for (i64 i = a; i < b; i++) {
        float y = x[i] + s * g[i];
        x[i] = y;
        sq += (double)y * (double)y;
    }
    return sq;
}

/* add_scaled over n elements, on an owner's range: also cand = ρ + x (the sharded candidate) */
static inline double add_scaled_cand(float *x, const float *g, float s, float *cand,
                                     const float *rho, i64 n) {
    double sq = 0.0;
#pragma omp simd reduction(+ : sq)
    for (i64 i = 0; i < n; i++) {
        float y = x[i] + s * g[i];
        x[i] = y;
        cand[i] = rho[i] + y;
        sq += (double)y * (double)y;
    }
    return sq;
}

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
        sq = add_scaled(et, g, s, a, b);
    }
    return sq;
}

/* tensor t's entries [a, b) (tensor-local), its offset ``off``: the pass, and its Σ */
static double prep_piece(const prep_job *j, i64 t, i64 off, i64 a, i64 b) {
    const float *g = (const float *)(intptr_t)j->gtab[2 * t];
    float *et = j->e + off;
    const float *mt = j->m ? j->m + off : NULL;
    if (j->kind != P_CAND) return prep_span(j, g, et, mt, a, b);
    i64 oa = j->lo - off, ob = j->hi - off;             /* the own range, clipped */
    oa = oa < a ? a : (oa > b ? b : oa);
    ob = ob < oa ? oa : (ob > b ? b : ob);
    double sq = prep_span(j, g, et, mt, a, oa);
    i64 at = off + oa - j->lo;                           /* where [oa, ob) starts in the range */
    if (ob > oa)
        sq += add_scaled_cand(et + oa, g + oa, j->s, j->cand + at, j->rho + at, ob - oa);
    return sq + prep_span(j, g, et, mt, ob, b);
}

static void prep_blocks(void *arg, i64 b0, i64 b1, double *part) {
    const prep_job *j = (const prep_job *)arg;
    i64 start = b0 * SUM_BLOCK, end = min64(b1 * SUM_BLOCK, j->total);
    for (i64 b = b0; b < b1; b++) part[b - b0] = 0.0;
    for (i64 t = 0; t < j->ntensor; t++) {
        i64 off = j->gtab[2 * t + 1];
        i64 a = max64(start - off, 0), b = min64(end - off, j->numels[t]);
        while (a < b) {                     /* this worker's part of tensor t, block by block */
            i64 blk = (off + a) / SUM_BLOCK;
            i64 y = min64(b, (blk + 1) * SUM_BLOCK - off);
            part[blk - b0] += prep_piece(j, t, off, a, y);
            a = y;
        }
    }
}

static double prep_parallel(prep_job job, int nthreads) {
    job.total = 0;
    for (i64 t = 0; t < job.ntensor; t++)
        job.total = max64(job.total, job.gtab[2 * t + 1] + job.numels[t]);
    return blocked_sum(nblocks_of(job.total), full_threads(nthreads, job.total), prep_blocks,
                       &job);
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

/* The k-sized passes: jobs are blocks of SUM_BLOCK entries of the index list, entries
 * [j0, j0 + k). A pass is a ``span_fn`` over entries [a, b) of one block, returning their sum
 * (or 0); with a segment table (rows of ``width`` int64: pointer, flat offset, a, b, ...) it is
 * called on each row's part of the block, a block's sum then its rows' sums in row order. */
typedef struct kpass kpass;
typedef double (*span_fn)(const kpass *p, const i64 *row, i64 a, i64 b);

struct kpass {
    span_fn fn;
    const i64 *idx;         /* the index list */
    i64 k, base, j0;        /* entries [j0, j0 + k) (j0: scape_adams' slice), flat index - base */
    float *src, *values, *rho, *m, *work, *out;
    const float *cvalues, *mc;
    const i64 *tab;         /* a segment table, its rows and their width; NULL: none */
    i64 nseg, width;
    u8 *bytes;
    float beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns, coef, d;
    int take, clip, bias;
};

static void kpass_jobs(void *arg, i64 b0, i64 b1, double *part) {
    const kpass *p = (const kpass *)arg;
    for (i64 blk = b0; blk < b1; blk++) {
        i64 a = p->j0 + blk * SUM_BLOCK, b = min64(a + SUM_BLOCK, p->j0 + p->k);
        double sq = 0.0;
        if (!p->tab) {
            sq = p->fn(p, NULL, a, b);
        } else {
            for (i64 q = 0; q < p->nseg; q++) {
                const i64 *r = p->tab + p->width * q;
                i64 ra = max64(r[2], a), rb = min64(r[3], b);
                if (ra < rb) sq += p->fn(p, r, ra, rb);
            }
        }
        if (part) part[blk - b0] = sq;
    }
}

/* the pass on threads, its blocks' sums added in block order */
static double kpass_sum(kpass *p, int nthreads) {
    return blocked_sum(nblocks_of(p->k), nthreads, kpass_jobs, p);
}

static void kpass_run(kpass *p, int nthreads) {
    run_jobs(nblocks_of(p->k), nthreads, kpass_jobs, p, NULL);
}

static double gather_span(const kpass *p, const i64 *row, i64 a, i64 b) {
    (void)row;
    double sq = 0.0;
    for (i64 j = a; j < b; j++) {
        i64 i = p->idx[j] - p->base;
        float v = p->src[i];
        p->values[j] = v;
        if (p->take) p->src[i] = 0.0f;
        sq += (double)v * (double)v;
    }
    return sq;
}

/* values[j] = src[idx[j] - base] (a gather: the payload, or the candidate at the mask); returns
 * Σ values² (the mask's share of ‖c‖², for the residual-norm metric) */
double scape_gather(i64 k, const i64 *idx, i64 base, const float *src, float *values,
                    int nthreads) {
    kpass p = {.fn = gather_span, .k = k, .idx = idx, .base = base, .src = (float *)src,
               .values = values};
    return kpass_sum(&p, nthreads);
}

/* values[j] = src[idx[j]], then src[idx[j]] = 0: the sharded payload gathered and ε folded,
 * ε = (1-M)⊙x, in one pass; returns Σ values² */
double scape_take(i64 k, const i64 *idx, float *src, float *values, int nthreads) {
    kpass p = {.fn = gather_span, .k = k, .idx = idx, .src = src, .values = values, .take = 1};
    return kpass_sum(&p, nthreads);
}

static double ghat_span(const kpass *p, const i64 *row, i64 a, i64 b) {
    (void)row;
    const float nb = -p->beta1, d = p->d;
    float *bv = p->values, *rho = p->rho, *mc = p->work;
    const float *m = p->mc;
    double sq = 0.0;
    for (i64 j = a; j < b; j++) {
        float t = bv[j];
        if (rho) {
            i64 i = p->idx[j] - p->base;
            t = t + rho[i];
            rho[i] = 0.0f;
        }
        float mi;
        if (m) {
            mi = m[p->idx[j] - p->base];
            if (mc) mc[j] = mi;
        } else {
            mi = mc[j];
        }
        float g = mi * nb + t;
        g = g / d;
        bv[j] = g;
        sq += (double)g * (double)g;
    }
    return sq;
}

/* ĝ from the averaged payload, in place: with t = b[j] (+ ρ[i], sharded, then ρ[i] = 0),
 *   ĝ[j] = (m[i]·(-β1) + t) / (1-β1),   i = idx[j] - base;
 * and, when ``mc`` is not NULL, mc[j] = m[i] (the old momentum at the mask, for scape_adams:
 * read here once, not gathered again); with ``m`` NULL the old momentum is read from ``mc``
 * (scape_prepare_gather's), and ``idx`` only for ρ. Returns Σ ĝ² (double, by blocks: the same for any
 * thread count). */
double scape_ghat(i64 k, const i64 *idx, i64 base, float *b, float *rho, const float *m,
                  float *mc, float beta1, float d, int nthreads) {
    kpass p = {.fn = ghat_span, .k = k, .idx = idx, .base = base, .values = b, .rho = rho,
               .mc = m, .work = mc, .beta1 = beta1, .d = d};
    return kpass_sum(&p, nthreads);
}

/* Replicated prepare's fix-up at m's support (rows: gradient pointer, offset, a, b over pidx):
 * e[i] = β1·m[i] + s·g[i]; Σ (c² - old e²) */
static double fix_span(const kpass *p, const i64 *r, i64 a, i64 b) {
    const float beta1 = p->beta1, s = p->d;
    const float *g = (const float *)(intptr_t)r[0];
    i64 off = r[1];
    double sq = 0.0;
    for (i64 j = a; j < b; j++) {
        i64 i = p->idx[j];
        float x = p->mc[i] * beta1;
        float y = s * g[i - off];
        float c = x + y;
        sq += (double)c * (double)c - (double)p->src[i] * (double)p->src[i];
        p->src[i] = c;
    }
    return sq;
}

/* Replicated prepare, m's support known (``pidx``: the previous mask's ``kp`` sorted flat
 * indices): e += round(s·g) on every tensor;  e[pidx] = β1·m[pidx] + s·g[pidx]   (there
 * e_{t-1} = 0). ``ptab``: 4 int64 per segment of pidx: gradient pointer, flat offset, a, b.
 * Returns Σ c² over the whole candidate c (= e on return). */
double scape_prepare_replicated(i64 ntensor, const i64 *gtab, const i64 *numels, float *e,
                                const float *m, const i64 *pidx, i64 kp, const i64 *ptab,
                                i64 npseg, float beta1, float s, int nthreads) {
    double sq = prep_parallel(prep_job_of(P_ADD, ntensor, gtab, numels, e, NULL, 0.0f, s),
                              nthreads);
    kpass p = {.fn = fix_span, .k = kp, .idx = pidx, .tab = ptab, .nseg = npseg, .width = 4,
               .src = e, .mc = m, .beta1 = beta1, .d = s};
    return sq + kpass_sum(&p, nthreads);
}

/* The replicated prepare and the payload gather in one walk of the flat space. */
typedef struct {
    const float *g;
    float *m, *e, *payload, *mc;
    const i64 *pidx, *idx;
    i64 kp, k, total;
    float beta1, s;
} pg_job;

#define PG_CHUNK 4096   /* flat elements a chunk holds in cache while its entries are done */

/* the first position of the ascending ``a`` (``n`` long) holding ``x`` or more */
static i64 lower_bound(const i64 *a, i64 n, i64 x) {
    i64 lo = 0, hi = n;
    while (lo < hi) {
        i64 mid = lo + (hi - lo) / 2;
        if (a[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void pg_blocks(void *arg, i64 b0, i64 b1, double *part) {
    const pg_job *j = (const pg_job *)arg;
    const float s = j->s, beta1 = j->beta1, *g = j->g;
    float *e = j->e, *m = j->m;
    for (i64 blk = b0; blk < b1; blk++) {
        i64 lo = blk * SUM_BLOCK, hi = min64(lo + SUM_BLOCK, j->total);
        i64 p = lower_bound(j->pidx, j->kp, lo), q = lower_bound(j->idx, j->k, lo);
        double sq = 0.0;
        for (i64 c0 = lo; c0 < hi; c0 += PG_CHUNK) {
            i64 c1 = min64(c0 + PG_CHUNK, hi);
            double all = add_scaled(e, g, s, c0, c1), cut = 0.0;
            i64 p0 = p;
            for (; p < j->kp && j->pidx[p] < c1; p++) {    /* m's support: e_{t-1} = 0 there */
                i64 i = j->pidx[p];
                float x = m[i] * beta1;
                float y = s * g[i];
                float c = x + y;
                all += (double)c * (double)c - (double)e[i] * (double)e[i];
                e[i] = c;
            }
            for (; q < j->k && j->idx[q] < c1; q++) {      /* the payload: c at M_t */
                i64 i = j->idx[q];
                float v = e[i];
                j->payload[q] = v;
                j->mc[q] = m[i];                           /* the old m at M_t, for ĝ, AdamS */
                cut += (double)v * (double)v;
            }
            for (i64 r = p0; r < p; r++) m[j->pidx[r]] = 0.0f;   /* read for the last time */
            sq += all - cut;
        }
        part[blk - b0] = sq;
    }
}

/* Replicated prepare with m's support known, the payload gather and m's, in one walk (one
 * flat gradient ``g``, ``total`` long): per chunk of the flat space
 *   e += round(s·g);  e[pidx] = β1·m[pidx] + s·g[pidx]   (e_{t-1} = 0 there);
 *   payload[q] = e[idx[q]],  mc[q] = m[idx[q]]   at M_t's indices ``idx`` (``k``, ascending);
 *   m[pidx] = 0   (m's old support: the update sets m at M_t from mc),
 * the chunk's g, e and m read once from memory for all of it (the separate passes read them
 * again at the mask positions). Returns Σ c² off M_t, the residual norm's square (per block of
 * SUM_BLOCK elements, the blocks in order: the same on any number of threads). */
double scape_prepare_gather(i64 total, const float *g, float *e, float *m, const i64 *pidx,
                            i64 kp, const i64 *idx, i64 k, float *payload, float *mc,
                            float beta1, float s, int nthreads) {
    pg_job job = {.g = g, .m = m, .e = e, .payload = payload, .mc = mc, .pidx = pidx,
                  .idx = idx, .kp = kp, .k = k, .total = total, .beta1 = beta1, .s = s};
    return blocked_sum(nblocks_of(total), full_threads(nthreads, total), pg_blocks, &job);
}

/* The sharded prepare and the payload's rows in one walk of the flat space. */
typedef struct {
    const float *g;
    float *x, *rho, *m, *cand, *send, *mc, *rho_at;
    const i64 *pidx, *idx, *rows;
    i64 kp, k, nrows, lo, hi, own_a, own_b, total;
    float beta1, s;
} pt_job;

static void pt_blocks(void *arg, i64 b0, i64 b1, double *part) {
    const pt_job *j = (const pt_job *)arg;
    const float s = j->s, beta1 = j->beta1, *g = j->g;
    float *x = j->x, *rho = j->rho, *m = j->m;
    const i64 lo = j->lo, hi = j->hi;
    for (i64 blk = b0; blk < b1; blk++) {
        i64 a = blk * SUM_BLOCK, b = min64(a + SUM_BLOCK, j->total);
        /* m's own support (own-range indices), M_t's entries (flat), and the row (destination
         * rank) of the first entry at or after a */
        i64 p = lower_bound(j->pidx, j->kp, a - lo), q = lower_bound(j->idx, j->k, a), r = 0;
        while (r + 1 < j->nrows && j->rows[2 * (r + 1)] <= q) r++;
        double sq = 0.0;
        for (i64 c0 = a; c0 < b; c0 += PG_CHUNK) {
            i64 c1 = min64(c0 + PG_CHUNK, b);
            int own = c1 > lo && c0 < hi;        /* meets the own range: m, ρ, cand there */
            i64 p0 = p;
            if (own)
                for (; p < j->kp && j->pidx[p] + lo < c1; p++)       /* base = β1·m there */
                    rho[j->pidx[p]] = m[j->pidx[p]] * beta1;
            /* x += s·g over the chunk, on its own part also cand = ρ + x; Σ x² as it goes */
            i64 oa = own ? max64(c0, lo) : c1, ob = own ? min64(c1, hi) : c1;
            double all = add_scaled(x, g, s, c0, oa), cut = 0.0;
            if (ob > oa)
                all += add_scaled_cand(x + oa, g + oa, s, j->cand + (oa - lo), rho + (oa - lo),
                                       ob - oa);
            all += add_scaled(x, g, s, ob, c1);
            i64 q0 = q;
            for (; q < j->k && j->idx[q] < c1; q++) {
                i64 i = j->idx[q];
                if (q >= j->own_a && q < j->own_b) {     /* the owner's: ĝ's inputs, gathered */
                    i64 o = i - lo, at = q - j->own_a;
                    j->mc[at] = m[o];
                    j->rho_at[at] = rho[o];
                    rho[o] = 0.0f;                       /* ρ = (1-M)⊙base */
                }
            }
            if (own)
                for (i64 t = p0; t < p; t++) m[j->pidx[t]] = 0.0f;   /* read for the last time */
            for (i64 t = q0; t < q; t++) {               /* the payload rows: ε = (1-M)⊙x */
                while (r + 1 < j->nrows && j->rows[2 * (r + 1)] <= t) r++;
                i64 i = j->idx[t];
                float v = x[i];
                j->send[t + j->rows[2 * r + 1]] = v;
                x[i] = 0.0f;
                cut += (double)v * (double)v;
            }
            sq += all - cut;
        }
        part[blk - b0] = sq;
    }
}

/* Sharded prepare with m's own support known, and the payload's rows, in one walk (one flat
 * gradient ``g``, ``total`` long; the owner's range [lo, hi)). Per chunk of the flat space:
 *   ρ[p] = β1·m[p] at ``pidx`` (m's own support, own-range indices, ``kp``);
 *   x += round(s·g);  on the own range cand[f - lo] = ρ[f - lo] + x[f];
 *   at the owner's entries of M_t (``idx[own_a:own_b]``): mc, rho_at ← m, ρ there; ρ ← 0;
 *   m[pidx] = 0 (the update sets m at M_t from mc);
 *   at every entry q of M_t (``idx``, ``k``, flat, ascending): send[q + off] = x[idx[q]],
 *   x[idx[q]] = 0, with ``rows``: ``nrows`` pairs (first entry, off) of the ranks' rows.
 * Returns Σ ε² of the new ε (per block of SUM_BLOCK elements in order: the same on any number of
 * threads). */
double scape_prepare_take(i64 total, const float *g, float *x, float *rho, float *m,
                          const i64 *pidx, i64 kp, i64 lo, i64 hi, float *cand, const i64 *idx,
                          i64 k, const i64 *rows, i64 nrows, float *send, i64 own_a, i64 own_b,
                          float *mc, float *rho_at, float beta1, float s, int nthreads) {
    pt_job job = {.g = g, .x = x, .rho = rho, .m = m, .cand = cand, .send = send, .mc = mc,
                  .rho_at = rho_at, .pidx = pidx, .idx = idx, .rows = rows, .kp = kp, .k = k,
                  .nrows = nrows, .lo = lo, .hi = hi, .own_a = own_a, .own_b = own_b,
                  .total = total, .beta1 = beta1, .s = s};
    return blocked_sum(nblocks_of(total), full_threads(nthreads, total), pt_blocks, &job);
}

/* Replicated prepare, m's support unknown (the first step, after a load): the GENERAL pass */
double scape_prepare_replicated_general(i64 ntensor, const i64 *gtab, const i64 *numels,
                                        float *e, const float *m, float beta1, float s,
                                        int nthreads) {
    return prep_parallel(prep_job_of(P_GENERAL, ntensor, gtab, numels, e, m, beta1, s),
                         nthreads);
}

/* src[idx[j]] = β1·m[idx[j]] (mc NULL: src[idx[j]] = 0) */
static double fill_span(const kpass *p, const i64 *row, i64 a, i64 b) {
    (void)row;
    if (p->mc) {
        for (i64 j = a; j < b; j++) p->src[p->idx[j]] = p->mc[p->idx[j]] * p->beta1;
    } else {
        for (i64 j = a; j < b; j++) p->src[p->idx[j]] = 0.0f;
    }
    return 0.0;
}

/* Sharded prepare: ρ[i] = β1·m[i] at the owner's m support ``pidx_own`` (indices into the own
 * range [lo, hi), which ρ and m cover); then the CAND pass. Returns Σ ε² (new ε). */
double scape_prepare_sharded(i64 ntensor, const i64 *gtab, const i64 *numels, float *e,
                             float *rho, const float *m, const i64 *pidx_own, i64 kp, i64 lo,
                             i64 hi, float *cand, float beta1, float s, int nthreads) {
    kpass p = {.fn = fill_span, .k = kp, .idx = pidx_own, .src = rho, .mc = m, .beta1 = beta1};
    kpass_run(&p, nthreads);
    prep_job job = prep_job_of(P_CAND, ntensor, gtab, numels, e, NULL, 0.0f, s);
    job.rho = rho;
    job.cand = cand;
    job.lo = lo;
    job.hi = hi;
    return prep_parallel(job, nthreads);
}

/* bytes [b0, b1) · MIN_PER_THREAD of ``bytes`` (``k`` long) zeroed */
static void zero_blocks(void *arg, i64 b0, i64 b1, double *part) {
    const kpass *p = (const kpass *)arg;
    (void)part;
    i64 a = b0 * MIN_PER_THREAD, b = min64(b1 * MIN_PER_THREAD, p->k);
    if (a < b) memset(p->bytes + a, 0, (size_t)(b - a));
}

/* memset(dst, 0, nbytes) on threads */
static void zero_parallel(void *dst, i64 nbytes, int nthreads) {
    kpass z = {.k = nbytes, .bytes = (u8 *)dst};
    run_jobs((nbytes + MIN_PER_THREAD - 1) / MIN_PER_THREAD, full_threads(nthreads, nbytes),
             zero_blocks, &z, NULL);
}

/* The weight decay's factor of a parameter-table row (a float32's bits in an int64 column) */
static inline float row_decay(const i64 *r, int col) {
    uint32_t bits = (uint32_t)r[col];
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* θ[lo, hi) *= dec (the off-mask update, between two mask positions) */
static inline void decay_run(float *theta, i64 lo, i64 hi, float dec) {
#pragma omp simd
    for (i64 i = lo; i < hi; i++) theta[i] = theta[i] * dec;
}

/* Where the run of off-mask elements before index-list entry ``a`` of row ``r`` starts: the
 * segment's first element (``r[col]``) for the row's first entry, else one past the previous
 * entry's element. */
static inline i64 gap_start(const kpass *p, const i64 *r, i64 a, int col) {
    return a == r[2] ? r[col] : p->idx[a - 1] - r[1] + 1;
}

/* Entries per chunk of the decayed walks: the chunk's stretch of θ (~CHUNK/density elements)
 * is decayed in one vector loop, then its mask positions are updated while it is in cache. */
#define DECAY_CHUNK 512

/* scape_adams' pass by segment (rows: pointer, offset, a, b, s0, s1, decay): the arithmetic
 * from ĝ and the old momentum (both contiguous), θ, and m[i] ← m'. Without ``out`` the
 * segment's other elements [s0, s1) get the weight decay in the same walk: each chunk of
 * entries first decays θ from its first run's start through its last entry (mask positions
 * included: θ·dec there is the first half of their update), the row's last chunk its tail too,
 * so every element is decayed once whatever the blocks and threads. */
static double adams_span(const kpass *p, const i64 *r, i64 a, i64 b) {
    const float beta1 = p->beta1, beta2 = p->beta2, omb1 = p->omb1, omb2 = p->omb2;
    const float bc1 = p->bc1, sqrt_bc2 = p->sqrt_bc2, eps = p->eps, ns = p->ns, coef = p->coef;
    const float dec = row_decay(r, 6);
    const int clip = p->clip, bias = p->bias, walk = !p->out && dec != 1.0f;
    const i64 j0 = p->j0, off = r[1];
    const float *ghat = p->cvalues, *mcs = p->mc;     /* from index-list entry j0 */
    float *theta = (float *)(intptr_t)r[0];
    /* where θ is read at a mask position: decayed already by the walk, or θ·dec here */
    const float dec_here = walk ? 1.0f : dec;
    for (i64 c0 = a; c0 < b; c0 += DECAY_CHUNK) {
        i64 c1 = min64(c0 + DECAY_CHUNK, b);
        if (walk) {
            i64 end = c1 == r[3] ? r[5] : p->idx[c1 - 1] - off + 1;
            decay_run(theta, gap_start(p, r, c0, 4), end, dec);
        }
        for (i64 j = c0; j < c1; j++) {
            float g = ghat[j - j0];
            if (clip) g = g * coef;
            float mc = mcs[j - j0];
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
            upd = upd / den;
            i64 i = p->idx[j] - off;
            float th = theta[i];
            if (dec_here != 1.0f) th = th * dec_here;
            float nt = th + upd;                  /* (θ·(1 - lr·wd)) + update: two roundings */
            if (p->out) p->out[j - j0] = nt; else theta[i] = nt;
            p->m[p->idx[j] - p->base] = mn;
        }
    }
    return 0.0;
}

/* AdamS on the k mask positions (adams_update_'s ops), with the weight decay:
 *   ĝ ← coef·ĝ;  prev = m (or m/bc1);  v = β2·prev² + (1-β2)·ĝ²;  m' = β1·m + (1-β1)·ĝ;
 *   θ ← θ·dec + ns·m' / (sqrt(v)/sqrt(bc2) (adam only) + eps), ns = -step;  m[i] ← m';
 *   omb1, omb2 = 1-β1, 1-β2; m here is ``mc``, the old momentum at the mask (scape_ghat's).
 * θ: parameters by segment (``ttab``: 7 int64 per segment: pointer, flat offset, a, b over the
 * index list, the segment's elements [s0, s1) in the tensor, the decay factor dec = 1 - lr·wd
 * as float32 bits). Without ``out``, θ is written back and every other element of [s0, s1)
 * gets θ·dec in the same walk: the off-mask update costs no pass of its own. With ``out`` (a
 * sharded owner's contiguous shard) the new θ goes to out[j - j0] and θ is only read; the
 * parameter scatter decays the rest. ``ghat`` and ``mc`` hold index-list entries [j0, j0 + k);
 * ``m`` is indexed by flat index - ``base``. ``bias``: 0 none, 1 adam, 2 official.
 * The momentum: m ← 0 on ``zidx`` (its old support; everywhere when kz < 0), then m[i] ← m'. */
void scape_adams(const i64 *idx, i64 j0, i64 k, i64 base, const float *ghat, float *m, i64 mlen,
                 const i64 *zidx, i64 kz, const i64 *ttab, i64 nseg, float *out,
                 const float *mc, float coef, int clip, float beta1, float beta2, float omb1,
                 float omb2, float bc1, float sqrt_bc2, float eps, float ns, int bias,
                 int nthreads) {
    if (kz < 0) {
        zero_parallel(m, 4 * mlen, nthreads);
    } else {
        kpass z = {.fn = fill_span, .k = kz, .idx = zidx, .src = m};
        kpass_run(&z, nthreads);
    }
    kpass p = {.fn = adams_span, .k = k, .idx = idx, .base = base, .j0 = j0, .cvalues = ghat,
               .mc = mc, .m = m, .out = out, .coef = coef, .clip = clip, .beta1 = beta1,
               .beta2 = beta2, .omb1 = omb1, .omb2 = omb2, .bc1 = bc1, .sqrt_bc2 = sqrt_bc2,
               .eps = eps, .ns = ns, .bias = bias, .tab = ttab, .nseg = nseg, .width = 7};
    kpass_run(&p, nthreads);
}

/* the bits of entries [a, b) of the increasing index list set in ``bytes`` (a packed bitmap,
 * bit i of byte i >> 3), with the block's bounds moved so that each byte is one block's: entries
 * sharing a byte with the entry before ``a`` are the previous block's, and the block takes
 * those after ``b - 1`` that share its last byte (the list is increasing), so no write races */
static double mark_span(const kpass *p, const i64 *row, i64 a, i64 b) {
    (void)row;
    u8 *bits = p->bytes;
    const i64 *x = p->idx;
    i64 end = p->j0 + p->k;
    if (a > 0)
        while (a < b && x[a] >> 3 == x[a - 1] >> 3) a++;
    while (b < end && b > a && x[b] >> 3 == x[b - 1] >> 3) b++;
    for (i64 j = a; j < b; j++) bits[x[j] >> 3] |= (u8)(1u << (x[j] & 7));
    return 0.0;
}

static double count_span(const kpass *p, const i64 *row, i64 a, i64 b) {
    (void)row;
    const u8 *bits = p->bytes;
    i64 n = 0;
    for (i64 j = a; j < b; j++) n += (bits[p->idx[j] >> 3] >> (p->idx[j] & 7)) & 1;
    return (double)n;           /* exact: a block's count, and their sum, < 2^53 */
}

/* How many entries of the increasing ``a[0:na)`` the increasing ``b[0:nb)`` holds too (the
 * masks' overlap metric from their index lists, no full-size mask held): b's entries marked in
 * the scratch bitmap ``bits`` (``nbytes`` >= (max index >> 3) + 1, zeroed here), then a's
 * looked up; with ``b`` NULL, ``bits`` holds b's bits already (the decode wrote them). Two O(k) passes of independent loads and stores: a merge of the two lists is a
 * chain of dependent compares, 4x slower at density 0.1. */
i64 scape_count_common(const i64 *a, i64 na, const i64 *b, i64 nb, u8 *bits, i64 nbytes,
                       int nthreads) {
    if (b) {
        zero_parallel(bits, nbytes, nthreads);
        kpass mark = {.fn = mark_span, .k = nb, .idx = b, .bytes = bits};
        kpass_run(&mark, nthreads);
    }
    kpass count = {.fn = count_span, .k = na, .idx = a, .bytes = bits};
    return (i64)kpass_sum(&count, nthreads);
}

static double scatter_span(const kpass *p, const i64 *r, i64 a, i64 b) {
    float *theta = (float *)(intptr_t)r[0];
    const float dec = row_decay(r, 7);
    i64 off = r[1], src = r[4] - r[2];
    for (i64 c0 = a; c0 < b; c0 += DECAY_CHUNK) {     /* as adams_span's walk */
        i64 c1 = min64(c0 + DECAY_CHUNK, b);
        if (dec != 1.0f) {
            i64 end = c1 == r[3] ? r[6] : p->idx[c1 - 1] - off + 1;
            decay_run(theta, gap_start(p, r, c0, 5), end, dec);
        }
        for (i64 j = c0; j < c1; j++) theta[p->idx[j] - off] = p->cvalues[src + j];
    }
    return 0.0;
}

/* θ ← gathered values at the mask positions, θ·dec at the segment's other elements (the
 * sharded step's weight decay, in the same walk). ``stab``: 8 int64 per segment: pointer, flat
 * offset, a, b, src (where the segment's values start in ``values``), the segment's elements
 * [s0, s1) in the tensor, dec = 1 - lr·wd as float32 bits. */
void scape_scatter_params(const i64 *idx, const i64 *stab, i64 nseg, const float *values,
                          int nthreads) {
    i64 n = 0;
    for (i64 q = 0; q < nseg; q++) n = max64(n, stab[8 * q + 3]);
    kpass p = {.fn = scatter_span, .k = n, .idx = idx, .tab = stab, .nseg = nseg, .width = 8,
               .cvalues = values};
    kpass_run(&p, nthreads);
}

/* The radix selection's bin at one level: from the top, the bin holding the ``need``-th largest
 * (bin 0 at the latest); ``*cum``: how many lie in the bins above it. */
static int pick_bin(const i64 *hist, int nb, i64 need, i64 *cum) {
    int bin = nb - 1;
    i64 c = 0;
    for (; bin > 0; bin--) {
        if (c + hist[bin] >= need) break;
        c += hist[bin];
    }
    *cum = c;
    return bin;
}

static const int RADIX_SHIFT[3] = {21, 10, 0}, RADIX_WIDTH[3] = {11, 11, 10};

static inline uint32_t radix_key(float v, int level) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return (b >> RADIX_SHIFT[level]) & ((1u << RADIX_WIDTH[level]) - 1);
}

/* The k-th largest of the non-negative ``v[0:n]`` (1 <= k <= n) by radix selection on
 * the float's bits (for non-negative floats their order is the unsigned integers' order; a NaN's
 * bits sort above every number): three
 * rounds of an 11/11/10-bit histogram, each keeping (compacted in place) the values of the bin
 * that holds the k-th. ``*gt``: how many values are strictly larger. Destroys ``v``. */
static float radix_select_desc(float *v, i64 n, i64 k, i64 *gt) {
    i64 hist[2048];
    i64 above = 0, need = k;
    for (int level = 0; level < 3; level++) {
        const int nb = 1 << RADIX_WIDTH[level];
        memset(hist, 0, sizeof(i64) * (size_t)nb);
        for (i64 i = 0; i < n; i++) hist[radix_key(v[i], level)]++;
        i64 cum;
        const uint32_t bin = (uint32_t)pick_bin(hist, nb, need, &cum);
        above += cum;
        need -= cum;
        i64 w = 0;
        for (i64 i = 0; i < n; i++)
            if (radix_key(v[i], level) == bin) v[w++] = v[i];
        n = w;
    }
    *gt = above;
    return v[0];
}

/* scape_topk_bits on parts: part w covers c[n·w/parts, n·(w+1)/parts), collects its entries at
 * or above the threshold into its own stretch of ``work`` (``start[w]``, room for ``room[w]``:
 * when they do not fit, it counts on and the collection is redone at exact offsets), keeps its
 * own radix histograms (summed across parts for the selection), and finally writes its bits,
 * taking ``take[w]`` of the ties at the k-th value: the parts before it take theirs first. */
enum { T_COLLECT = 0, T_RECOLLECT = 1, T_LEVEL1 = 2, T_LEVEL2 = 3, T_BITS = 4 };

typedef struct {
    const float *c;
    i64 n;
    int parts, phase;
    float thr, kth;
    float *work;
    u8 *bits;
    i64 *hist;              /* parts × 2048 */
    uint32_t bin0, bin1;
    i64 start[MAX_THREADS], room[MAX_THREADS], cnt[MAX_THREADS], take[MAX_THREADS];
    int nan[MAX_THREADS];
} topk_job;

static void topk_part(topk_job *t, int w) {
    const i64 a = t->n * w / t->parts, b = t->n * (w + 1) / t->parts;
    const float *c = t->c, thr = t->thr;
    i64 *h = t->hist + 2048 * (i64)w;
    float *out = t->work + t->start[w];
    i64 m = 0;
    if (t->phase == T_COLLECT || t->phase == T_RECOLLECT) {
        const i64 room = t->phase == T_COLLECT ? t->room[w] : t->cnt[w];
        /* one part: no histogram here, radix_select_desc compacts the collected values */
        const int collect = t->phase == T_COLLECT && t->parts > 1;
        if (collect) memset(h, 0, sizeof(i64) * 2048);
        /* branch-free: ~1 in 8 entries is kept, at random, which a branch mispredicts; every
         * value is stored at the next free slot (into ``sink`` once the room is full: an
         * overflow recollects) and kept by counting it */
        float sink;
        int nan = 0;
        for (i64 i = a; i < b; i++) {
            float v = fabsf(c[i]);
            const i64 keep = v >= thr;
            *(m < room ? out + m : &sink) = v;
            if (collect) h[radix_key(v, 0)] += keep;
            m += keep;
            nan |= !(v == v);
        }
        if (nan) {
            t->nan[w] = 1;
            return;
        }
        t->cnt[w] = m;
    } else if (t->phase == T_LEVEL1) {     /* keep bin0, histogram the next level */
        memset(h, 0, sizeof(i64) * 2048);
        for (i64 i = 0; i < t->cnt[w]; i++) {
            float v = out[i];
            if (radix_key(v, 0) != t->bin0) continue;
            out[m++] = v;
            h[radix_key(v, 1)]++;
        }
        t->cnt[w] = m;
    } else if (t->phase == T_LEVEL2) {
        memset(h, 0, sizeof(i64) * 1024);
        for (i64 i = 0; i < t->cnt[w]; i++)
            if (radix_key(out[i], 1) == t->bin1) h[radix_key(out[i], 2)]++;
    } else {
        const float kth = t->kth;
        i64 eq_left = t->take[w];
        u8 *bits = t->bits;
        /* every bit by one vector loop, then the ties at the k-th value (the part's ``take``
         * lowest-indexed ones), found 64 entries at a time by a vector test */
#pragma omp simd
        for (i64 i = a; i < b; i++) bits[i] = fabsf(c[i]) > kth;
        for (i64 c0 = a; c0 < b && eq_left > 0; c0 += 64) {
            i64 c1 = min64(c0 + 64, b);
            int any = 0;
#pragma omp simd reduction(| : any)
            for (i64 i = c0; i < c1; i++) any |= fabsf(c[i]) == kth;
            for (i64 i = c0; any && i < c1 && eq_left > 0; i++)
                if (fabsf(c[i]) == kth) {
                    bits[i] = 1;
                    eq_left--;
                }
        }
    }
}

static void topk_parts(void *arg, i64 first, i64 end, double *part) {
    (void)part;
    for (i64 w = first; w < end; w++) topk_part((topk_job *)arg, (int)w);
}

/* one phase on every part (a thread each); then the parts' histograms summed into ``sum`` */
static void topk_phase(topk_job *t, int phase, int nb, i64 *sum) {
    t->phase = phase;
    run_jobs(t->parts, t->parts, topk_parts, t, NULL);
    if (!sum) return;
    memset(sum, 0, sizeof(i64) * (size_t)nb);
    for (int w = 0; w < t->parts; w++)
        for (int x = 0; x < nb; x++) sum[x] += t->hist[2048 * (i64)w + x];
}

/* Top-k of |c| over one segment of ``n`` entries, as bits: exactly the k largest |c| (ties at
 * the k-th value broken towards lower indices), what torch.topk selects as a set.
 *  1. threshold: the ``rank``-th largest |c| of a fixed sample (``sample``: ``ssize`` indices)
 *     -- about 1.25k entries of the segment lie at or above it;
 *  2. one pass copies those entries' |c| into ``work`` (room for ``cap``), the k-th largest of
 *     them (radix selection) is the segment's k-th largest;
 *  3. one pass writes every bit.
 * The passes split over up to ``nthreads`` threads (by contiguous parts of c, each at least
 * MIN_PER_THREAD long), with the same bits for any count (topk_job).
 * Returns 0, or -1 when the sample's threshold kept fewer than k or more than ``cap`` entries
 * (or a NaN): nothing written, the caller takes torch.topk. */
i64 scape_topk_bits(const float *c, i64 n, i64 k, const i64 *sample, i64 ssize, i64 rank,
                    u8 *bits, float *work, i64 cap, int nthreads) {
    if (k <= 0 || k > n || ssize <= rank || cap < ssize) return -1;
    for (i64 j = 0; j < ssize; j++) work[j] = fabsf(c[sample[j]]);
    i64 above;              /* a NaN sorts above every number: caught below, or in the pass */
    float thr = radix_select_desc(work, ssize, rank + 1, &above);
    if (!(thr == thr)) return -1;
    i64 one[2048], sum[2048];
    topk_job t = {.c = c, .n = n, .thr = thr, .work = work, .bits = bits,
                  .parts = full_threads(nthreads, n)};
    t.hist = t.parts > 1 ? (i64 *)malloc(sizeof(i64) * 2048 * (size_t)t.parts) : NULL;
    if (!t.hist) {
        t.parts = 1;
        t.hist = one;
    }
    for (int w = 0; w < t.parts; w++) {
        t.start[w] = cap * w / t.parts;
        t.room[w] = cap * (w + 1) / t.parts - t.start[w];
    }
    i64 rc = -1, m = 0;
    int overflow = 0;
    topk_phase(&t, T_COLLECT, 2048, t.parts > 1 ? sum : NULL);
    for (int w = 0; w < t.parts; w++) {
        if (t.nan[w]) goto done;
        overflow |= t.cnt[w] > t.room[w];
        m += t.cnt[w];
    }
    if (m > cap || m < k) goto done;
    if (overflow) {         /* a part held more than its room: collect again at exact offsets */
        for (int w = 1; w < t.parts; w++) t.start[w] = t.start[w - 1] + t.cnt[w - 1];
        topk_phase(&t, T_RECOLLECT, 0, NULL);
    }
    if (t.parts == 1) {     /* one part: the selection compacting in place (faster) */
        i64 gt;
        t.kth = radix_select_desc(work, m, k, &gt);
        t.take[0] = k - gt;
        topk_phase(&t, T_BITS, 0, NULL);
        rc = 0;
        goto done;
    }
    i64 cum, need = k;      /* the radix selection of radix_select_desc, on the parts */
    t.bin0 = (uint32_t)pick_bin(sum, 2048, need, &cum);
    need -= cum;
    topk_phase(&t, T_LEVEL1, 2048, sum);
    t.bin1 = (uint32_t)pick_bin(sum, 2048, need, &cum);
    need -= cum;
    topk_phase(&t, T_LEVEL2, 1024, sum);
    uint32_t bin2 = (uint32_t)pick_bin(sum, 1024, need, &cum);
    uint32_t kbits = (t.bin0 << 21) | (t.bin1 << 10) | bin2;
    memcpy(&t.kth, &kbits, 4);
    i64 eq_left = need - cum;      /* = k - (how many are larger): the ties to take */
    for (int w = 0; w < t.parts; w++) {        /* the ties at the k-th: to the lower indices */
        i64 eq = t.hist[2048 * (i64)w + bin2];
        t.take[w] = eq_left < eq ? eq_left : eq;
        eq_left -= t.take[w];
    }
    topk_phase(&t, T_BITS, 0, NULL);
    rc = 0;
done:
    if (t.hist != one) free(t.hist);
    return rc;
}

/* The mask codings run per segment: each segment's stream, bits and output lie apart from the
 * others', so segments are jobs, split over threads by their weight (``seg_jobs``). */
typedef struct {
    const i64 *tab;
    const u8 *buf, *bits;
    i64 len, total, cap;
    u8 *packed, *shard;     /* decode: the bitmap written; encode: the owner's shard */
    i64 *idx;
    i64 *at;                /* decode: where each segment's indices start in idx */
    i64 *bad;               /* per segment: 1 when it does not match its row */
} codec_job;

/* room for ``nseg`` segments' offsets (nseg + 1), weights (nseg + 1) and flags: NULL when there
 * is none (the caller then runs the segments in order on its own thread) */
static i64 *seg_tables(i64 nseg, codec_job *j, i64 **cum) {
    i64 *mem = (i64 *)malloc(sizeof(i64) * (size_t)(3 * nseg + 2));
    if (!mem) return NULL;
    j->at = mem;
    *cum = mem + nseg + 1;
    j->bad = mem + 2 * nseg + 2;
    return mem;
}

/* the lowest segment that failed, as -1 - s; else ``ok`` */
static i64 first_bad(const codec_job *j, i64 nseg, i64 ok) {
    for (i64 s = 0; s < nseg; s++)
        if (j->bad[s]) return -1 - s;
    return ok;
}

/* Bit i of a packed bitmap (bit i & 7 of byte i >> 3). Segments decode on several threads, so
 * the bytes a segment may share with its neighbours -- its first and last, ``edge0`` and
 * ``edge1`` -- are ORed atomically; the bytes between are the segment's alone. */
static inline void set_bit(u8 *packed, i64 i, i64 edge0, i64 edge1) {
    i64 q = i >> 3;
    u8 bit = (u8)(1u << (i & 7));
    if (q == edge0 || q == edge1) __atomic_fetch_or(packed + q, bit, __ATOMIC_RELAXED);
    else packed[q] |= bit;
}

/* bits [a, a + n) of a packed bitmap: whole bytes at once, the partial ends bit by bit */
static void set_run(u8 *packed, i64 a, i64 n, i64 edge0, i64 edge1) {
    i64 i = a, end = a + n;
    for (; i < end && (i & 7); i++) set_bit(packed, i, edge0, edge1);
    for (; i + 8 <= end; i += 8) {
        i64 q = i >> 3;
        if (q == edge0 || q == edge1) __atomic_fetch_or(packed + q, (u8)0xFF, __ATOMIC_RELAXED);
        else packed[q] = 0xFF;
    }
    for (; i < end; i++) set_bit(packed, i, edge0, edge1);
}

/* Segment ``r``'s ones (8 int64: kind, flat_start, numel, k, width, low, high, high_bytes) into
 * idx[at:] and their bits into the packed bitmap (when not NULL): 0, or -1 when they do not
 * match the row (nothing written out of the segment's flat range and its k slots of idx). */
static int decode_segment(const i64 *r, const u8 *buf, i64 len, u8 *packed, i64 total, i64 *idx,
                          i64 at, i64 cap) {
    i64 kind = r[0], flat = r[1], numel = r[2], k = r[3];
    int width = (int)r[4];
    i64 low = r[5], high = r[6], hbytes = r[7];
    if (flat < 0 || numel < 0 || flat + numel > total) return -1;
    i64 edge0 = flat >> 3, edge1 = (flat + numel - 1) >> 3;
    if (kind == K_ALL) {
        if (at + numel > cap) return -1;
        if (packed) set_run(packed, flat, numel, edge0, edge1);
        for (i64 i = 0; i < numel; i++) idx[at++] = flat + i;
        return 0;
    }
    if (k < 0 || at + k > cap) return -1;
    i64 start = at;
    if (kind == K_BITMAP) {
        if (high + hbytes > len) return -1;
        for (i64 b = 0; b < hbytes; b++) {
            unsigned v = buf[high + b];
            while (v) {
                i64 p = 8 * b + __builtin_ctz(v);
                v &= v - 1;
                if (p >= numel || at - start >= k) return -1;
                if (packed) set_bit(packed, flat + p, edge0, edge1);
                idx[at++] = flat + p;
            }
        }
    } else if (kind == K_INDICES) {
        if (low + ((k * width + 7) >> 3) > len) return -1;
        i64 prev = -1;
        for (i64 j = 0; j < k; j++) {
            i64 p = (i64)read_field(buf, len, 8 * low + j * width, width);
            if (p >= numel || p <= prev) return -1;
            prev = p;
            if (packed) set_bit(packed, flat + p, edge0, edge1);
            idx[at++] = flat + p;
        }
    } else if (kind == K_EF) {
        if (high + hbytes > len || low + ((k * width + 7) >> 3) > len) return -1;
        i64 j = 0, prev = -1;
        for (i64 b = 0; b < hbytes; b++) {
            unsigned v = buf[high + b];
            while (v) {
                i64 pos = 8 * b + __builtin_ctz(v);
                v &= v - 1;
                if (j >= k) return -1;
                i64 lo = width ? (i64)read_field(buf, len, 8 * low + j * width, width) : 0;
                i64 p = ((pos - j) << width) | lo;
                if (p >= numel || p <= prev) return -1;
                prev = p;
                if (packed) set_bit(packed, flat + p, edge0, edge1);
                idx[at++] = flat + p;
                j++;
            }
        }
    } else {
        return -1;
    }
    return at - start == k ? 0 : -1;
}

static void decode_jobs(void *arg, i64 first, i64 end, double *part) {
    const codec_job *j = (const codec_job *)arg;
    (void)part;
    for (i64 s = first; s < end; s++)
        j->bad[s] = decode_segment(j->tab + 8 * s, j->buf, j->len, j->packed, j->total, j->idx,
                                   j->at[s], j->cap) != 0;
}

/* Decode a whole mask. ``tab``: 8 int64 per segment, in flat order:
 *   kind, flat_start, numel, k, width, low (byte offset of the field stream in ``buf``),
 *   high (byte offset of the bitmap / upper bit vector), high_bytes.
 * Writes the sorted flat indices of its ones into ``idx`` (room for ``cap``) and, unless
 * ``packed`` is NULL, the mask as a packed bitmap (``ceil(total / 8)`` bytes, padded to whole
 * 16-byte words and zeroed here: the next step's overlap metric reads it; the fused step reads
 * the indices).
 * Returns the number of ones, or -1 - s when segment s is corrupt (a count, position or length
 * that does not match its plan; the lowest such s): nothing is written out of bounds. Segment
 * s's indices start at the ones its predecessors' rows promise (numel for an all-ones segment,
 * else k), so segments decode apart, on up to ``nthreads`` threads. */
i64 scape_mask_decode(i64 nseg, const i64 *tab, const u8 *buf, i64 len, u8 *packed, i64 total,
                      i64 *idx, i64 cap, int nthreads) {
    if (packed) zero_parallel(packed, 16 * ((total + 127) >> 7), nthreads);
    codec_job j = {.tab = tab, .buf = buf, .len = len, .packed = packed, .total = total, .idx = idx,
                   .cap = cap};
    i64 *cum, *mem = seg_tables(nseg, &j, &cum), at = 0;
    if (mem) cum[0] = 0;
    for (i64 s = 0; s < nseg; s++) {
        const i64 *r = tab + 8 * s;
        i64 ones = max64(r[0] == K_ALL ? r[2] : r[3], 0);
        if (!mem) {         /* no room for the tables: in order, here */
            if (decode_segment(r, buf, len, packed, total, idx, at, cap)) return -1 - s;
        } else {
            j.at[s] = at;
            cum[s + 1] = cum[s] + ones + max64(r[7], 0);
        }
        at += ones;
    }
    if (!mem) return at;
    run_weighted(nseg, cum, nthreads, decode_jobs, &j);
    i64 rc = first_bad(&j, nseg, at);
    free(mem);
    return rc;
}

/* the bools (0 or 1 each) at ``b[0..8)`` as the bits of one byte, b[i] -> bit i: one multiply
 * gathers the bytes' low bits into the top byte */
static inline unsigned pack8(const u8 *b) {
    u64 w;
    memcpy(&w, b, 8);
    return (unsigned)(((w & 0x0101010101010101ULL) * 0x0102040810204080ULL) >> 56);
}

/* the bools at ``b[0..n)``, n <= 64, as the bits of a word */
static inline u64 pack64(const u8 *b, i64 n) {
    u64 word = 0;
    i64 i = 0;
    for (; i + 8 <= n; i += 8) word |= (u64)pack8(b + i) << i;
    for (; i < n; i++) word |= (u64)(b[i] & 1) << i;
    return word;
}

/* Encode segment ``r`` (8 int64: kind, start in ``bits``, numel, k, width, off, low_bytes,
 * high_bytes) into its bytes of the zeroed ``shard``: 0, or -1 when it holds another number of
 * ones than its row says. */
static int encode_segment(const i64 *r, const u8 *bits, u8 *shard) {
    i64 kind = r[0], start = r[1], numel = r[2], k = r[3];
    int width = (int)r[4];
    i64 off = r[5], lbytes = r[6], hbytes = r[7];
    const u8 *b = bits + start;
    if (kind == K_ALL) return 0;
    if (kind == K_BITMAP) {
        u8 *out = shard + off;
        i64 q = 0;
        for (; 8 * q + 8 <= numel; q++) out[q] = (u8)pack8(b + 8 * q);
        for (i64 i = 8 * q; i < numel; i++)
            if (b[i]) out[i >> 3] |= (u8)(1u << (i & 7));
        return 0;
    }
    u8 *lowp = shard + off;
    u8 *up = shard + off + lbytes;
    u64 lmask = width >= 64 ? ~0ULL : ((1ULL << width) - 1);
    i64 j = 0;
    /* 64 bools at a time, their ones visited by their bits (no branch per element: a one is
     * ~1 in 10 at random, which a branch per element mispredicts) */
    for (i64 base = 0; base < numel; base += 64) {
        u64 word = pack64(b + base, min64(64, numel - base));
        while (word) {
            i64 i = base + __builtin_ctzll(word);
            word &= word - 1;
            if (j >= k) return -1;
            if (kind == K_INDICES) {
                write_field(lowp, lbytes, j * width, width, (u64)i);
            } else {
                if (width) write_field(lowp, lbytes, j * width, width, (u64)i & lmask);
                i64 u = (i >> width) + j;
                if ((u >> 3) >= hbytes) return -1;
                up[u >> 3] |= (u8)(1u << (u & 7));
            }
            j++;
        }
    }
    return j == k ? 0 : -1;
}

static void encode_jobs(void *arg, i64 first, i64 end, double *part) {
    const codec_job *j = (const codec_job *)arg;
    (void)part;
    for (i64 s = first; s < end; s++)
        j->bad[s] = encode_segment(j->tab + 8 * s, j->bits, j->shard) != 0;
}

/* Encode an owner's segments. ``tab``: 8 int64 per segment:
 *   kind, start (in ``bits``), numel, k, width, off (byte offset in ``shard``), low_bytes,
 *   high_bytes.
 * ``bits``: the owner's bool mask over its range. Returns 0, or -1 - s when segment s (the lowest
 * such) holds another number of ones than its plan says. Segments (each its own bytes of the
 * shard) on up to ``nthreads`` threads, weighed by their numel. */
i64 scape_mask_encode(i64 nseg, const i64 *tab, const u8 *bits, u8 *shard, i64 len,
                      int nthreads) {
    memset(shard, 0, (size_t)len);
    codec_job j = {.tab = tab, .bits = bits, .shard = shard};
    i64 *cum, *mem = seg_tables(nseg, &j, &cum);
    if (!mem) {
        for (i64 s = 0; s < nseg; s++)
            if (encode_segment(tab + 8 * s, bits, shard)) return -1 - s;
        return 0;
    }
    cum[0] = 0;
    for (i64 s = 0; s < nseg; s++) cum[s + 1] = cum[s] + max64(tab[8 * s + 2], 0);
    run_weighted(nseg, cum, nthreads, encode_jobs, &j);
    i64 rc = first_bad(&j, nseg, 0);
    free(mem);
    return rc;
}
