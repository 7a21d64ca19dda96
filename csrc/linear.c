/* linear.c - kernelised ("linear") attention over non-negative features:
 * one kernel for every feature map, mask mode and method.
 *
 *   out_i = phi(q_i) S / max(phi(q_i) . z, eps),  S = sum_j psi(k_j) v_j^T,  z = sum_j psi(k_j)
 *
 * over the keys query i sees (Katharopoulos et al. 2020). The state
 * (S, z) absorbs keys in order; `K` below is always how many keys of the
 * head it holds (keys [0, K), plus the initial state S0, z0).
 *
 * Legend: n queries, m keys, d input features, e value features,
 *         r kernel features, C the chunk (and tile) length.
 *   phi    (C, r)  features of a chunk of query rows
 *   psi    (C, r)  features of a block of keys (zero rows for masked keys)
 *   scores (C, C)  phi psi^T on one block, invisible pairs zeroed
 *   state          S (r, e), z (r)
 *
 * Methods, which all give the same numbers:
 *   chunk      per chunk of C queries: out = phi S for the keys before the
 *              chunk, plus the masked C x C block of the chunk's own keys,
 *              then S += psi^T V. GEMMs carry all the work; O(n) time.
 *              Whole float32 chunks of 16 on AVX-512, AVX2 or NEON do the
 *              three in one register-blocked kernel instead (fused_chunk).
 *   recurrent  the RNN form: S += psi(k_j) v_j^T one key at a time, each
 *              query read from the state as soon as its keys are in.
 *              A float32 call of one token on AVX-512 does both in one
 *              register-blocked pass per head (fused_step).
 *   cumsum     every prefix state materialised ((m + 1) states), then each
 *              query contracts the one it sees: the literal formula.
 *   quadratic  explicit scores in C x C tiles under any band and mask; the
 *              state only contributes the initial S0.
 * Non-causal attention is the chunk method with every key absorbed before
 * the first query: two GEMM passes, psi(K)^T V then phi(Q) S.
 *
 * Threads: OpenMP over heads. With fewer heads than threads the chunk
 * method also cuts each head's sequence into segments: (A) the state
 * increments of the segments' keys, in parallel pieces, (B) their prefix
 * sums, the start state of each segment, (C) every segment's chunk loop
 * from its start state, in parallel. Memory stays O(r e) per thread.
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h"
#include "dispatch.h"
#include "microkernel.h"

/* A head is cut into segments only when each gets at least this many
 * chunks: the precomputation (A) costs half a chunk loop's GEMM work on the
 * segment's keys, worth it only on long stretches. */
#define MIN_SEGMENT_CHUNKS 4
/* Below about this many flops, a call runs on one thread: waking a second
 * one costs more than it saves (tiny heads)... unless its states reach this
 * many bytes: a decoding step is few flops but one pass over every head's
 * state, 512 KB at 32 heads of 64 x 64, which two cores' caches share out
 * (a third faster on two threads; docs/performance.md, the C code's choices). */
#define MIN_PARALLEL_FLOPS 1e6
#define MIN_PARALLEL_STATE_BYTES (256 * 1024)
/* Scratch up to this many numbers (all threads) lives on the caller's stack. */
#define SMALL_SCRATCH 2048

/* What every work item of one call shares. */
typedef struct {
    const attnx_linear_args *a;
    ptrdiff_t r, C;
    ptrdiff_t state_size;     /* r * e + r: S then z */
    double key_log_scale;     /* favor: the key stabiliser c; else 0 */
    int causal;               /* the band has an upper end */
    ptrdiff_t segs;           /* segments per head (chunk method), >= 1 */
    ptrdiff_t needed, split;  /* segments whose increments are precomputed, pieces each */
    int threads;
    int chunk_kernel;         /* whole chunks go through fused_chunk: its width, or 0 */
    int decode_kernel;        /* single-token steps go through decode_kernel: its float32
                                 lanes (16, 8, 4; mk_decode.h), 0 for none */
    int decode_group;         /* and four heads at once through decode_group (AVX-512) */
    int step_kernel;          /* a one-token causal call goes through fused_step: its
                                 lanes, as decode_kernel */
} linear_plan;

/* What every head of one backward call shares. */
typedef struct {
    const attnx_linear_bwd_args *a;
    ptrdiff_t r, C;
    double key_log_scale;
    int causal;
    int threads;
    int chunk_kernel;         /* whole chunks go through the fused kernels: their width, or 0 */
} bwd_plan;

/* The fused chunk kernel's chunk length */
#define KERNEL_CHUNK 16

#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
/* the fused chunk kernels (mk_linear.h, float32) of every width this
 * build has, AVX-512's, AVX2's or NEON's */
#define CHUNK_KERNELS 1

/* The width (attnx_kernels_width) of the fused chunk kernels that
 * `family`'s set has, 0 where it has none: every set with register-blocked
 * kernels has them */
static int chunk_kernel_width(int family)
{
    return attnx_kernels_width(attnx_kernels(family));
}

/* mk_linear_chunk (mk_linear.h) of that width */
static void chunk_kernel_fwd(int width, const float *phi, const float *psi, ptrdiff_t r,
                             const float *v, ptrdiff_t v_row, ptrdiff_t e,
                             const ptrdiff_t *visible, float *S, float *z, float *out,
                             ptrdiff_t out_row, float *den, float *psi_t, float *p,
                             mk_ahead *ahead)
{
#if defined(MK_HAVE_X86)
    if (width == 16)
        mk_linear_chunk_w16(phi, psi, r, v, v_row, e, visible, S, z, out, out_row, den, psi_t, p,
                            ahead);
    else
        mk_linear_chunk_w8(phi, psi, r, v, v_row, e, visible, S, z, out, out_row, den, psi_t, p,
                           ahead);
#else
    (void)width;
    mk_linear_chunk_n4(phi, psi, r, v, v_row, e, visible, S, z, out, out_row, den, psi_t, p,
                       ahead);
#endif
}

/* mk_linear_bwd_rows (mk_linear.h) of that width */
static void chunk_kernel_bwd_rows(int width, const float *phi, const float *psi, ptrdiff_t r,
                                  const float *v, ptrdiff_t v_row, const float *dout,
                                  ptrdiff_t dout_row, ptrdiff_t e, const int *visible,
                                  const float *eps, float *S, float *z, float *inv_den,
                                  float *row_b, float *dphi, float *kept, ptrdiff_t kept_row,
                                  float *scratch, mk_ahead *ahead)
{
#if defined(MK_HAVE_X86)
    if (width == 16)
        mk_linear_bwd_rows_w16(phi, psi, r, v, v_row, dout, dout_row, e, visible, eps, S, z,
                               inv_den, row_b, dphi, kept, kept_row, scratch, ahead);
    else
        mk_linear_bwd_rows_w8(phi, psi, r, v, v_row, dout, dout_row, e, visible, eps, S, z,
                              inv_den, row_b, dphi, kept, kept_row, scratch, ahead);
#else
    (void)width;
    mk_linear_bwd_rows_n4(phi, psi, r, v, v_row, dout, dout_row, e, visible, eps, S, z, inv_den,
                          row_b, dphi, kept, kept_row, scratch, ahead);
#endif
}

/* mk_linear_bwd_keys (mk_linear.h) of that width */
static void chunk_kernel_bwd_keys(int width, const float *phi, const float *psi, ptrdiff_t r,
                                  const float *v, ptrdiff_t v_row, const float *dout,
                                  ptrdiff_t dout_row, ptrdiff_t e, const int *visible,
                                  const float *inv_den, const float *row_b, float *dS, float *dz,
                                  float *dv, ptrdiff_t dv_row, float *dpsi, const float *kept,
                                  ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
#if defined(MK_HAVE_X86)
    if (width == 16)
        mk_linear_bwd_keys_w16(phi, psi, r, v, v_row, dout, dout_row, e, visible, inv_den, row_b,
                               dS, dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
    else
        mk_linear_bwd_keys_w8(phi, psi, r, v, v_row, dout, dout_row, e, visible, inv_den, row_b,
                              dS, dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
#else
    (void)width;
    mk_linear_bwd_keys_n4(phi, psi, r, v, v_row, dout, dout_row, e, visible, inv_den, row_b, dS,
                          dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
#endif
}
#endif
/* Heads whose decoding steps go through the decoding kernel together
 * (decode_group) */
#define DECODE_GROUP 4

/* Ctrl-C (attnx.h, attnx_interrupt), asked between work items and between
 * blocks of rows or keys; thread 0 of a team (or the caller, outside one)
 * is the calling thread, the one that polls for signals. */
static int linear_stopped(attnx_interrupt *interrupt)
{
    return interrupt && attnx_interrupted(interrupt, omp_get_thread_num() == 0);
}

/* The end of a thread's share of a team's work: the calling thread goes
 * on polling until every other thread has finished its share, so that a
 * long item left to another thread still stops at Ctrl-C (it would wait
 * at the region's barrier anyway). `finished` counts the threads done. */
static void linear_share_done(attnx_interrupt *interrupt, int *finished, int team)
{
    int done;
#pragma omp atomic capture
    done = ++*finished;
    if (!interrupt || !interrupt->poll || omp_get_thread_num() != 0) return;
    while (done < team && !attnx_interrupted(interrupt, 1)) {
#pragma omp atomic read
        done = *finished;
    }
}

#define ATTNX_FAMILY_FILE "linear.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */

/* ---------------------------------------------------------------- views */

/* One head's operands, positioned once. */
typedef struct {
    const REAL *q, *k, *v;
    REAL *out;
    const unsigned char *key_mask, *mask;
    const REAL *S0, *z0;
    REAL *S_out, *z_out;
    REAL *held_keys, *held_values;  /* deferred steps: (capacity, r), (capacity, e) */
    ptrdiff_t held;                 /* keys in them */
    int adds_held;                  /* this step adds them (and its own key) into S */
} SFX(head);

/* A state being built: S (r, e) with contiguous rows of e, and z (r,). */
typedef struct {
    REAL *S, *z;
} SFX(state);

/* A state to read from: S rows S_row apart (0: one zero row serves all), z. */
typedef struct {
    const REAL *S;
    ptrdiff_t S_row;
    const REAL *z;
} SFX(view);

/* The values of a block of keys, rows v_row apart. */
typedef struct {
    const REAL *v;
    ptrdiff_t v_row;
} SFX(values);

/* One thread's scratch; F = feature_rows(p), a chunk's rows or a
 * decoding group's heads. */
typedef struct {
    REAL *phi, *psi, *scores;  /* (F, r), (F, r), (C, C) */
    REAL *psi_t;               /* (r, C) the fused chunk kernel's psi^T */
    REAL *values;              /* (C, e) a block of values with masked keys' rows zeroed */
    REAL *den, *log_scale;     /* (C,) per query row of a chunk */
    REAL *col_shift;           /* (d,) efficient attention: key column max */
    REAL *zeros;               /* (max(r, e),) the empty state's rows */
    REAL *state;               /* state_size: the running state of a head */
    REAL *prefix;              /* cumsum: (m + 1) states */
} SFX(scratch);

static SFX(head) SFX(head_at)(const attnx_linear_args *a, ptrdiff_t h)
{
    const ptrdiff_t *off = a->offsets + h * ATTNX_LIN_NOPS;
    SFX(head) hd = {
        .q = (const REAL *)((const char *)a->q + off[ATTNX_LIN_Q]),
        .k = (const REAL *)((const char *)a->k + off[ATTNX_LIN_K]),
        .v = (const REAL *)((const char *)a->v + off[ATTNX_LIN_V]),
        .out = (REAL *)((char *)a->out + off[ATTNX_LIN_OUT]),
        .key_mask = a->key_mask ? a->key_mask + off[ATTNX_LIN_KEY_MASK] : NULL,
        .mask = a->mask ? a->mask + off[ATTNX_LIN_MASK] : NULL,
        .S0 = a->S0 ? (const REAL *)((const char *)a->S0 + off[ATTNX_LIN_S0]) : NULL,
        .z0 = a->z0 ? (const REAL *)((const char *)a->z0 + off[ATTNX_LIN_Z0]) : NULL,
        .S_out = a->S_out ? (REAL *)((char *)a->S_out + off[ATTNX_LIN_S_OUT]) : NULL,
        .z_out = a->z_out ? (REAL *)((char *)a->z_out + off[ATTNX_LIN_Z_OUT]) : NULL,
    };
    const attnx_pending *pending = &a->pending;
    if (pending->psi) {
        hd.held_keys = (REAL *)pending->psi + h * pending->capacity * a->features.r;
        hd.held_values = (REAL *)pending->v + h * pending->capacity * a->e;
        hd.held = attnx_pending_rows(pending->tick, h, pending->capacity);
        hd.adds_held = attnx_pending_adds(pending->tick, h, pending->capacity);
    }
    return hd;
}

static SFX(state) SFX(state_in)(const linear_plan *p, REAL *block)
{
    SFX(state) st = {block, block + p->r * p->a->e};
    return st;
}

static SFX(view) SFX(view_of)(const linear_plan *p, SFX(state) st)
{
    SFX(view) from = {st.S, p->a->e, st.z};
    return from;
}

/* the state before the call's first key: S0, z0, or zeros */
static SFX(view) SFX(initial_view)(const SFX(head) *hd, ptrdiff_t S0_row, const REAL *zeros)
{
    SFX(view) from = {hd->S0 ? hd->S0 : zeros, hd->S0 ? S0_row : 0, hd->S0 ? hd->z0 : zeros};
    return from;
}

/* w.state holds a head's running state when the call returns none (with
 * one, the head runs in its returned state: segment_rows) */
static ptrdiff_t SFX(running_state_size)(const linear_plan *p)
{
    return p->a->S_out ? 0 : p->state_size;
}

/* rows of phi and psi in a scratch */
static ptrdiff_t SFX(feature_rows)(const linear_plan *p) { return ATTNX_MAX(p->C, DECODE_GROUP); }

static SFX(scratch) SFX(scratch_at)(const linear_plan *p, REAL *block)
{
    const ptrdiff_t C = p->C, F = SFX(feature_rows)(p), r = p->r, e = p->a->e;
    SFX(scratch) w;
    w.phi = block;
    w.psi = w.phi + F * r;
    w.scores = w.psi + F * r;
    w.psi_t = w.scores + C * C;
    w.values = w.psi_t + C * r;
    w.den = w.values + C * e;
    w.log_scale = w.den + C;
    w.col_shift = w.log_scale + C;
    w.zeros = w.col_shift + p->a->d;
    w.state = w.zeros + ATTNX_MAX(r, e);
    w.prefix = w.state + SFX(running_state_size)(p);
    memset(w.zeros, 0, (size_t)ATTNX_MAX(r, e) * sizeof(REAL));
    return w;
}

/* Elements of one thread's scratch, rounded up to whole cache lines. */
static size_t SFX(scratch_size)(const linear_plan *p)
{
    const attnx_linear_args *a = p->a;
    size_t size = (size_t)((2 * SFX(feature_rows)(p) + p->C) * p->r + p->C * p->C + p->C * a->e +
                           2 * p->C + a->d +
                           ATTNX_MAX(p->r, a->e) + SFX(running_state_size)(p));
    if (a->method == ATTNX_METHOD_CUMSUM) size += (size_t)(a->m + 1) * (size_t)p->state_size;
    size_t line = ATTNX_CACHE_LINE / sizeof(REAL);
    return (size + line - 1) / line * line;
}

/* ---------------------------------------------------------------- vector helpers */

static ATTNX_HOT void SFX(axpy)(REAL *y, REAL alpha, const REAL *x, ptrdiff_t count)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < count; c++) y[c] += alpha * x[c];
}

static ATTNX_HOT REAL SFX(dot)(const REAL *x, const REAL *y, ptrdiff_t count)
{
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (ptrdiff_t c = 0; c < count; c++) sum += x[c] * y[c];
    return sum;
}

static ATTNX_HOT void SFX(scale_row)(REAL *row, ptrdiff_t count, REAL factor)
{
    for (ptrdiff_t c = 0; c < count; c++) row[c] *= factor;
}

/* Zero row[j] outside [lo, hi) and where mask[j * mask_col] is False;
 * returns the sum of what is kept. Similarities are >= 0 by construction,
 * but rounding can take taylor's 1 + cos(q, -q) to -1e-8: kept at 0. */
static ATTNX_HOT REAL SFX(keep_visible)(REAL *row, ptrdiff_t cols, ptrdiff_t lo, ptrdiff_t hi,
                                        const unsigned char *mask, ptrdiff_t mask_col)
{
    for (ptrdiff_t j = 0; j < lo; j++) row[j] = 0;
    for (ptrdiff_t j = hi; j < cols; j++) row[j] = 0;
    if (mask)
        for (ptrdiff_t j = lo; j < hi; j++) row[j] = mask[j * mask_col] ? row[j] : 0;
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (ptrdiff_t j = lo; j < hi; j++) {
        row[j] = row[j] < 0 ? 0 : row[j];
        sum += row[j];
    }
    return sum;
}

/* ---------------------------------------------------------------- states */

/* dst = from (nothing to do when from is dst itself).
 *
 * In-place decoding (S_out, z_out the very arrays of S0, z0) relies on
 * this: a method's state starts as a copy of the initial view that is
 * skipped, and is then only updated entry by entry (state_pass reads
 * from[f][c] just before it writes dst[f][c]; the GEMMs and axpys of
 * state_add accumulate into it), so no later read of S0 sees a new value.
 * The segmented chunk method and cumsum read S0 only into scratch before
 * they write S_out; the quadratic method writes S_out after every tile. */
static void SFX(state_load)(const linear_plan *p, SFX(state) dst, SFX(view) from)
{
    const ptrdiff_t e = p->a->e;
    if (from.S == dst.S) return;
    for (ptrdiff_t f = 0; f < p->r; f++)
        memcpy(dst.S + f * e, from.S + f * from.S_row, (size_t)e * sizeof(REAL));
    memcpy(dst.z, from.z, (size_t)p->r * sizeof(REAL));
}

/* efficient attention: psi(k_j)_f = exp(k_jf - max_f) / sum_j' exp(k_j'f - max_f),
 * each feature a softmax over the keys. The state absorbed the numerators
 * exp(k_jf - max_f), so dividing row f of S by z_f finishes the softmax, and
 * z_f becomes 1 (0 for a feature without a visible key). */
static void SFX(normalise_key_columns)(const linear_plan *p, SFX(state) st)
{
    for (ptrdiff_t f = 0; f < p->r; f++) {
        SFX(scale_row)(st.S + f * p->a->e, p->a->e, st.z[f] > 0 ? 1 / st.z[f] : 0);
        st.z[f] = st.z[f] > 0 ? 1 : 0;
    }
}

static int SFX(key_kept)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t j)
{
    return !hd->key_mask || hd->key_mask[j * p->a->key_mask_col];
}

/* psi of the keys [j0, j0 + cols) into w->psi, and the values to use with
 * them. A key removed by key_mask gets a zero psi row, so it leaves
 * numerators and denominators alike; if its value holds inf or NaN (the
 * GEMMs' 0 * NaN is NaN), the values come from a copy of the block with
 * that row zeroed, so that nothing of a removed key reaches the result. */
static SFX(values) SFX(key_block)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t j0,
                                  ptrdiff_t cols, const SFX(scratch) *w)
{
    const attnx_linear_args *a = p->a;
    SFX(values) vals = {hd->v + j0 * a->v_row, a->v_row};
    int tainted = 0;
    SFX(attnx_features)(&a->features, 1, hd->k + j0 * a->k_row, a->k_row, cols, j0,
                        p->key_log_scale, w->col_shift, w->psi, NULL);
    for (ptrdiff_t t = 0; t < cols; t++) {
        if (SFX(key_kept)(p, hd, j0 + t)) continue;
        memset(w->psi + t * p->r, 0, (size_t)p->r * sizeof(REAL));
        tainted |= SFX(has_nonfinite)(vals.v + t * vals.v_row, 1, a->e, 0);
    }
    if (!tainted) return vals;
    for (ptrdiff_t t = 0; t < cols; t++) {
        REAL *row = w->values + t * a->e;
        if (SFX(key_kept)(p, hd, j0 + t)) memcpy(row, vals.v + t * vals.v_row, (size_t)a->e * sizeof(REAL));
        else memset(row, 0, (size_t)a->e * sizeof(REAL));
    }
    vals.v = w->values;
    vals.v_row = a->e;
    return vals;
}

/* S += psi^T V_block (one GEMM), z += the rows of psi */
static void SFX(state_add)(const linear_plan *p, const REAL *psi, ptrdiff_t cols,
                           SFX(values) vals, SFX(state) st)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    SFX(gemm)(1, 0, r, e, cols, 1, psi, r, vals.v, vals.v_row, 1, st.S, e);
    for (ptrdiff_t t = 0; t < cols; t++) SFX(axpy)(st.z, 1, psi + t * r, r);
}

/* state += the keys [j0, j1), one GEMM per block of C keys */
static void SFX(absorb)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t j0, ptrdiff_t j1,
                        const SFX(scratch) *w, SFX(state) st)
{
    for (ptrdiff_t b = j0; b < j1 && !linear_stopped(p->a->interrupt); b += p->C) {
        ptrdiff_t cols = ATTNX_MIN(p->C, j1 - b);
        SFX(state_add)(p, w->psi, cols, SFX(key_block)(p, hd, b, cols, w), st);
    }
}

/* One pass over a state, the RNN form's unit of work: with psi, the step
 * dst = from + psi v^T, z_dst = z_from + psi (from may be dst itself, or the
 * initial state, which the step then copies for free); with phi, a query
 * row read from the state after the step, out_i = phi S, den = phi . z.
 * A decoding step does both in one pass over each head's state. The row's
 * output is built in blocks of ROW_BLOCK columns held in registers while
 * the rows of S stream past (accumulating in out_i would chain every
 * update through a store and a load). */
#define ROW_BLOCK 64
static ATTNX_HOT void SFX(state_pass)(ptrdiff_t r, ptrdiff_t e, SFX(view) from, const REAL *psi,
                                      const REAL *v, SFX(state) dst, const REAL *phi,
                                      REAL *out_i, REAL *den)
{
    ptrdiff_t c0 = 0;
    for (; c0 + ROW_BLOCK <= e; c0 += ROW_BLOCK) {
        REAL acc[ROW_BLOCK] = {0}, v_block[ROW_BLOCK];
        /* v and psi[f] hoisted into locals: the compiler cannot tell that
         * the stores into the state leave them alone, and would load them
         * again after every store */
        if (psi) memcpy(v_block, v + c0, sizeof v_block);
        for (ptrdiff_t f = 0; f < r; f++) {
            const REAL *from_f = from.S + f * from.S_row + c0;
            REAL phi_f = phi ? phi[f] : 0;
            if (!psi) {
#pragma omp simd
                for (ptrdiff_t c = 0; c < ROW_BLOCK; c++) acc[c] += phi_f * from_f[c];
                continue;
            }
            REAL *S_f = dst.S + f * e + c0, psi_f = psi[f];
#pragma omp simd
            for (ptrdiff_t c = 0; c < ROW_BLOCK; c++) {
                REAL s = from_f[c] + psi_f * v_block[c];
                S_f[c] = s;
                acc[c] += phi_f * s;
            }
        }
        if (phi) memcpy(out_i + c0, acc, sizeof acc);
    }
    /* the columns past the last whole block */
    if (phi)
        for (ptrdiff_t c = c0; c < e; c++) out_i[c] = 0;
    for (ptrdiff_t f = 0; c0 < e && f < r; f++) {
        const REAL *from_f = from.S + f * from.S_row;
        REAL *S_f = psi ? dst.S + f * e : NULL, phi_f = phi ? phi[f] : 0;
        for (ptrdiff_t c = c0; c < e; c++) {
            REAL s = psi ? (S_f[c] = from_f[c] + psi[f] * v[c]) : from_f[c];
            if (phi) out_i[c] += phi_f * s;
        }
    }
    /* z in its own vector loops (inside the loop above it ran scalar, a
     * fifth of a decoding step), each entry read before it is written */
    const REAL *z = from.z;
    if (psi) {
#pragma omp simd
        for (ptrdiff_t f = 0; f < r; f++) dst.z[f] = from.z[f] + psi[f];
        z = dst.z;
    }
    if (phi) *den = SFX(dot)(phi, z, r);
}

/* The keys [j0, j1) one RNN step each, from *from into st (where the state
 * lives from then on); the last key's step also reads the row phi, if any.
 * A key removed by key_mask takes no step at all. */
static void SFX(steps)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t j0, ptrdiff_t j1,
                       SFX(view) *from, SFX(state) st, const REAL *phi, REAL *out_i, REAL *den,
                       const SFX(scratch) *w)
{
    const attnx_linear_args *a = p->a;
    for (ptrdiff_t b = j0; b < j1 && !linear_stopped(a->interrupt); b += p->C) {
        ptrdiff_t cols = ATTNX_MIN(p->C, j1 - b);
        SFX(key_block)(p, hd, b, cols, w);
        for (ptrdiff_t t = 0; t < cols; t++) {
            const REAL *read = b + t == j1 - 1 ? phi : NULL;
            if (!SFX(key_kept)(p, hd, b + t)) {
                if (read) SFX(state_pass)(p->r, a->e, *from, NULL, NULL, st, read, out_i, den);
                continue;
            }
            SFX(state_pass)(p->r, a->e, *from, w->psi + t * p->r, hd->v + (b + t) * a->v_row, st,
                            read, out_i, den);
            *from = SFX(view_of)(p, st);
        }
    }
}

/* S += keys^T values for `rows` held keys (deferred steps), in key order
 * like the RNN steps they stand for: one pass over S. Float32 on AVX-512
 * keeps blocks of 6 rows of S in registers (mk_linear.h); otherwise a
 * block of one row stays in registers while the values stream from L1
 * (gemm_small, which adds each key into S in memory, was slower: docs/performance.md, the C code's choices). */
static ATTNX_HOT void SFX(add_held)(ptrdiff_t r, ptrdiff_t e, REAL *S, const REAL *keys,
                                    const REAL *values, ptrdiff_t rows)
{
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
    if (attnx_kernels_width(attnx_kernels(ATTNX_FAMILY_DECODE)) == 16 && r % 2 == 0 &&
        e % 16 == 0) {
        mk_add_keys_w16(keys, r, values, e, rows, S, e, NULL);
        return;
    }
#endif
    for (ptrdiff_t f = 0; f < r; f++) {
        REAL *S_f = S + f * e;
        ptrdiff_t c0 = 0;
        for (; c0 + ROW_BLOCK <= e; c0 += ROW_BLOCK) {
            REAL acc[ROW_BLOCK];
            memcpy(acc, S_f + c0, sizeof acc);
            for (ptrdiff_t t = 0; t < rows; t++) {
                const REAL key = keys[t * r + f], *value = values + t * e + c0;
#pragma omp simd
                for (ptrdiff_t c = 0; c < ROW_BLOCK; c++) acc[c] += key * value[c];
            }
            memcpy(S_f + c0, acc, sizeof acc);
        }
        for (ptrdiff_t t = 0; c0 < e && t < rows; t++)
            SFX(axpy)(S_f + c0, keys[t * r + f], values + t * e + c0, e - c0);
    }
}

/* ---------------------------------------------------------------- query rows */

static void SFX(query_block)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t i0,
                             ptrdiff_t rows, const SFX(scratch) *w)
{
    const attnx_linear_args *a = p->a;
    SFX(attnx_features)(&a->features, 0, hd->q + i0 * a->q_row, a->q_row, rows, i0, 0, NULL,
                        w->phi, w->log_scale);
}

/* den = phi z: the denominators the absorbed keys give a block of rows */
static void SFX(state_dens)(const linear_plan *p, ptrdiff_t rows, const REAL *z,
                            const SFX(scratch) *w)
{
    for (ptrdiff_t t = 0; t < rows; t++) w->den[t] = SFX(dot)(w->phi + t * p->r, z, p->r);
}

/* out = phi S, den = phi z: what the absorbed keys give a block of rows */
static void SFX(read_state)(const linear_plan *p, ptrdiff_t rows, const REAL *S, ptrdiff_t S_row,
                            const REAL *z, const SFX(scratch) *w, REAL *out)
{
    SFX(gemm)(0, 0, rows, p->a->e, p->r, 1, w->phi, p->r, S, S_row, 0, out, p->a->out_row);
    SFX(state_dens)(p, rows, z, w);
}

/* The keys of [j0, j0 + cols) that row i sees: [*lo, *hi) relative to j0,
 * where the mask (returned, NULL when none) is True. */
static const unsigned char *SFX(row_span)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t i,
                                          ptrdiff_t j0, ptrdiff_t cols, ptrdiff_t *lo,
                                          ptrdiff_t *hi)
{
    const attnx_linear_args *a = p->a;
    *lo = ATTNX_MAX(attnx_band_first(&a->band, i), j0) - j0;
    *hi = ATTNX_MAX(ATTNX_MIN(attnx_band_end(&a->band, i), j0 + cols) - j0, *lo);
    return hd->mask ? hd->mask + i * a->mask_row + j0 * a->mask_col : NULL;
}

/* scores = phi psi^T for the rows [i0, i0 + rows) and the keys
 * [j0, j0 + cols), invisible pairs zeroed; out += scores V_block,
 * den += the row sums. Values holding inf or NaN go through a loop over
 * the visible pairs only: in the GEMM, a zeroed pair would still carry
 * 0 * NaN into a row that cannot see the key. */
static void SFX(add_block)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t i0, ptrdiff_t rows,
                           ptrdiff_t j0, ptrdiff_t cols, SFX(values) vals, const SFX(scratch) *w,
                           REAL *out)
{
    const attnx_linear_args *a = p->a;
    const ptrdiff_t C = p->C, e = a->e;
    ptrdiff_t lo, hi;
    SFX(gemm)(0, 1, rows, cols, p->r, 1, w->phi, p->r, w->psi, p->r, 0, w->scores, C);
    for (ptrdiff_t t = 0; t < rows; t++) {
        const unsigned char *mask_ij = SFX(row_span)(p, hd, i0 + t, j0, cols, &lo, &hi);
        w->den[t] += SFX(keep_visible)(w->scores + t * C, cols, lo, hi, mask_ij, a->mask_col);
    }
    if (!SFX(has_nonfinite)(vals.v, cols, e, vals.v_row)) {
        SFX(gemm)(0, 0, rows, e, cols, 1, w->scores, C, vals.v, vals.v_row, 1, out, a->out_row);
        return;
    }
    for (ptrdiff_t t = 0; t < rows; t++) {
        const unsigned char *mask_ij = SFX(row_span)(p, hd, i0 + t, j0, cols, &lo, &hi);
        for (ptrdiff_t j = lo; j < hi; j++)
            if (!mask_ij || mask_ij[j * a->mask_col])
                SFX(axpy)(out + t * a->out_row, w->scores[t * C + j], vals.v + j * vals.v_row, e);
    }
}

/* out_i = num_i / max(den_i, eps_i) with eps_i = eps exp(-(log_scale_i + c)):
 * the features were divided by exp(log_scale_i) (query) and exp(c) (keys)
 * to stay finite, which cancels in the ratio but not in the clamp, so the
 * clamp is divided the same way (docs/linear.md, FAVOR+). A zero denominator
 * gives a zero row. Unnormalised (similarities): out_i = num_i exp(log_scale_i + c). */
static void SFX(finish_rows)(const linear_plan *p, ptrdiff_t rows, const SFX(scratch) *w, REAL *out)
{
    const attnx_linear_args *a = p->a;
    for (ptrdiff_t t = 0; t < rows; t++) {
        REAL *out_t = out + t * a->out_row;
        double removed = w->log_scale[t] + p->key_log_scale;
        if (!a->normalise) {
            SFX(scale_row)(out_t, a->e, (REAL)exp(removed));
            continue;
        }
        if (w->den[t] == 0) {
            memset(out_t, 0, (size_t)a->e * sizeof(REAL));
            continue;
        }
        REAL eps_t = (REAL)(removed == 0 ? a->eps : exp(log(a->eps) - removed));
        SFX(scale_row)(out_t, a->e, 1 / (w->den[t] < eps_t ? eps_t : w->den[t]));
    }
}

/* One whole chunk (KERNEL_CHUNK rows against as many keys) through the
 * fused kernel of the family's width (AVX-512, AVX2 or NEON), which keeps
 * every product in registers: read_state, add_block and state_add in one
 * pass (mk_linear.h). Returns 0 where it does not apply (float64, plain
 * C, partial chunks, values holding inf or NaN), leaving the work to
 * those three. */
static int SFX(fused_chunk)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t i0,
                            ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols, SFX(values) vals,
                            const SFX(scratch) *w, SFX(state) st, REAL *out)
{
#if !REAL_IS_DOUBLE && defined(CHUNK_KERNELS)
    const attnx_linear_args *a = p->a;
    if (!p->chunk_kernel || rows != KERNEL_CHUNK || cols != KERNEL_CHUNK ||
        SFX(has_nonfinite)(vals.v, cols, a->e, vals.v_row))
        return 0;
    /* the band opens at key 0 (chunk_kernel), so row t sees [0, visible[t]) */
    ptrdiff_t visible[KERNEL_CHUNK], first;
    for (ptrdiff_t t = 0; t < rows; t++)
        SFX(row_span)(p, hd, i0 + t, j0, cols, &first, &visible[t]);
    SFX(state_dens)(p, rows, st.z, w);
    /* the next chunk's rows, asked for from inside the kernel (mk_ahead),
     * spread over its loops: faster than asking for them all at once
     * before it (docs/performance.md, the C code's choices) */
    const ptrdiff_t size = (ptrdiff_t)sizeof(float);
    ptrdiff_t next_rows = ATTNX_MIN(KERNEL_CHUNK, a->n - i0 - rows);
    ptrdiff_t next_keys = ATTNX_MIN(KERNEL_CHUNK, a->m - j0 - cols);
    mk_ahead ahead = {.regions = 0};
    if (next_rows > 0) {
        mk_ahead_add(&ahead, hd->q + (i0 + rows) * a->q_row, a->q_row * size, a->d * size, next_rows, 0);
        mk_ahead_add(&ahead, out + rows * a->out_row, a->out_row * size, a->e * size, next_rows, 1);
    }
    if (next_keys > 0) {
        mk_ahead_add(&ahead, hd->k + (j0 + cols) * a->k_row, a->k_row * size, a->d * size, next_keys, 0);
        mk_ahead_add(&ahead, hd->v + (j0 + cols) * a->v_row, a->v_row * size, a->e * size, next_keys, 0);
    }
    chunk_kernel_fwd(p->chunk_kernel, w->phi, w->psi, p->r, vals.v, vals.v_row, a->e, visible,
                     st.S, st.z, out, a->out_row, w->den, w->psi_t, w->scores, &ahead);
    return 1;
#else
    (void)p, (void)hd, (void)i0, (void)rows, (void)j0, (void)cols, (void)vals, (void)w, (void)st,
        (void)out;
    return 0;
#endif
}

/* ---------------------------------------------------------------- methods */

/* A method's pass over the queries [qa, qb) of one head. The state starts
 * as `from`, which holds the keys [0, K); the method builds on it in st
 * (from may be st itself). With `last`, it leaves every key in st. */
typedef void (*SFX(rows_fn))(const linear_plan *p, const SFX(head) *hd, ptrdiff_t qa,
                             ptrdiff_t qb, SFX(view) from, ptrdiff_t K, int last,
                             const SFX(scratch) *w, SFX(state) st);

static void SFX(chunk_rows)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t qa, ptrdiff_t qb,
                            SFX(view) from, ptrdiff_t K, int last, const SFX(scratch) *w,
                            SFX(state) st)
{
    const attnx_linear_args *a = p->a;
    SFX(state_load)(p, st, from);
    /* the keys every query of [qa, qb) sees: all of them when non-causal */
    ptrdiff_t lo = attnx_band_end(&a->band, qa - 1);
    SFX(absorb)(p, hd, K, lo, w, st);
    if (a->features.kind == ATTNX_FM_EFFICIENT) SFX(normalise_key_columns)(p, st);
    for (ptrdiff_t i0 = qa; i0 < qb && !linear_stopped(a->interrupt); i0 += p->C) {
        ptrdiff_t rows = ATTNX_MIN(p->C, qb - i0);
        ptrdiff_t hi = attnx_band_end(&a->band, i0 + rows - 1);
        REAL *out = hd->out + i0 * a->out_row;
        if (i0 + rows < qb && !p->chunk_kernel) {
            /* long inputs stream from memory: ask for the next chunk's rows
             * while this one computes (docs/performance.md, the C code's choices). The fused
             * kernel asks for them itself, spread over its loops (fused_chunk). */
            ptrdiff_t next = ATTNX_MIN(p->C, qb - i0 - rows), key_next = hi;
            SFX(prefetch_rows)(hd->q + (i0 + rows) * a->q_row, a->q_row, next, a->d);
            if (key_next < a->m) {
                next = ATTNX_MIN(next, a->m - key_next);
                SFX(prefetch_rows)(hd->k + key_next * a->k_row, a->k_row, next, a->d);
                SFX(prefetch_rows)(hd->v + key_next * a->v_row, a->v_row, next, a->e);
            }
        }
        SFX(query_block)(p, hd, i0, rows, w);
        if (hi > lo) {
            /* the chunk's own keys: a masked block, then into the state */
            SFX(values) vals = SFX(key_block)(p, hd, lo, hi - lo, w);
            if (!SFX(fused_chunk)(p, hd, i0, rows, lo, hi - lo, vals, w, st, out)) {
                SFX(read_state)(p, rows, st.S, a->e, st.z, w, out);
                SFX(add_block)(p, hd, i0, rows, lo, hi - lo, vals, w, out);
                SFX(state_add)(p, w->psi, hi - lo, vals, st);
            }
            lo = hi;
        } else {
            SFX(read_state)(p, rows, st.S, a->e, st.z, w, out);
        }
        SFX(finish_rows)(p, rows, w, out);
    }
    if (last) SFX(absorb)(p, hd, lo, a->m, w, st);
}

#if !REAL_IS_DOUBLE && (defined(MK_HAVE_X86) || defined(MK_HAVE_NEON))
/* phi and psi of a head's one query and one key, and the key's values,
 * for the single-token kernels of `lanes` lanes: on AVX-512 elu features
 * computed in place (mk_elu_rows_w16, the same numbers as features.c),
 * the others by the general code */
static SFX(values) SFX(token_features)(const linear_plan *p, const SFX(head) *hd,
                                       const SFX(scratch) *w, int lanes)
{
#if defined(MK_HAVE_X86)
    const attnx_linear_args *a = p->a;
    if (lanes == 16 && a->features.kind == ATTNX_FM_ELU && !hd->key_mask) {
        mk_elu_rows_w16(hd->q, hd->k, a->d, w->phi, w->psi);
        w->log_scale[0] = 0;
        return (SFX(values)){hd->v, a->v_row};
    }
#endif
    (void)lanes;
    SFX(query_block)(p, hd, 0, 1, w);
    return SFX(key_block)(p, hd, 0, 1, w);
}

/* the single-token kernels of `lanes` lanes (mk_decode.h) */
static void SFX(rnn_step_kernel)(int lanes, const float *phi, const float *psi, ptrdiff_t r,
                                 const float *v, const float *S0, ptrdiff_t S0_row,
                                 const float *z0, ptrdiff_t e, float *S, float *z, float *out,
                                 float *den)
{
#if defined(MK_HAVE_X86)
    if (lanes == 16) mk_rnn_step_w16(phi, psi, r, v, S0, S0_row, z0, e, S, z, out, den);
    else mk_rnn_step_w8(phi, psi, r, v, S0, S0_row, z0, e, S, z, out, den);
#else
    (void)lanes;
    mk_rnn_step_n4(phi, psi, r, v, S0, S0_row, z0, e, S, z, out, den);
#endif
}

static void SFX(decode_step_kernel)(int lanes, const float *phi, const float *psi, ptrdiff_t r,
                                    const float *v, ptrdiff_t e, float *S, float *z, float *keys,
                                    float *values, ptrdiff_t held, int adds, float *out,
                                    float *den)
{
#if defined(MK_HAVE_X86)
    if (lanes == 16) mk_decode_step_w16(phi, psi, r, v, e, S, z, keys, values, held, adds, out, den);
    else mk_decode_step_w8(phi, psi, r, v, e, S, z, keys, values, held, adds, out, den);
#else
    (void)lanes;
    mk_decode_step_n4(phi, psi, r, v, e, S, z, keys, values, held, adds, out, den);
#endif
}
#endif

/* The functional single-token call (n = m = 1, causal, query 0 sees key
 * 0) through the float32 kernel (mk_decode.h, mk_rnn_step_w16, _w8, _n4):
 * the key's RNN step from `from` into st and the query's row read from
 * it, one pass over the state, where the general path below takes
 * state_pass plus a dot product. A key removed by key_mask takes no step
 * (general path). Returns 0 where it does not apply. */
static int SFX(fused_step)(const linear_plan *p, const SFX(head) *hd, SFX(view) from,
                           const SFX(scratch) *w, SFX(state) st)
{
#if !REAL_IS_DOUBLE && (defined(MK_HAVE_X86) || defined(MK_HAVE_NEON))
    const attnx_linear_args *a = p->a;
    if (!p->step_kernel || !SFX(key_kept)(p, hd, 0)) return 0;
    SFX(values) vals = SFX(token_features)(p, hd, w, p->step_kernel);
    SFX(rnn_step_kernel)(p->step_kernel, w->phi, w->psi, p->r, vals.v, from.S, from.S_row,
                         from.z, a->e, st.S, st.z, hd->out, w->den);
    SFX(finish_rows)(p, 1, w, hd->out);
    return 1;
#else
    (void)p, (void)hd, (void)from, (void)w, (void)st;
    return 0;
#endif
}

static void SFX(recurrent_rows)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t qa,
                                ptrdiff_t qb, SFX(view) from, ptrdiff_t K, int last,
                                const SFX(scratch) *w, SFX(state) st)
{
    const attnx_linear_args *a = p->a;
    if (SFX(fused_step)(p, hd, from, w, st)) return;
    for (ptrdiff_t i0 = qa; i0 < qb && !linear_stopped(a->interrupt); i0 += p->C) {
        ptrdiff_t rows = ATTNX_MIN(p->C, qb - i0);
        REAL *out = hd->out + i0 * a->out_row;
        SFX(query_block)(p, hd, i0, rows, w);
        for (ptrdiff_t t = 0; t < rows; t++) {
            ptrdiff_t end = attnx_band_end(&a->band, i0 + t);
            const REAL *phi_t = w->phi + t * p->r;
            REAL *out_t = out + t * a->out_row;
            if (end > K) SFX(steps)(p, hd, K, end, &from, st, phi_t, out_t, &w->den[t], w);
            else SFX(state_pass)(p->r, a->e, from, NULL, NULL, st, phi_t, out_t, &w->den[t]);
            K = ATTNX_MAX(K, end);
        }
        SFX(finish_rows)(p, rows, w, out);
    }
    if (!last) return;
    SFX(steps)(p, hd, K, a->m, &from, st, NULL, NULL, NULL, w);
    SFX(state_load)(p, st, from);  /* no key at all: st is still the initial state */
}

/* out_i += sum_t (phi . keys_t) values_t over `held` held keys (one
 * function, so that its loops inline: a call per dot product and axpy
 * took a tenth of a decoding step) */
static ATTNX_HOT void SFX(add_held_terms)(ptrdiff_t r, ptrdiff_t e, const REAL *phi,
                                          const REAL *keys, const REAL *values, ptrdiff_t held,
                                          REAL *out_i)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        REAL weight = 0;
#pragma omp simd reduction(+ : weight)
        for (ptrdiff_t f = 0; f < r; f++) weight += phi[f] * keys[t * r + f];
#pragma omp simd
        for (ptrdiff_t c = 0; c < e; c++) out_i[c] += weight * values[t * e + c];
    }
}

/* One single-token decoding step of a head through the float32 kernel
 * (mk_decode.h, mk_decode_step_w16, _w8, _n4): the generic steps of
 * deferred_step below in one pass over S, elu features computed in place
 * (mk_elu_rows_w16, the same numbers as features.c). Returns 0 where it
 * does not apply (float64, other CPUs, r or e not whole vectors), leaving
 * them the work. */
static int SFX(decode_kernel)(const linear_plan *p, const SFX(head) *hd, const SFX(scratch) *w,
                              SFX(state) st)
{
#if !REAL_IS_DOUBLE && (defined(MK_HAVE_X86) || defined(MK_HAVE_NEON))
    const attnx_linear_args *a = p->a;
    if (!p->decode_kernel) return 0;
    SFX(values) vals = SFX(token_features)(p, hd, w, p->decode_kernel);
    SFX(decode_step_kernel)(p->decode_kernel, w->phi, w->psi, p->r, vals.v, a->e, st.S, st.z,
                            hd->held_keys, hd->held_values, hd->held, hd->adds_held, hd->out,
                            w->den);
    return 1;
#else
    (void)p, (void)hd, (void)w, (void)st;
    return 0;
#endif
}

/* The decoding steps of the heads items[0..3] in one pass over their
 * states (mk_decode.h, mk_decode_group_w16), where exactly one of them
 * takes its turn: with capacity 4 (HELD_KEYS in py_linear.c) any four
 * heads in a row have one turn among them. Elu features only, without a
 * key mask (the features token_features makes in place, no stabiliser
 * for finish_rows to undo); returns 0 where it does not apply, leaving
 * the heads to deferred_step, with the same numbers. */
static int SFX(decode_group)(const linear_plan *p, const ptrdiff_t items[DECODE_GROUP],
                             const SFX(scratch) *w)
{
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
    const attnx_linear_args *a = p->a;
    if (!p->decode_group) return 0;
    SFX(head) hd[DECODE_GROUP];
    int turn = -1;
    for (int j = 0; j < DECODE_GROUP; j++) {
        hd[j] = SFX(head_at)(a, items[j]);
        if (hd[j].key_mask || (hd[j].adds_held && turn >= 0)) return 0;
        if (hd[j].adds_held) turn = j;
    }
    if (turn < 0) return 0;
    mk_decode_head heads[DECODE_GROUP];
    for (int j = 0; j < DECODE_GROUP; j++) {
        REAL *phi = w->phi + j * p->r, *psi = w->psi + j * p->r;
        mk_elu_rows_w16(hd[j].q, hd[j].k, a->d, phi, psi);
        heads[j] = (mk_decode_head){phi, hd[j].S_out, hd[j].held_keys, hd[j].held_values,
                                    hd[j].held + 1, 0, hd[j].out};
        mk_decode_take_w16(phi, psi, p->r, hd[j].v, a->e, hd[j].z_out, hd[j].held_keys,
                           hd[j].held_values, hd[j].held, &heads[j].den);
    }
    mk_decode_group_w16(heads, turn, p->r, a->e, (REAL)a->eps);
    return 1;
#else
    (void)p, (void)items, (void)w;
    return 0;
#endif
}

/* One single-token decoding step of a head (a->pending), in its own
 * state st: the key joins z at once
 * but S only through the head's held keys, and the query reads
 * out = phi (S + keys^T values) as phi S plus one term per held key.
 * The held keys go into S at the head's turn, once in `capacity` steps,
 * so most steps read S without writing it: half the memory traffic of
 * the RNN step, which reads and writes all of S for one rank-1 update
 * (the chunk method's trade, one token at a time). */
static void SFX(deferred_step)(const linear_plan *p, const SFX(head) *hd, const SFX(scratch) *w,
                               SFX(state) st)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    ptrdiff_t held = hd->held;
    if (!SFX(decode_kernel)(p, hd, w, st)) {
        SFX(query_block)(p, hd, 0, 1, w);
        SFX(values) vals = SFX(key_block)(p, hd, 0, 1, w);
        memcpy(hd->held_keys + held * r, w->psi, (size_t)r * sizeof(REAL));
        memcpy(hd->held_values + held * e, vals.v, (size_t)e * sizeof(REAL));
        SFX(axpy)(st.z, 1, w->psi, r);
        held++;
        if (hd->adds_held) {
            SFX(add_held)(r, e, st.S, hd->held_keys, hd->held_values, held);
            held = 0;
        }
        SFX(state_pass)(r, e, SFX(view_of)(p, st), NULL, NULL, st, w->phi, hd->out, w->den);
        SFX(add_held_terms)(r, e, w->phi, hd->held_keys, hd->held_values, held, hd->out);
    }
    SFX(finish_rows)(p, 1, w, hd->out);
}

/* prefix[t] = the state after the keys [K, K + t), every one of them held
 * in memory ((m - K + 1) states); query i contracts the prefix of the keys
 * it sees. */
static void SFX(cumsum_rows)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t qa,
                             ptrdiff_t qb, SFX(view) from, ptrdiff_t K, int last,
                             const SFX(scratch) *w, SFX(state) st)
{
    const attnx_linear_args *a = p->a;
    const ptrdiff_t size = p->state_size;
    SFX(state_load)(p, SFX(state_in)(p, w->prefix), from);
    for (ptrdiff_t b = K; b < a->m && !linear_stopped(a->interrupt); b += p->C) {
        ptrdiff_t cols = ATTNX_MIN(p->C, a->m - b);
        SFX(key_block)(p, hd, b, cols, w);
        for (ptrdiff_t t = 0; t < cols; t++) {
            REAL *next = w->prefix + (b + t - K + 1) * size;
            SFX(view) previous = SFX(view_of)(p, SFX(state_in)(p, next - size));
            if (SFX(key_kept)(p, hd, b + t))
                SFX(state_pass)(p->r, a->e, previous, w->psi + t * p->r, hd->v + (b + t) * a->v_row,
                                SFX(state_in)(p, next), NULL, NULL, NULL);
            else
                SFX(state_load)(p, SFX(state_in)(p, next), previous);
        }
    }
    for (ptrdiff_t i0 = qa; i0 < qb && !linear_stopped(a->interrupt); i0 += p->C) {
        ptrdiff_t rows = ATTNX_MIN(p->C, qb - i0);
        REAL *out = hd->out + i0 * a->out_row;
        SFX(query_block)(p, hd, i0, rows, w);
        for (ptrdiff_t t = 0; t < rows; t++) {
            ptrdiff_t seen = ATTNX_MAX(attnx_band_end(&a->band, i0 + t) - K, 0);
            SFX(view) prefix = SFX(view_of)(p, SFX(state_in)(p, w->prefix + seen * size));
            SFX(state_pass)(p->r, a->e, prefix, NULL, NULL, st, w->phi + t * p->r,
                            out + t * a->out_row, &w->den[t]);
        }
        SFX(finish_rows)(p, rows, w, out);
    }
    if (last)
        SFX(state_load)(p, st, SFX(view_of)(p, SFX(state_in)(p, w->prefix + (a->m - K) * size)));
}

/* ---------------------------------------------------------------- drivers */

static void SFX(prepare_head)(const linear_plan *p, const SFX(head) *hd, const SFX(scratch) *w)
{
    const attnx_linear_args *a = p->a;
    if (a->features.kind == ATTNX_FM_EFFICIENT)
        SFX(attnx_key_column_max)(hd->k, a->k_row, a->m, a->d, hd->key_mask, a->key_mask_col,
                                  w->col_shift);
}

/* first query of segment s, on a chunk boundary */
static ptrdiff_t SFX(segment_query)(const linear_plan *p, ptrdiff_t s)
{
    if (s >= p->segs) return p->a->n;
    return p->a->n * s / p->segs / p->C * p->C;
}

/* K_s: the keys in the state segment s starts from (causal: those before
 * its first query's diagonal block; non-causal: an even split of the keys,
 * since every segment's queries see them all). */
static ptrdiff_t SFX(segment_key)(const linear_plan *p, ptrdiff_t s)
{
    const attnx_linear_args *a = p->a;
    if (s <= 0) return 0;
    if (s >= p->segs) return a->m;
    return p->causal ? attnx_band_end(&a->band, SFX(segment_query)(p, s) - 1) : a->m * s / p->segs;
}

/* segments whose keys lie entirely before segment s's queries */
static ptrdiff_t SFX(covered)(const linear_plan *p, ptrdiff_t s) { return p->causal ? s : p->segs; }

/* phase A: state increment of piece `piece` of segment t's keys */
static void SFX(segment_increment)(const linear_plan *p, ptrdiff_t item, REAL *block,
                                   const SFX(scratch) *w)
{
    ptrdiff_t h = item / (p->needed * p->split), t = item / p->split % p->needed;
    ptrdiff_t piece = item % p->split;
    SFX(head) hd = SFX(head_at)(p->a, h);
    ptrdiff_t first = SFX(segment_key)(p, t), span = SFX(segment_key)(p, t + 1) - first;
    SFX(state) delta = SFX(state_in)(p, block);
    memset(block, 0, (size_t)p->state_size * sizeof(REAL));
    SFX(prepare_head)(p, &hd, w);
    SFX(absorb)(p, &hd, first + span * piece / p->split, first + span * (piece + 1) / p->split, w,
                delta);
}

/* phase B: start_s = S0 + the increments of the segments before s */
static void SFX(segment_starts)(const linear_plan *p, ptrdiff_t h, const REAL *deltas,
                                REAL *starts, const SFX(scratch) *w)
{
    const ptrdiff_t size = p->state_size;
    SFX(head) hd = SFX(head_at)(p->a, h);
    for (ptrdiff_t s = 0; s < p->segs; s++) {
        REAL *start = starts + (h * p->segs + s) * size;
        if (s == 0)
            SFX(state_load)(p, SFX(state_in)(p, start), SFX(initial_view)(&hd, p->a->S0_row, w->zeros));
        else memcpy(start, start - size, (size_t)size * sizeof(REAL));
        for (ptrdiff_t t = s == 0 ? 0 : SFX(covered)(p, s - 1); t < SFX(covered)(p, s); t++)
            for (ptrdiff_t piece = 0; piece < p->split; piece++)
                SFX(axpy)(start, 1, deltas + ((h * p->needed + t) * p->split + piece) * size, size);
    }
}

/* phase C (or the whole head when segs == 1): segment s of head h */
static void SFX(segment_rows)(const linear_plan *p, SFX(rows_fn) rows_fn, ptrdiff_t item,
                              REAL *starts, const SFX(scratch) *w)
{
    const attnx_linear_args *a = p->a;
    ptrdiff_t h = item / p->segs, s = item % p->segs;
    SFX(head) hd = SFX(head_at)(a, h);
    SFX(state) own = {hd.S_out, hd.z_out}, st;
    SFX(view) from;
    int last = a->S_out && s == p->segs - 1;
    ptrdiff_t K = 0;
    SFX(prepare_head)(p, &hd, w);
    if (p->segs > 1) {
        st = SFX(state_in)(p, starts + item * p->state_size);
        from = SFX(view_of)(p, st);
        K = SFX(segment_key)(p, SFX(covered)(p, s));
    } else {
        /* one segment: run in the returned state itself when there is one */
        st = a->S_out ? own : SFX(state_in)(p, w->state);
        from = SFX(initial_view)(&hd, a->S0_row, w->zeros);
    }
    rows_fn(p, &hd, SFX(segment_query)(p, s), SFX(segment_query)(p, s + 1), from, K, last, w, st);
    if (last && p->segs > 1) SFX(state_load)(p, own, SFX(view_of)(p, st));
}

/* Thread `me` of `team` takes one fixed run of items (their work is
 * even): from one decoding step to the next, a head's state then stays in
 * the cache of the same core. The calling thread may have just written
 * the offsets table (the general binding makes one per call; the lean step
 * keeps its own, py_linear.c's kept_table), so the others' first reads of
 * it could miss one after another: their part is requested up front. */
static void SFX(scan_share)(const linear_plan *p, SFX(rows_fn) rows_fn, REAL *starts,
                            REAL *scratch, size_t per_thread, ptrdiff_t me, ptrdiff_t range,
                            ptrdiff_t ranges)
{
    const attnx_linear_args *a = p->a;
    ptrdiff_t items = a->heads * p->segs, first = items * range / ranges;
    ptrdiff_t end = items * (range + 1) / ranges;
    const char *table = (const char *)(a->offsets + first / p->segs * ATTNX_LIN_NOPS);
    size_t bytes = (size_t)((end - first) / p->segs + 1) * ATTNX_LIN_NOPS * sizeof(ptrdiff_t);
    for (size_t b = 0; b < bytes; b += ATTNX_CACHE_LINE) __builtin_prefetch(table + b);
    SFX(scratch) w = SFX(scratch_at)(p, scratch + per_thread * me);
    /* decoding steps take their heads forwards and backwards in turn: the
     * states read last are still in L1 when the next step starts */
    int backwards = a->pending.psi && a->pending.tick % 2;
    for (ptrdiff_t i = 0; i < end - first && !linear_stopped(a->interrupt); i++) {
        ptrdiff_t item = backwards ? end - 1 - i : first + i;
        if (!a->pending.psi) {
            SFX(segment_rows)(p, rows_fn, item, starts, &w);
            continue;
        }
        /* a decoding step: four heads at once where they can, else one
         * head per item, one segment, in its own state */
        if (i + DECODE_GROUP <= end - first) {
            ptrdiff_t items[DECODE_GROUP];
            for (int j = 0; j < DECODE_GROUP; j++) items[j] = backwards ? item - j : item + j;
            if (SFX(decode_group)(p, items, &w)) {
                i += DECODE_GROUP - 1;
                continue;
            }
        }
        SFX(head) hd = SFX(head_at)(a, item);
        SFX(deferred_step)(p, &hd, &w, (SFX(state)){hd.S_out, hd.z_out});
    }
}

/* scan_share as a task of attnx_team_run */
typedef struct {
    const linear_plan *p;
    SFX(rows_fn) rows_fn;
    REAL *starts, *scratch;
    size_t per_thread;
} SFX(scan_task);

static void SFX(scan_member)(void *context, int member, int range, int ranges)
{
    const SFX(scan_task) *t = context;
    SFX(scan_share)(t->p, t->rows_fn, t->starts, t->scratch, t->per_thread, member, range,
                    ranges);
}

static int SFX(run_scan)(const linear_plan *p, REAL *scratch, size_t per_thread)
{
    const attnx_linear_args *a = p->a;
    const ptrdiff_t size = p->state_size;
    SFX(rows_fn) rows_fn = a->method == ATTNX_METHOD_RECURRENT ? SFX(recurrent_rows)
                           : a->method == ATTNX_METHOD_CUMSUM  ? SFX(cumsum_rows)
                                                               : SFX(chunk_rows);
    REAL *deltas = NULL, *starts = NULL;
    if (p->segs > 1) {
        ptrdiff_t increments = a->heads * p->needed * p->split;
        deltas = malloc((size_t)(increments + a->heads * p->segs) * (size_t)size * sizeof(REAL));
        if (!deltas) return ATTNX_ENOMEM;
        starts = deltas + increments * size;
#pragma omp parallel for num_threads(attnx_omp_threads(p->threads)) schedule(dynamic, 1)
        for (ptrdiff_t item = 0; item < increments; item++) {
            if (linear_stopped(a->interrupt)) continue;
            SFX(scratch) w = SFX(scratch_at)(p, scratch + per_thread * omp_get_thread_num());
            SFX(segment_increment)(p, item, deltas + item * size, &w);
        }
#pragma omp parallel for num_threads(attnx_omp_threads(p->threads))
        for (ptrdiff_t h = 0; h < a->heads; h++) {
            SFX(scratch) w = SFX(scratch_at)(p, scratch + per_thread * omp_get_thread_num());
            SFX(segment_starts)(p, h, deltas, starts, &w);
        }
    }
    /* one thread runs on the caller: a parallel region of one costs a
     * tenth of a one-head decoding step (docs/performance.md, the C code's choices) */
    int finished = 0;
    /* a decoding step splits over attnx's own team (team.c), which starts
     * and joins in a ninth of what a parallel region takes, when the team
     * is free */
    int decoding = a->n <= 1 && a->m <= 1;
    SFX(scan_task) task = {p, rows_fn, starts, scratch, per_thread};
    if (p->threads == 1) {
        SFX(scan_share)(p, rows_fn, starts, scratch, per_thread, 0, 0, 1);
    } else if (!decoding || !attnx_team_run(p->threads, SFX(scan_member), &task)) {
#pragma omp parallel num_threads(decoding ? p->threads : attnx_omp_threads(p->threads))
        {
            SFX(scan_share)(p, rows_fn, starts, scratch, per_thread, omp_get_thread_num(),
                            omp_get_thread_num(), omp_get_num_threads());
            linear_share_done(a->interrupt, &finished, omp_get_num_threads());
        }
    }
    free(deltas);
    return a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
}

/* The quadratic form for the query tile [i0, i0 + rows): explicit scores
 * against every key block the rows can see, plus the initial state. */
static void SFX(quadratic_tile)(const linear_plan *p, const SFX(head) *hd, ptrdiff_t i0,
                                ptrdiff_t rows, const SFX(scratch) *w)
{
    const attnx_linear_args *a = p->a;
    REAL *out = hd->out + i0 * a->out_row;
    SFX(query_block)(p, hd, i0, rows, w);
    if (hd->S0) {
        SFX(read_state)(p, rows, hd->S0, a->S0_row, hd->z0, w, out);
    } else {
        for (ptrdiff_t t = 0; t < rows; t++) memset(out + t * a->out_row, 0, (size_t)a->e * sizeof(REAL));
        memset(w->den, 0, (size_t)rows * sizeof(REAL));
    }
    ptrdiff_t end = attnx_band_end(&a->band, i0 + rows - 1);
    for (ptrdiff_t j0 = attnx_band_first(&a->band, i0); j0 < end && !linear_stopped(a->interrupt);
         j0 += p->C) {
        ptrdiff_t cols = ATTNX_MIN(p->C, end - j0);
        SFX(add_block)(p, hd, i0, rows, j0, cols, SFX(key_block)(p, hd, j0, cols, w), w, out);
    }
    SFX(finish_rows)(p, rows, w, out);
}

static int SFX(run_quadratic)(const linear_plan *p, REAL *scratch, size_t per_thread)
{
    const attnx_linear_args *a = p->a;
    ptrdiff_t tiles = (a->n + p->C - 1) / p->C;
    int finished = 0;
#pragma omp parallel num_threads(attnx_omp_threads(p->threads))
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (ptrdiff_t item = 0; item < a->heads * tiles; item++) {
            if (linear_stopped(a->interrupt)) continue;
            SFX(scratch) w = SFX(scratch_at)(p, scratch + per_thread * omp_get_thread_num());
            SFX(head) hd = SFX(head_at)(a, item / tiles);
            ptrdiff_t i0 = item % tiles * p->C;
            SFX(quadratic_tile)(p, &hd, i0, ATTNX_MIN(p->C, a->n - i0), &w);
        }
        linear_share_done(a->interrupt, &finished, omp_get_num_threads());
    }
    if (a->interrupt && a->interrupt->stopped) return ATTNX_EINTR;
    if (!a->S_out) return ATTNX_OK;
    /* the returned state: every key of the call */
#pragma omp parallel for num_threads(attnx_omp_threads(p->threads))
    for (ptrdiff_t h = 0; h < a->heads; h++) {
        SFX(scratch) w = SFX(scratch_at)(p, scratch + per_thread * omp_get_thread_num());
        SFX(head) hd = SFX(head_at)(a, h);
        SFX(state) own = {hd.S_out, hd.z_out};
        SFX(state_load)(p, own, SFX(initial_view)(&hd, a->S0_row, w.zeros));
        SFX(absorb)(p, &hd, 0, a->m, &w, own);
    }
    return a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
}

/* How to cut the work: segments per head for the chunk method when there
 * are fewer heads than threads, and the threads that fit the memory. */
static linear_plan SFX(make_plan)(const attnx_linear_args *a)
{
    linear_plan p = {.a = a, .r = a->features.r, .C = a->chunk, .causal = a->band.has_hi,
                     .segs = 1, .needed = 0, .split = 1};
    p.state_size = p.r * a->e + p.r;
#if !REAL_IS_DOUBLE && defined(CHUNK_KERNELS)
    /* the fused kernel: whole chunks of 16 under a causal band that opens
     * at key 0, features in blocks of 8, values in blocks of 16 */
    if (p.C == KERNEL_CHUNK && p.r % 8 == 0 && a->e % 16 == 0 && !a->band.has_lo)
        p.chunk_kernel = chunk_kernel_width(ATTNX_FAMILY_LINEAR_FWD);
#endif
#if !REAL_IS_DOUBLE && (defined(MK_HAVE_X86) || defined(MK_HAVE_NEON))
    /* the decoding kernels of the decoding family's set: r and e whole vectors */
    int decode_set = attnx_kernels(ATTNX_FAMILY_DECODE), lanes = attnx_kernels_width(decode_set);
    int whole = lanes && p.r % lanes == 0 && a->e % lanes == 0;
    p.decode_kernel = whole && a->pending.psi && a->pending.capacity <= MK_DECODE_HELD ? lanes : 0;
    p.decode_group = p.decode_kernel == 16 && decode_set == ATTNX_KERNELS_AVX512_GROUP &&
                     a->features.kind == ATTNX_FM_ELU && a->normalise;
    /* the single-token call: its query sees its key, and no segments */
    p.step_kernel = whole && !a->pending.psi && a->method == ATTNX_METHOD_RECURRENT &&
                    a->n == 1 && a->m == 1 && !a->band.has_lo &&
                    attnx_band_end(&a->band, 0) == 1 ? lanes : 0;
#endif
    p.key_log_scale = SFX(attnx_key_log_scale)(&a->features);
    ptrdiff_t threads = ATTNX_MAX(a->num_threads, 1);
    /* the state's GEMMs (queries read it, keys enter it), plus the blocks of scores */
    double flops = 2.0 * (double)a->heads *
                   ((double)(a->n + a->m) * (double)(p.r * a->e) +
                    (double)a->n * (double)ATTNX_MIN(p.C, a->m) * (double)(p.r + a->e));
    /* a decoding step is few flops but a pass over every head's state */
    double state_bytes = (double)a->heads * (double)p.state_size * sizeof(REAL);
    if (flops < MIN_PARALLEL_FLOPS && state_bytes < MIN_PARALLEL_STATE_BYTES) threads = 1;
    if (a->method == ATTNX_METHOD_CHUNK && a->heads < threads) {
        ptrdiff_t length = p.causal ? a->n : ATTNX_MAX(a->n, a->m);
        ptrdiff_t longest = length / (MIN_SEGMENT_CHUNKS * p.C);
        p.segs = ATTNX_MAX(1, ATTNX_MIN((threads + a->heads - 1) / a->heads, longest));
    }
    if (p.segs > 1) {
        p.needed = p.causal ? p.segs - 1 : p.segs;
        p.split = ATTNX_MAX(1, (threads + a->heads * p.needed - 1) / (a->heads * p.needed));
    }
    ptrdiff_t work = a->method == ATTNX_METHOD_QUADRATIC ? a->heads * ((a->n + p.C - 1) / p.C)
                                                         : a->heads * p.segs;
    p.threads = (int)ATTNX_MIN(threads, ATTNX_MAX(work, a->heads * p.needed * p.split));
    if (a->method == ATTNX_METHOD_CUMSUM) {
        size_t prefix_bytes = (size_t)(a->m + 1) * (size_t)p.state_size * sizeof(REAL);
        /* no features (r = 0): the prefix tensor is empty, nothing to ration */
        size_t fitting = prefix_bytes ? ATTNX_CUMSUM_LIMIT / prefix_bytes : (size_t)p.threads;
        if ((size_t)p.threads > fitting) p.threads = (int)ATTNX_MAX(fitting, 1);
    }
    p.threads = ATTNX_MAX(p.threads, 1);
    return p;
}

int TYPED(attnx_linear_fwd_f32, attnx_linear_fwd_f64)(const attnx_linear_args *a)
{
    if (a->heads == 0 || (a->n == 0 && !a->S_out)) return ATTNX_OK;
    linear_plan p = SFX(make_plan)(a);
    size_t per_thread = SFX(scratch_size)(&p), total = per_thread * (size_t)p.threads;
    /* a decoding step's scratch (a few rows per thread) lives on the stack:
     * from the heap it cost a tenth of a one-head step in malloc_consolidate */
    _Alignas(ATTNX_CACHE_LINE) REAL small_scratch[SMALL_SCRATCH];
    REAL *scratch = total <= SMALL_SCRATCH
                        ? small_scratch
                        : attnx_aligned_alloc(ATTNX_CACHE_LINE, total * sizeof(REAL));
    if (!scratch) return ATTNX_ENOMEM;
    int status = a->method == ATTNX_METHOD_QUADRATIC ? SFX(run_quadratic)(&p, scratch, per_thread)
                                                     : SFX(run_scan)(&p, scratch, per_thread);
    if (scratch != small_scratch) attnx_aligned_free(scratch);
    return status;
}

void TYPED(attnx_linear_flush_f32, attnx_linear_flush_f64)(
    void *S_data, const attnx_pending *pending, ptrdiff_t heads, ptrdiff_t r, ptrdiff_t e,
    int num_threads)
{
    REAL *S = S_data;
    const ptrdiff_t capacity = pending->capacity;
#pragma omp parallel for num_threads(attnx_omp_threads(ATTNX_MAX(num_threads, 1)))
    for (ptrdiff_t h = 0; h < heads; h++)
        SFX(add_held)(r, e, S + h * r * e, (const REAL *)pending->psi + h * capacity * r,
                      (const REAL *)pending->v + h * capacity * e,
                      attnx_pending_rows(pending->tick, h, capacity));
}

/* ================================================================ backward
 *
 * The gradients of sum(dout * out) (attnx.h, attnx_linear_bwd_args). Per
 * query row, from the forward's num_i = phi_i S_i, den_i = phi_i . z_i:
 *   a_i = dout_i / D_i,  b_i = -(dout_i . o_i) / den_i   (D_i = max(den_i, eps_i);
 *   b_i = 0 where the clamp binds, a_i = b_i = 0 where den_i == 0)
 *   dphi_i = S_i a_i + b_i z_i
 * and per key, with (dS_j, dz_j) = sum over the rows i that see key j of
 * (phi_i a_i^T, phi_i b_i), the gradient reaching the state from them:
 *   dpsi_j = dS_j v_j + dz_j,  dv_j = psi_j dS_j.
 * The backward of the state is a state running the other way, so one head
 * takes two passes:
 *  (1) the queries in order, with (S, z) carried forward as in the
 *      forward's chunk method: num, den, then a, b (only 1 / D_i and b_i
 *      are kept, two numbers a row), dphi and dq;
 *  (2) the chunks in reverse, with (dS, dz) carried backward: each chunk's
 *      keys take dpsi, dv from the later rows' (dS, dz) plus the masked
 *      block against the chunk's own rows, then (dS, dz) += phi^T (a, b).
 * Non-causal: (1) absorbs every key first and completes (dS, dz), so (2)
 * takes the keys in any order. The quadratic form: (1) per tile of rows
 * against every key block it sees, (2) per key block against every tile of
 * rows that sees it, the state only carrying S0 and the gradient at the
 * returned state. Memory: O(C (r + e) + r e) per thread plus 2 n numbers.
 * Float32 on AVX-512, AVX2 or NEON, whole causal chunks of 16 take each
 * pass's steps in one fused kernel (bwd_fused_chunk; mk_linear.h), on
 * AVX-512 about twice as fast as the steps below at their best chunk
 * (docs/performance.md, the C code's choices).
 *
 * FAVOR+ runs on the stabilised features (as the forward does, the clamp
 * scaled alike): the attention does not depend on the stabilisers, so
 * they are constants here, and the feature derivative works with
 * G = dfeat * feat, where they cancel (features.c).
 */


/* One head's operands, positioned once. */
typedef struct {
    const REAL *q, *k, *v, *dout;
    const unsigned char *key_mask, *mask;
    const REAL *S0, *z0, *dS_in, *dz_in;
    REAL *dq, *dk, *dv, *dS0, *dz0;
} SFX(bhead);

/* One thread's scratch. */
typedef struct {
    REAL *phi, *psi, *dphi, *dpsi;  /* (C, r) */
    REAL *values;                   /* (C, e) a key block's values, masked keys' rows zeroed */
    REAL *ga;                       /* (C, e) a of a block of rows (first num) */
    REAL *gb, *den, *log_scale;     /* (C,) b, den, the favor query stabilisers */
    REAL *scores, *dscores;         /* (C, C) phi psi^T and its gradient, on one block */
    REAL *col_shift;                /* (d,) efficient attention: key column max */
    REAL *key_norm;                 /* (r,) efficient attention: 1 / sum_j exp(k_jf - max_f) */
    REAL *col_dot;                  /* (r,) efficient attention: sum_j psi_jf dpsi_jf */
    REAL *S, *z, *dS, *dz;          /* (r, e), (r,), (r, e), (r,) */
    REAL *zeros;                    /* (max(r, e),) */
    REAL *inv_den, *row_b;          /* (n,), (n,): 1 / D_i and b_i of the head's rows */
    REAL *dW;                       /* (r, d) this thread's projection gradient, or NULL */
    REAL *prefix;                   /* cumsum: (m + 1) states (r, e) then (r,) */
    REAL *lanes;                    /* the fused kernels' scratch, or NULL */
    unsigned char *fused;           /* (n / KERNEL_CHUNK,) pass (1) ran the chunk fused, or NULL */
} SFX(bscratch);

/* numbers of the fused kernels' scratch (0 where they do not run) */
static size_t SFX(bwd_lanes_size)(const bwd_plan *p)
{
#if !REAL_IS_DOUBLE && defined(CHUNK_KERNELS)
    /* then a byte per chunk: which chunks pass (1) fused */
    if (p->chunk_kernel)
        return (size_t)MK_BWD_SCRATCH(p->r, p->a->e) +
               (size_t)(p->a->n / KERNEL_CHUNK + (ptrdiff_t)sizeof(REAL)) / sizeof(REAL);
#endif
    (void)p;
    return 0;
}

static size_t SFX(bwd_scratch_size)(const bwd_plan *p)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t C = p->C, r = p->r, e = a->e;
    size_t size = (size_t)(4 * C * r + 2 * C * e + 3 * C + 2 * C * C + a->d + 3 * r +
                           2 * (r * e + r) + ATTNX_MAX(r, e) + 2 * a->n);
    if (a->dW) size += (size_t)(r * a->d);
    if (a->method == ATTNX_METHOD_CUMSUM) size += (size_t)(a->m + 1) * (size_t)(r * e + r);
    size += SFX(bwd_lanes_size)(p);
    size_t line = ATTNX_CACHE_LINE / sizeof(REAL);
    return (size + line - 1) / line * line;
}

static SFX(bscratch) SFX(bscratch_at)(const bwd_plan *p, REAL *block)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t C = p->C, r = p->r, e = a->e;
    SFX(bscratch) w;
    w.phi = block;
    w.psi = w.phi + C * r;
    w.dphi = w.psi + C * r;
    w.dpsi = w.dphi + C * r;
    w.values = w.dpsi + C * r;
    w.ga = w.values + C * e;
    w.gb = w.ga + C * e;
    w.den = w.gb + C;
    w.log_scale = w.den + C;
    w.scores = w.log_scale + C;
    w.dscores = w.scores + C * C;
    w.col_shift = w.dscores + C * C;
    w.key_norm = w.col_shift + a->d;
    w.col_dot = w.key_norm + r;
    w.S = w.col_dot + r;
    w.z = w.S + r * e;
    w.dS = w.z + r;
    w.dz = w.dS + r * e;
    w.zeros = w.dz + r;
    w.inv_den = w.zeros + ATTNX_MAX(r, e);
    w.row_b = w.inv_den + a->n;
    w.dW = a->dW ? w.row_b + a->n : NULL;
    w.prefix = (a->dW ? w.dW + r * a->d : w.row_b + a->n);
    w.lanes = p->chunk_kernel ? w.prefix : NULL;  /* the chunk method keeps no prefix states */
    w.fused = NULL;
#if !REAL_IS_DOUBLE && defined(CHUNK_KERNELS)
    if (p->chunk_kernel) w.fused = (unsigned char *)(w.lanes + MK_BWD_SCRATCH(r, e));
#endif
    memset(w.zeros, 0, (size_t)ATTNX_MAX(r, e) * sizeof(REAL));
    return w;
}

static SFX(bhead) SFX(bhead_at)(const attnx_linear_bwd_args *a, ptrdiff_t h)
{
    const ptrdiff_t *off = a->offsets + h * ATTNX_LINB_NOPS;
#define AT(ptr, op) (ptr ? (REAL *)((char *)(ptr) + off[op]) : NULL)
    SFX(bhead) hd = {
        .q = AT(a->q, ATTNX_LINB_Q), .k = AT(a->k, ATTNX_LINB_K), .v = AT(a->v, ATTNX_LINB_V),
        .dout = AT(a->dout, ATTNX_LINB_DOUT),
        .key_mask = a->key_mask ? a->key_mask + off[ATTNX_LINB_KEY_MASK] : NULL,
        .mask = a->mask ? a->mask + off[ATTNX_LINB_MASK] : NULL,
        .S0 = AT(a->S0, ATTNX_LINB_S0), .z0 = AT(a->z0, ATTNX_LINB_Z0),
        .dS_in = AT(a->dS_in, ATTNX_LINB_DS_IN), .dz_in = AT(a->dz_in, ATTNX_LINB_DZ_IN),
        .dq = AT(a->dq, ATTNX_LINB_DQ), .dk = AT(a->dk, ATTNX_LINB_DK),
        .dv = AT(a->dv, ATTNX_LINB_DV), .dS0 = AT(a->dS0, ATTNX_LINB_DS0),
        .dz0 = AT(a->dz0, ATTNX_LINB_DZ0),
    };
#undef AT
    return hd;
}

/* dst (r, e) contiguous, and dst_z = the state from (rows S_row apart) or zeros */
static void SFX(bwd_load)(const bwd_plan *p, REAL *dst, REAL *dst_z, const REAL *S, ptrdiff_t S_row,
                          const REAL *z)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    if (!S) {
        memset(dst, 0, (size_t)(r * e) * sizeof(REAL));
        memset(dst_z, 0, (size_t)r * sizeof(REAL));
        return;
    }
    for (ptrdiff_t f = 0; f < r; f++) memcpy(dst + f * e, S + f * S_row, (size_t)e * sizeof(REAL));
    memcpy(dst_z, z, (size_t)r * sizeof(REAL));
}

static int SFX(bwd_key_kept)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t j)
{
    return !hd->key_mask || hd->key_mask[j * p->a->key_mask_col];
}

/* psi of the keys [j0, j0 + cols) into w->psi (efficient attention:
 * normalised over the keys), with zero rows for keys removed by key_mask,
 * and the values to use with them: in place, or, when the block has a
 * removed key, a copy with its row zeroed (nothing of a removed key, not
 * even a NaN value, reaches a gradient) */
static SFX(values) SFX(bwd_keys)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t j0,
                                 ptrdiff_t cols, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t r = p->r, e = a->e;
    SFX(values) vals = {hd->v + j0 * a->v_row, a->v_row};
    int removed = 0;
    SFX(attnx_features)(&a->features, 1, hd->k + j0 * a->k_row, a->k_row, cols, j0,
                        p->key_log_scale, w->col_shift, w->psi, NULL);
    for (ptrdiff_t t = 0; t < cols; t++) {
        REAL *psi_t = w->psi + t * r;
        if (!SFX(bwd_key_kept)(p, hd, j0 + t)) {
            memset(psi_t, 0, (size_t)r * sizeof(REAL));
            removed = 1;
        } else if (a->features.kind == ATTNX_FM_EFFICIENT) {
            for (ptrdiff_t f = 0; f < r; f++) psi_t[f] *= w->key_norm[f];
        }
    }
    if (!removed) return vals;
    for (ptrdiff_t t = 0; t < cols; t++) {
        REAL *value = w->values + t * e;
        if (SFX(bwd_key_kept)(p, hd, j0 + t)) memcpy(value, vals.v + t * vals.v_row, (size_t)e * sizeof(REAL));
        else memset(value, 0, (size_t)e * sizeof(REAL));
    }
    vals.v = w->values;
    vals.v_row = e;
    return vals;
}

static void SFX(bwd_queries)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0, ptrdiff_t rows,
                             const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    SFX(attnx_features)(&a->features, 0, hd->q + i0 * a->q_row, a->q_row, rows, i0, 0, NULL,
                        w->phi, w->log_scale);
}

/* Row i of a block from key j0 sees the keys [*lo, *hi) of the block,
 * where its mask (returned, NULL when none) is True. */
static const unsigned char *SFX(bwd_row_span)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i,
                                              ptrdiff_t j0, ptrdiff_t cols, ptrdiff_t *lo,
                                              ptrdiff_t *hi)
{
    const attnx_linear_bwd_args *a = p->a;
    *lo = ATTNX_MAX(attnx_band_first(&a->band, i), j0) - j0;
    *hi = ATTNX_MAX(ATTNX_MIN(attnx_band_end(&a->band, i), j0 + cols) - j0, *lo);
    return hd->mask ? hd->mask + i * a->mask_row + j0 * a->mask_col : NULL;
}

/* scores = phi psi^T on the block (rows from i0, keys from j0), invisible
 * pairs zeroed, and with den, den += the row sums. As in the forward, a
 * negative similarity (rounding in taylor's 1 + cos) is kept at 0; its
 * derivative is left alone, 1 + cos having a zero gradient at its minimum. */
static ATTNX_HOT void SFX(bwd_scores)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                      ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols,
                                      const SFX(bscratch) *w, REAL *den)
{
    const ptrdiff_t C = p->C, r = p->r, mask_col = p->a->mask_col;
    SFX(gemm)(0, 1, rows, cols, r, 1, w->phi, r, w->psi, r, 0, w->scores, C);
    for (ptrdiff_t t = 0; t < rows; t++) {
        ptrdiff_t lo, hi;
        const unsigned char *mask_ij = SFX(bwd_row_span)(p, hd, i0 + t, j0, cols, &lo, &hi);
        REAL *s = w->scores + t * C, sum = 0;
        for (ptrdiff_t j = 0; j < lo; j++) s[j] = 0;
        for (ptrdiff_t j = hi; j < cols; j++) s[j] = 0;
        if (mask_ij)
            for (ptrdiff_t j = lo; j < hi; j++) s[j] = mask_ij[j * mask_col] ? s[j] : 0;
#pragma omp simd reduction(+ : sum)
        for (ptrdiff_t j = lo; j < hi; j++) {
            s[j] = s[j] < 0 ? 0 : s[j];
            sum += s[j];
        }
        if (den) den[t] += sum;
    }
}

/* out (rows, width) += blk B over the block (rows from i0, keys from j0),
 * blk (rows, cols) rows C apart with its invisible pairs zero, B (cols,
 * width); with keys_first, out (cols, width) += blk^T B, B (rows, width).
 * A GEMM, unless B holds inf or NaN: then a loop over the visible pairs
 * only, since a zeroed pair would still carry 0 * NaN into a row or key
 * that the non-finite input does not reach. */
static void SFX(bwd_block_product)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                   ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols, int keys_first,
                                   const REAL *blk, const REAL *B, ptrdiff_t B_row, ptrdiff_t width,
                                   REAL *out, ptrdiff_t out_row)
{
    const ptrdiff_t C = p->C, mask_col = p->a->mask_col;
    ptrdiff_t inner = keys_first ? rows : cols;
    if (!SFX(has_nonfinite)(B, inner, width, B_row)) {
        if (keys_first) SFX(gemm)(1, 0, cols, width, rows, 1, blk, C, B, B_row, 1, out, out_row);
        else SFX(gemm)(0, 0, rows, width, cols, 1, blk, C, B, B_row, 1, out, out_row);
        return;
    }
    for (ptrdiff_t t = 0; t < rows; t++) {
        ptrdiff_t lo, hi;
        const unsigned char *mask_ij = SFX(bwd_row_span)(p, hd, i0 + t, j0, cols, &lo, &hi);
        for (ptrdiff_t j = lo; j < hi; j++) {
            if (mask_ij && !mask_ij[j * mask_col]) continue;
            if (keys_first) SFX(axpy)(out + j * out_row, blk[t * C + j], B + t * B_row, width);
            else SFX(axpy)(out + t * out_row, blk[t * C + j], B + j * B_row, width);
        }
    }
}

/* w->ga (rows, e) += scores values, w->den += the row sums: what the key
 * block in w->psi, w->values gives the rows in w->phi */
static void SFX(bwd_add_block)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0, ptrdiff_t rows,
                               ptrdiff_t j0, ptrdiff_t cols, SFX(values) vals, const SFX(bscratch) *w)
{
    const ptrdiff_t e = p->a->e;
    SFX(bwd_scores)(p, hd, i0, rows, j0, cols, w, w->den);
    SFX(bwd_block_product)(p, hd, i0, rows, j0, cols, 0, w->scores, vals.v, vals.v_row, e, w->ga, e);
}

/* the clamp of row t of a block: eps scaled by the favor stabilisers, as
 * the forward's finish_rows */
static REAL SFX(bwd_row_eps)(const bwd_plan *p, const SFX(bscratch) *w, ptrdiff_t t)
{
    double removed = w->log_scale[t] + p->key_log_scale;
    return (REAL)(removed == 0 ? p->a->eps : exp(log(p->a->eps) - removed));
}

/* From num (in w->ga) and den of rows [i0, i0 + rows): a (into w->ga), b
 * (w->gb), kept per row in inv_den and row_b. The clamp as in the forward
 * (finish_rows): eps scaled by the favor stabilisers. */
static void SFX(bwd_row_factors)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                 ptrdiff_t rows, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t e = a->e;
    for (ptrdiff_t t = 0; t < rows; t++) {
        REAL *a_t = w->ga + t * e, den = w->den[t], inv = 0, b = 0;
        const REAL *dout_t = hd->dout + (i0 + t) * a->dout_row;
        if (den != 0) {
            REAL eps_t = SFX(bwd_row_eps)(p, w, t);
            inv = 1 / (den < eps_t ? eps_t : den);
            /* b = -(dout . o) / den with o = num / D */
            if (!(den < eps_t)) b = -SFX(dot)(dout_t, a_t, e) * inv / den;
        }
        for (ptrdiff_t c = 0; c < e; c++) a_t[c] = dout_t[c] * inv;
        w->gb[t] = b;
        w->inv_den[i0 + t] = inv;
        w->row_b[i0 + t] = b;
    }
}

/* a, b of rows [i0, i0 + rows) again, from the kept 1 / D_i and b_i */
static void SFX(bwd_row_factors_again)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                       ptrdiff_t rows, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t e = a->e;
    for (ptrdiff_t t = 0; t < rows; t++) {
        const REAL *dout_t = hd->dout + (i0 + t) * a->dout_row;
        REAL inv = w->inv_den[i0 + t], *a_t = w->ga + t * e;
#pragma omp simd
        for (ptrdiff_t c = 0; c < e; c++) a_t[c] = dout_t[c] * inv;
        w->gb[t] = w->row_b[i0 + t];
    }
}

/* dscores = a values^T + b (row-wise), invisible pairs zeroed */
static ATTNX_HOT void SFX(bwd_dscores)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                       ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols,
                                       SFX(values) vals, const SFX(bscratch) *w)
{
    const ptrdiff_t C = p->C, e = p->a->e, mask_col = p->a->mask_col;
    SFX(gemm)(0, 1, rows, cols, e, 1, w->ga, e, vals.v, vals.v_row, 0, w->dscores, C);
    for (ptrdiff_t t = 0; t < rows; t++) {
        ptrdiff_t lo, hi;
        const unsigned char *mask_ij = SFX(bwd_row_span)(p, hd, i0 + t, j0, cols, &lo, &hi);
        REAL *ds = w->dscores + t * C, b = w->gb[t];
        for (ptrdiff_t j = 0; j < lo; j++) ds[j] = 0;
        for (ptrdiff_t j = hi; j < cols; j++) ds[j] = 0;
#pragma omp simd
        for (ptrdiff_t j = lo; j < hi; j++) ds[j] += b;
        if (mask_ij)
            for (ptrdiff_t j = lo; j < hi; j++) ds[j] = mask_ij[j * mask_col] ? ds[j] : 0;
    }
}

/* dphi = a S^T + b z^T for the state (S rows S_row apart, z) */
static void SFX(bwd_dphi_state)(const bwd_plan *p, ptrdiff_t rows, const REAL *S, ptrdiff_t S_row,
                                const REAL *z, const SFX(bscratch) *w)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    SFX(gemm)(0, 1, rows, r, e, 1, w->ga, e, S, S_row, 0, w->dphi, r);
    for (ptrdiff_t t = 0; t < rows; t++) SFX(axpy)(w->dphi + t * r, w->gb[t], z, r);
}

/* dq of rows [i0, i0 + rows) from w->dphi */
static void SFX(bwd_finish_queries)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                    ptrdiff_t rows, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    SFX(attnx_features_bwd)(&a->features, 0, hd->q + i0 * a->q_row, a->q_row, rows, i0, w->phi,
                            w->dphi, NULL, hd->dq + i0 * a->dq_row, a->dq_row, w->dW);
}

/* (dS, dz) += phi^T (a, b) of a block of rows */
static void SFX(bwd_dstate_add)(const bwd_plan *p, ptrdiff_t rows, const SFX(bscratch) *w)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    SFX(gemm)(1, 0, r, e, rows, 1, w->phi, r, w->ga, e, 1, w->dS, e);
    for (ptrdiff_t t = 0; t < rows; t++) SFX(axpy)(w->dz, w->gb[t], w->phi + t * r, r);
}

/* Key block [j0, j0 + cols), in w->psi and w->values: dpsi, dv (into dv's
 * rows) from the state gradient (dS rows dS_row apart, dz) that every
 * later row gives it */
static void SFX(bwd_keys_from_state)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t j0,
                                     ptrdiff_t cols, SFX(values) vals, const REAL *dS, ptrdiff_t dS_row,
                                     const REAL *dz, const SFX(bscratch) *w)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    SFX(gemm)(0, 1, cols, r, e, 1, vals.v, vals.v_row, dS, dS_row, 0, w->dpsi, r);
    for (ptrdiff_t t = 0; t < cols; t++) SFX(axpy)(w->dpsi + t * r, 1, dz, r);
    SFX(gemm)(0, 0, cols, e, r, 1, w->psi, r, dS, dS_row, 0, hd->dv + j0 * p->a->dv_row,
              p->a->dv_row);
}

/* The key block's share of the rows [i0, i0 + rows) (phi, a, b in w):
 * dpsi += dscores^T phi, dv += scores^T a */
static void SFX(bwd_keys_from_rows)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                    ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols,
                                    SFX(values) vals, const SFX(bscratch) *w)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    SFX(bwd_scores)(p, hd, i0, rows, j0, cols, w, NULL);
    SFX(bwd_dscores)(p, hd, i0, rows, j0, cols, vals, w);
    SFX(bwd_block_product)(p, hd, i0, rows, j0, cols, 1, w->dscores, w->phi, r, r, w->dpsi, r);
    SFX(bwd_block_product)(p, hd, i0, rows, j0, cols, 1, w->scores, w->ga, e, e,
                           hd->dv + j0 * p->a->dv_row, p->a->dv_row);
}

/* dk of the key block from w->dpsi (masked keys: 0) */
static void SFX(bwd_finish_keys)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t j0,
                                 ptrdiff_t cols, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    for (ptrdiff_t t = 0; t < cols; t++)
        if (!SFX(bwd_key_kept)(p, hd, j0 + t)) memset(w->dpsi + t * p->r, 0, (size_t)p->r * sizeof(REAL));
    SFX(attnx_features_bwd)(&a->features, 1, hd->k + j0 * a->k_row, a->k_row, cols, j0, w->psi,
                            w->dpsi, w->col_dot, hd->dk + j0 * a->dk_row, a->dk_row, w->dW);
    /* a removed key's zero psi row is not its features: its derivative
     * may be anything (NaN for a NaN key), and the key has no gradient */
    for (ptrdiff_t t = 0; t < cols; t++)
        if (!SFX(bwd_key_kept)(p, hd, j0 + t)) memset(hd->dk + (j0 + t) * a->dk_row, 0, (size_t)a->d * sizeof(REAL));
}

/* keys [j0, j1) that no row of the pass below sees: only the state gradient */
static void SFX(bwd_keys_state_only)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t j0,
                                     ptrdiff_t j1, const REAL *dS, ptrdiff_t dS_row, const REAL *dz,
                                     const SFX(bscratch) *w)
{
    for (ptrdiff_t b = j0; b < j1; b += p->C) {
        ptrdiff_t cols = ATTNX_MIN(p->C, j1 - b);
        SFX(values) vals = SFX(bwd_keys)(p, hd, b, cols, w);
        SFX(bwd_keys_from_state)(p, hd, b, cols, vals, dS, dS_row, dz, w);
        SFX(bwd_finish_keys)(p, hd, b, cols, w);
    }
}

/* S += psi^T values, z += the rows of psi (the block in w) */
static void SFX(bwd_absorb_block)(const bwd_plan *p, ptrdiff_t cols, SFX(values) vals,
                                  const SFX(bscratch) *w)
{
    const ptrdiff_t r = p->r, e = p->a->e;
    SFX(gemm)(1, 0, r, e, cols, 1, w->psi, r, vals.v, vals.v_row, 1, w->S, e);
    for (ptrdiff_t t = 0; t < cols; t++) SFX(axpy)(w->z, 1, w->psi + t * r, r);
}

/* efficient attention: the key column max and 1 / the column sums of
 * exp(k - max) over the visible keys, and after pass (1), the column sums
 * of psi dpsi: sum_j psi_jf (dS_f . v_j + dz_f) = dS_f . S_f + dz_f z_f */
static void SFX(bwd_key_columns)(const bwd_plan *p, const SFX(bhead) *hd, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t r = p->r;
    SFX(attnx_key_column_max)(hd->k, a->k_row, a->m, a->d, hd->key_mask, a->key_mask_col, w->col_shift);
    for (ptrdiff_t f = 0; f < r; f++) w->key_norm[f] = 1;
    memset(w->col_dot, 0, (size_t)r * sizeof(REAL));
    for (ptrdiff_t b = 0; b < a->m; b += p->C) {
        ptrdiff_t cols = ATTNX_MIN(p->C, a->m - b);
        SFX(bwd_keys)(p, hd, b, cols, w);
        for (ptrdiff_t t = 0; t < cols; t++) SFX(axpy)(w->col_dot, 1, w->psi + t * r, r);
    }
    for (ptrdiff_t f = 0; f < r; f++) w->key_norm[f] = w->col_dot[f] > 0 ? 1 / w->col_dot[f] : 0;
}

/* Whole chunks (KERNEL_CHUNK rows against their diagonal block of as
 * many keys, features and values in w) through the fused kernels of
 * mk_linear.h of the family's width, which keep each product's block in registers: one
 * chunk of bwd_scan_head's pass (1), or with keys_pass of its pass (2).
 * Returns 0 where they do not apply (float64, other CPUs, partial chunks,
 * a block holding inf or NaN, whose zeroed pairs must not carry it),
 * leaving the chunk to the general steps. Pass (2) takes pass (1)'s
 * answer for the chunk (w->fused): the same rows against the same keys
 * (under chunk_kernel's band), so the same operands. */
static int SFX(bwd_fused_chunk)(const bwd_plan *p, const SFX(bhead) *hd, ptrdiff_t i0,
                                ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols, SFX(values) vals,
                                const SFX(bscratch) *w, int keys_pass)
{
#if !REAL_IS_DOUBLE && defined(CHUNK_KERNELS)
    const attnx_linear_bwd_args *a = p->a;
    const float *dout = hd->dout + i0 * a->dout_row;
    if (!p->chunk_kernel || rows != KERNEL_CHUNK || cols != KERNEL_CHUNK) return 0;
    unsigned char *fused = &w->fused[i0 / KERNEL_CHUNK];
    if (!keys_pass)
        *fused = !SFX(has_nonfinite)(vals.v, cols, a->e, vals.v_row) &&
                 !SFX(has_nonfinite)(dout, rows, a->e, a->dout_row) &&
                 !SFX(has_nonfinite)(w->phi, rows, p->r, p->r) &&
                 !SFX(has_nonfinite)(w->psi, cols, p->r, p->r);
    if (!*fused) return 0;
    /* the band opens at key 0 (chunk_kernel), so row t sees [0, visible[t]) */
    int visible[KERNEL_CHUNK];
    for (ptrdiff_t t = 0; t < rows; t++) {
        ptrdiff_t first, end;
        SFX(bwd_row_span)(p, hd, i0 + t, j0, cols, &first, &end);
        visible[t] = (int)end;
    }
    /* Pass (1) keeps the block's P^T and ds in the chunk's rows of dk
     * (32 numbers a row), which nothing writes before pass (2) has read
     * them: pass (2) writes dk only for keys from the block's first key
     * j0 >= i0 on, going down, so the rows of the chunks still to come
     * are untouched. That spares pass (2) two of the block's products
     * (the backward 5% faster: docs/performance.md, the C code's choices). */
    float *kept = a->d >= 32 && j0 >= i0 ? hd->dk + i0 * a->dk_row : NULL;
    /* the chunk the pass takes next (later rows in pass (1), earlier ones
     * in (2)), asked for from inside the kernels (mk_ahead): its queries,
     * keys, values, dout and the gradient rows the pass writes: faster
     * than asking for them all at once before each chunk or leaving them
     * to the hardware's prefetch (docs/performance.md, the C code's choices). */
    const ptrdiff_t size = (ptrdiff_t)sizeof(float);
    ptrdiff_t next_i = keys_pass ? i0 - KERNEL_CHUNK : i0 + rows;
    ptrdiff_t next_j = keys_pass ? j0 - KERNEL_CHUNK : j0 + cols;
    ptrdiff_t next_rows = next_i < 0 ? 0 : ATTNX_MIN(KERNEL_CHUNK, a->n - next_i);
    ptrdiff_t next_keys = next_j < 0 ? 0 : ATTNX_MIN(KERNEL_CHUNK, a->m - next_j);
    mk_ahead ahead = {.regions = 0};
    if (next_rows > 0) {
        mk_ahead_add(&ahead, hd->q + next_i * a->q_row, a->q_row * size, a->d * size, next_rows, 0);
        mk_ahead_add(&ahead, hd->dout + next_i * a->dout_row, a->dout_row * size, a->e * size,
                     next_rows, 0);
        if (!keys_pass)
            mk_ahead_add(&ahead, hd->dq + next_i * a->dq_row, a->dq_row * size, a->d * size,
                         next_rows, 1);
        if (!keys_pass && kept)
            mk_ahead_add(&ahead, hd->dk + next_i * a->dk_row, a->dk_row * size, 32 * size,
                         next_rows, 1);
    }
    if (next_keys > 0) {
        mk_ahead_add(&ahead, hd->k + next_j * a->k_row, a->k_row * size, a->d * size, next_keys, 0);
        mk_ahead_add(&ahead, hd->v + next_j * a->v_row, a->v_row * size, a->e * size, next_keys, 0);
        if (keys_pass) {
            mk_ahead_add(&ahead, hd->dk + next_j * a->dk_row, a->dk_row * size, a->d * size,
                         next_keys, 1);
            mk_ahead_add(&ahead, hd->dv + next_j * a->dv_row, a->dv_row * size, a->e * size,
                         next_keys, 1);
        }
    }
    if (keys_pass) {
        chunk_kernel_bwd_keys(p->chunk_kernel, w->phi, w->psi, p->r, vals.v, vals.v_row, dout,
                              a->dout_row, a->e, visible, w->inv_den + i0, w->row_b + i0, w->dS,
                              w->dz, hd->dv + j0 * a->dv_row, a->dv_row, w->dpsi, kept, a->dk_row,
                              w->lanes, &ahead);
        return 1;
    }
    float eps[KERNEL_CHUNK];
    for (ptrdiff_t t = 0; t < rows; t++) eps[t] = SFX(bwd_row_eps)(p, w, t);
    chunk_kernel_bwd_rows(p->chunk_kernel, w->phi, w->psi, p->r, vals.v, vals.v_row, dout,
                          a->dout_row, a->e, visible, eps, w->S, w->z, w->inv_den + i0,
                          w->row_b + i0, w->dphi, kept, a->dk_row, w->lanes, &ahead);
    return 1;
#else
    (void)p, (void)hd, (void)i0, (void)rows, (void)j0, (void)cols, (void)vals, (void)w,
        (void)keys_pass;
    return 0;
#endif
}

/* The scan methods (chunk; recurrent is chunk with C = 1) for one head. */
static void SFX(bwd_scan_head)(const bwd_plan *p, const SFX(bhead) *hd, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t C = p->C, e = a->e, n = a->n, m = a->m;
    const attnx_band *band = &a->band;
    int efficient = a->features.kind == ATTNX_FM_EFFICIENT;
    if (efficient) SFX(bwd_key_columns)(p, hd, w);
    SFX(bwd_load)(p, w->S, w->z, hd->S0, a->S0_row, hd->z0);
    SFX(bwd_load)(p, w->dS, w->dz, hd->dS_in, a->dS_in_row, hd->dz_in);

    /* (1) the rows in order. Keys [0, K) are in (S, z); chunk [i0, i0 + C)
     * sees all of [0, band_end(i0 - 1)) and its own block up to
     * band_end(i0 + C - 1). */
    ptrdiff_t first_key = attnx_band_end(band, -1), K = 0;
    for (ptrdiff_t b = 0; b < first_key; b += C) {
        ptrdiff_t cols = ATTNX_MIN(C, first_key - b);
        SFX(bwd_absorb_block)(p, cols, SFX(bwd_keys)(p, hd, b, cols, w), w);
    }
    K = first_key;
    for (ptrdiff_t i0 = 0; i0 < n; i0 += C) {
        ptrdiff_t rows = ATTNX_MIN(C, n - i0), hi = attnx_band_end(band, i0 + rows - 1);
        SFX(bwd_queries)(p, hd, i0, rows, w);
        SFX(values) vals = {NULL, 0};
        if (hi > K) vals = SFX(bwd_keys)(p, hd, K, hi - K, w);
        if (hi > K && SFX(bwd_fused_chunk)(p, hd, i0, rows, K, hi - K, vals, w, 0)) {
            K = hi;
            SFX(bwd_finish_queries)(p, hd, i0, rows, w);
            continue;
        }
        SFX(gemm)(0, 0, rows, e, p->r, 1, w->phi, p->r, w->S, e, 0, w->ga, e);
        for (ptrdiff_t t = 0; t < rows; t++) w->den[t] = SFX(dot)(w->phi + t * p->r, w->z, p->r);
        if (hi > K) SFX(bwd_add_block)(p, hd, i0, rows, K, hi - K, vals, w);
        SFX(bwd_row_factors)(p, hd, i0, rows, w);
        SFX(bwd_dphi_state)(p, rows, w->S, e, w->z, w);
        if (hi > K) {
            SFX(bwd_dscores)(p, hd, i0, rows, K, hi - K, vals, w);
            SFX(bwd_block_product)(p, hd, i0, rows, K, hi - K, 0, w->dscores, w->psi, p->r, p->r,
                                   w->dphi, p->r);
            SFX(bwd_absorb_block)(p, hi - K, vals, w);
            K = hi;
        }
        SFX(bwd_finish_queries)(p, hd, i0, rows, w);
        if (!p->causal) SFX(bwd_dstate_add)(p, rows, w);
    }

    /* (2) the keys. Non-causal: every key from the whole (dS, dz). */
    if (!p->causal) {
        if (efficient)
            for (ptrdiff_t f = 0; f < p->r; f++)
                w->col_dot[f] = SFX(dot)(w->dS + f * e, w->S + f * e, e) + w->dz[f] * w->z[f];
        SFX(bwd_keys_state_only)(p, hd, 0, m, w->dS, e, w->dz, w);
    } else {
        /* keys after the last row's: only the gradient at the returned state */
        SFX(bwd_keys_state_only)(p, hd, K, m, w->dS, e, w->dz, w);
        ptrdiff_t last = n == 0 ? 0 : (n - 1) / C * C;
        for (ptrdiff_t i0 = last; i0 >= 0 && n > 0; i0 -= C) {
            ptrdiff_t rows = ATTNX_MIN(C, n - i0);
            ptrdiff_t lo = attnx_band_end(band, i0 - 1), hi = attnx_band_end(band, i0 + rows - 1);
            lo = ATTNX_MAX(lo, first_key);
            SFX(bwd_queries)(p, hd, i0, rows, w);
            SFX(values) vals = {NULL, 0};
            if (hi > lo) vals = SFX(bwd_keys)(p, hd, lo, hi - lo, w);
            if (hi > lo && SFX(bwd_fused_chunk)(p, hd, i0, rows, lo, hi - lo, vals, w, 1)) {
                SFX(bwd_finish_keys)(p, hd, lo, hi - lo, w);
                continue;
            }
            SFX(bwd_row_factors_again)(p, hd, i0, rows, w);
            if (hi > lo) {
                SFX(bwd_keys_from_state)(p, hd, lo, hi - lo, vals, w->dS, e, w->dz, w);
                SFX(bwd_keys_from_rows)(p, hd, i0, rows, lo, hi - lo, vals, w);
                SFX(bwd_finish_keys)(p, hd, lo, hi - lo, w);
            }
            SFX(bwd_dstate_add)(p, rows, w);
        }
        /* keys before the first row's block: every row sees them */
        SFX(bwd_keys_state_only)(p, hd, 0, first_key, w->dS, e, w->dz, w);
    }
    if (hd->dS0) SFX(bwd_load)(p, hd->dS0, hd->dz0, w->dS, e, w->dz);
}

/* method cumsum, the literal form: every prefix state P_j = (S0, z0) +
 * the keys [0, j) materialised, each row reading P_{end(i)}; then, in the
 * same memory, every prefix's gradient G_j = (dS, dz) at P_j: G_m = the
 * gradient at the returned state plus the rows that read P_m,
 * G_j = G_{j+1} + the rows that read P_j; key j enters P_{j+1}, so
 * dpsi_j = G_{j+1} (v_j, 1) and dv_j = psi_j G_{j+1}. */
static void SFX(bwd_cumsum_head)(const bwd_plan *p, const SFX(bhead) *hd, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t C = p->C, r = p->r, e = a->e, n = a->n, m = a->m, size = r * e + r;
    const attnx_band *band = &a->band;
    REAL *prefix = w->prefix;
    SFX(bwd_load)(p, prefix, prefix + r * e, hd->S0, a->S0_row, hd->z0);
    for (ptrdiff_t j0 = 0; j0 < m; j0 += C) {
        ptrdiff_t cols = ATTNX_MIN(C, m - j0);
        SFX(values) vals = SFX(bwd_keys)(p, hd, j0, cols, w);
        for (ptrdiff_t t = 0; t < cols; t++) {
            REAL *from = prefix + (j0 + t) * size, *to = from + size;
            memcpy(to, from, (size_t)size * sizeof(REAL));
            for (ptrdiff_t f = 0; f < r; f++) SFX(axpy)(to + f * e, w->psi[t * r + f], vals.v + t * vals.v_row, e);
            SFX(axpy)(to + r * e, 1, w->psi + t * r, r);
        }
    }
    /* the rows, each from its prefix */
    for (ptrdiff_t i0 = 0; i0 < n; i0 += C) {
        ptrdiff_t rows = ATTNX_MIN(C, n - i0);
        SFX(bwd_queries)(p, hd, i0, rows, w);
        for (ptrdiff_t t = 0; t < rows; t++) {
            const REAL *P = prefix + ATTNX_MAX(attnx_band_end(band, i0 + t), 0) * size;
            REAL *num = w->ga + t * e;
            memset(num, 0, (size_t)e * sizeof(REAL));
            for (ptrdiff_t f = 0; f < r; f++) SFX(axpy)(num, w->phi[t * r + f], P + f * e, e);
            w->den[t] = SFX(dot)(w->phi + t * r, P + r * e, r);
        }
        SFX(bwd_row_factors)(p, hd, i0, rows, w);
        for (ptrdiff_t t = 0; t < rows; t++) {
            const REAL *P = prefix + ATTNX_MAX(attnx_band_end(band, i0 + t), 0) * size;
            for (ptrdiff_t f = 0; f < r; f++)
                w->dphi[t * r + f] = SFX(dot)(P + f * e, w->ga + t * e, e) + w->gb[t] * P[r * e + f];
        }
        SFX(bwd_finish_queries)(p, hd, i0, rows, w);
    }
    /* the prefixes' gradients, in the same memory */
    memset(prefix, 0, (size_t)((m + 1) * size) * sizeof(REAL));
    SFX(bwd_load)(p, prefix + m * size, prefix + m * size + r * e, hd->dS_in, a->dS_in_row, hd->dz_in);
    for (ptrdiff_t i0 = 0; i0 < n; i0 += C) {
        ptrdiff_t rows = ATTNX_MIN(C, n - i0);
        SFX(bwd_queries)(p, hd, i0, rows, w);
        SFX(bwd_row_factors_again)(p, hd, i0, rows, w);
        for (ptrdiff_t t = 0; t < rows; t++) {
            REAL *G = prefix + ATTNX_MAX(attnx_band_end(band, i0 + t), 0) * size;
            for (ptrdiff_t f = 0; f < r; f++) SFX(axpy)(G + f * e, w->phi[t * r + f], w->ga + t * e, e);
            SFX(axpy)(G + r * e, w->gb[t], w->phi + t * r, r);
        }
    }
    for (ptrdiff_t j = m - 1; j >= 0; j--) SFX(axpy)(prefix + j * size, 1, prefix + (j + 1) * size, size);
    for (ptrdiff_t j0 = 0; j0 < m; j0 += C) {
        ptrdiff_t cols = ATTNX_MIN(C, m - j0);
        SFX(values) vals = SFX(bwd_keys)(p, hd, j0, cols, w);
        for (ptrdiff_t t = 0; t < cols; t++) {
            const REAL *G = prefix + (j0 + t + 1) * size;
            REAL *dv_t = hd->dv + (j0 + t) * a->dv_row;
            memset(dv_t, 0, (size_t)e * sizeof(REAL));
            for (ptrdiff_t f = 0; f < r; f++) {
                w->dpsi[t * r + f] = SFX(dot)(G + f * e, vals.v + t * vals.v_row, e) + G[r * e + f];
                SFX(axpy)(dv_t, w->psi[t * r + f], G + f * e, e);
            }
        }
        SFX(bwd_finish_keys)(p, hd, j0, cols, w);
    }
    if (hd->dS0) SFX(bwd_load)(p, hd->dS0, hd->dz0, prefix, e, prefix + r * e);
}

/* The quadratic form for one head, under any band and mask. */
static void SFX(bwd_quadratic_head)(const bwd_plan *p, const SFX(bhead) *hd, const SFX(bscratch) *w)
{
    const attnx_linear_bwd_args *a = p->a;
    const ptrdiff_t C = p->C, r = p->r, e = a->e, n = a->n, m = a->m;
    const attnx_band *band = &a->band;
    SFX(bwd_load)(p, w->dS, w->dz, hd->dS_in, a->dS_in_row, hd->dz_in);
    /* (1) tiles of rows against S0 and every key block they see */
    for (ptrdiff_t i0 = 0; i0 < n; i0 += C) {
        ptrdiff_t rows = ATTNX_MIN(C, n - i0);
        ptrdiff_t first = attnx_band_first(band, i0), end = attnx_band_end(band, i0 + rows - 1);
        SFX(bwd_queries)(p, hd, i0, rows, w);
        if (hd->S0) {
            SFX(gemm)(0, 0, rows, e, r, 1, w->phi, r, hd->S0, a->S0_row, 0, w->ga, e);
            for (ptrdiff_t t = 0; t < rows; t++) w->den[t] = SFX(dot)(w->phi + t * r, hd->z0, r);
        } else {
            memset(w->ga, 0, (size_t)(rows * e) * sizeof(REAL));
            memset(w->den, 0, (size_t)rows * sizeof(REAL));
        }
        for (ptrdiff_t j0 = first; j0 < end; j0 += C) {
            ptrdiff_t cols = ATTNX_MIN(C, end - j0);
            SFX(bwd_add_block)(p, hd, i0, rows, j0, cols, SFX(bwd_keys)(p, hd, j0, cols, w), w);
        }
        SFX(bwd_row_factors)(p, hd, i0, rows, w);
        if (hd->S0) SFX(bwd_dphi_state)(p, rows, hd->S0, a->S0_row, hd->z0, w);
        else memset(w->dphi, 0, (size_t)(rows * r) * sizeof(REAL));
        for (ptrdiff_t j0 = first; j0 < end; j0 += C) {
            ptrdiff_t cols = ATTNX_MIN(C, end - j0);
            SFX(bwd_dscores)(p, hd, i0, rows, j0, cols, SFX(bwd_keys)(p, hd, j0, cols, w), w);
            SFX(bwd_block_product)(p, hd, i0, rows, j0, cols, 0, w->dscores, w->psi, r, r, w->dphi, r);
        }
        SFX(bwd_finish_queries)(p, hd, i0, rows, w);
        SFX(bwd_dstate_add)(p, rows, w);  /* every row sees S0 */
    }
    /* (2) key blocks against the gradient at the returned state (which
     * holds every key) and every tile of rows that sees them */
    for (ptrdiff_t j0 = 0; j0 < m; j0 += C) {
        ptrdiff_t cols = ATTNX_MIN(C, m - j0);
        SFX(values) vals = SFX(bwd_keys)(p, hd, j0, cols, w);
        if (hd->dS_in) {
            SFX(bwd_keys_from_state)(p, hd, j0, cols, vals, hd->dS_in, a->dS_in_row, hd->dz_in, w);
        } else {
            memset(w->dpsi, 0, (size_t)(cols * r) * sizeof(REAL));
            for (ptrdiff_t t = 0; t < cols; t++)
                memset(hd->dv + (j0 + t) * a->dv_row, 0, (size_t)e * sizeof(REAL));
        }
        for (ptrdiff_t i0 = 0; i0 < n; i0 += C) {
            ptrdiff_t rows = ATTNX_MIN(C, n - i0);
            /* the band is monotone: a tile sees [first(i0), end(last row)) */
            if (attnx_band_first(band, i0) >= j0 + cols) break;
            if (attnx_band_end(band, i0 + rows - 1) <= j0) continue;
            SFX(bwd_queries)(p, hd, i0, rows, w);
            SFX(bwd_row_factors_again)(p, hd, i0, rows, w);
            SFX(bwd_keys_from_rows)(p, hd, i0, rows, j0, cols, vals, w);
        }
        SFX(bwd_finish_keys)(p, hd, j0, cols, w);
    }
    if (hd->dS0) SFX(bwd_load)(p, hd->dS0, hd->dz0, w->dS, e, w->dz);
}

int TYPED(attnx_linear_bwd_f32, attnx_linear_bwd_f64)(const attnx_linear_bwd_args *a)
{
    if (a->heads == 0) return ATTNX_OK;
    bwd_plan p = {.a = a, .r = a->features.r, .C = a->method == ATTNX_METHOD_RECURRENT ? 1 : a->chunk,
                  .causal = a->band.has_hi};
#if !REAL_IS_DOUBLE && defined(CHUNK_KERNELS)
    /* the fused kernels: causal chunks of 16 under a band that opens at
     * key 0 and no mask, features in blocks of 8, values in blocks of 16 */
    if (a->method == ATTNX_METHOD_CHUNK && p.C == KERNEL_CHUNK && p.causal && !a->band.has_lo &&
        !a->mask && p.r % 8 == 0 && a->e % 16 == 0)
        p.chunk_kernel = chunk_kernel_width(ATTNX_FAMILY_LINEAR_BWD);
#endif
    p.key_log_scale = SFX(attnx_key_log_scale)(&a->features);
    /* threads over heads; below MIN_PARALLEL_FLOPS one thread */
    double flops = 12.0 * (double)a->heads * (double)(a->n + a->m) * (double)(p.r * (a->e + 1));
    ptrdiff_t threads = ATTNX_MAX(1, ATTNX_MIN(a->num_threads, a->heads));
    if (flops < MIN_PARALLEL_FLOPS) threads = 1;
    if (a->method == ATTNX_METHOD_CUMSUM) {
        /* as many heads at once as the prefix states of fit under the limit */
        size_t prefix_bytes = (size_t)(a->m + 1) * (size_t)(p.r * a->e + p.r) * sizeof(REAL);
        threads = ATTNX_MIN(threads, (ptrdiff_t)ATTNX_MAX(ATTNX_CUMSUM_LIMIT / prefix_bytes, 1));
    }
    p.threads = (int)threads;
    size_t per_thread = SFX(bwd_scratch_size)(&p);
    REAL *scratch =
        attnx_aligned_alloc(ATTNX_CACHE_LINE, per_thread * (size_t)threads * sizeof(REAL));
    if (!scratch) return ATTNX_ENOMEM;
    for (ptrdiff_t t = 0; t < threads && a->dW; t++) {
        SFX(bscratch) w = SFX(bscratch_at)(&p, scratch + per_thread * (size_t)t);
        memset(w.dW, 0, (size_t)(p.r * a->d) * sizeof(REAL));
    }
    /* Ctrl-C between heads (linear_stopped) */
    int finished = 0;
#pragma omp parallel num_threads(attnx_omp_threads(p.threads))
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (ptrdiff_t h = 0; h < a->heads; h++) {
            if (linear_stopped(a->interrupt)) continue;
            SFX(bscratch) w = SFX(bscratch_at)(&p, scratch + per_thread * (size_t)omp_get_thread_num());
            SFX(bhead) hd = SFX(bhead_at)(a, h);
            if (a->method == ATTNX_METHOD_QUADRATIC) SFX(bwd_quadratic_head)(&p, &hd, &w);
            else if (a->method == ATTNX_METHOD_CUMSUM && a->features.kind != ATTNX_FM_EFFICIENT)
                SFX(bwd_cumsum_head)(&p, &hd, &w);
            else SFX(bwd_scan_head)(&p, &hd, &w);
        }
        linear_share_done(a->interrupt, &finished, omp_get_num_threads());
    }
    if (a->interrupt && a->interrupt->stopped) {
        attnx_aligned_free(scratch);
        return ATTNX_EINTR;
    }
    /* the projection's gradient: the threads' shares, summed in a fixed order */
    for (ptrdiff_t t = 0; t < threads && a->dW; t++) {
        SFX(bscratch) w = SFX(bscratch_at)(&p, scratch + per_thread * (size_t)t);
        SFX(axpy)((REAL *)a->dW, 1, w.dW, p.r * a->d);
    }
    attnx_aligned_free(scratch);
    return ATTNX_OK;
}

#endif /* REAL */
