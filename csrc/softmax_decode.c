/* softmax_decode.c - softmax attention for a few query rows against many
 * keys (decoding with a KV cache), flash-decoding style.
 *
 * With n <= DECODE_MAX_QUERIES rows per head the query tiles of softmax.c
 * give one work item per head: one thread per head, and reading the keys
 * and values, not the arithmetic, is the cost. Here the keys of each head
 * are cut into chunks of DECODE_CHUNK keys, a fixed length, and each
 * (group, chunk) is a work item that any thread takes: it streams its
 * chunk of K and V once and leaves, per query row, the chunk's partial
 * result (the max of its scores, the sum of their weights and the
 * unnormalised output). Once every item is done, each row's partials are
 * merged by log-sum-exp in the chunks' order. The chunks and the order of
 * every sum depend on the shape only, so the result is the same on any
 * number of threads and whichever thread takes an item.
 *
 * A group is a run of consecutive heads that read the same keys and values
 * (the same K and V offsets: grouped-query attention, whose k and v
 * broadcast over the query heads of a kv head), up to DECODE_MAX_ROWS
 * query rows in all: its rows are scored against each key while the key is
 * in L1, so the cache is read once per kv head, not once per query head.
 *
 * Keys and values held in half precision (kv_half: attnx.torch's bfloat16
 * and float16 tensors, a KV cache of a model run in either) are read as
 * they are,
 * each number widened as it is loaded: half the bytes of float32 to read,
 * and none of the whole cache widened first, which cost more than the step
 * itself.
 *
 * The band (causal, window), the mask and the bias are applied per row;
 * lse as softmax.c writes it. Dropout and gaussian attention's key term
 * take softmax.c's query tiles (softmax_decode_applies). The vector
 * kernels are those of the softmax forward's kernel set
 * (attnx_kernels(ATTNX_FAMILY_SOFTMAX_FWD)): mk_decode_scores and
 * mk_decode_pv of microkernel.h for AVX-512, AVX2 or NEON, the loops
 * here for the plain set.
 *
 * Legend: n queries, m keys, d features, e value features; a group's rows
 * are its heads' query rows, head after head.
 *   s     (DECODE_MAX_ROWS, DECODE_CHUNK)  one item's scores, log2 units,
 *                                          then weights 2^(s - max)
 *   part  per (row, chunk): max, sum, then e numbers of output
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h" /* vec_real.h declares the BLAS calls */
#include "convert.h"
#include "softmax_internal.h"

/* keys per work item: fixed, so that the partial sums (and so the
 * result) do not depend on the number of threads */
#define DECODE_CHUNK 512
/* keys per block: a block of K (or V) stays in L1 while every row of the
 * group reads it */
#define DECODE_BLOCK 32
/* the plain set's partial sums of a dot product: spelled out rather than
 * left to the vectoriser (an omp simd reduction), whose order of additions
 * clang chose differently for float16 keys than for the float32 numbers
 * they widen to; written out, every format gives the same bits */
#define DECODE_PARTIALS 8

#define ATTNX_FAMILY_FILE "softmax_decode.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */
#include "softmax_internal.h"

#define LOG2E ((REAL)1.44269504088896340736)

int TYPED(softmax_decode_applies_f32, softmax_decode_applies_f64)(const attnx_softmax_args *a)
{
    return a->n <= DECODE_MAX_QUERIES && a->m >= DECODE_MIN_KEYS && a->dropout_p == 0 &&
           a->key_sqnorm_coef == 0;
}

/* The kernels of one instruction set: scores of up to MK_DECODE_ROWS rows
 * (microkernel.h's mk_decode_scores), and acc += P V for one row
 * (mk_decode_pv). */
typedef struct {
    void (*scores)(REAL *s, ptrdiff_t s_ld, const REAL *const *q, ptrdiff_t rows, const void *k,
                   ptrdiff_t k_row, ptrdiff_t keys, ptrdiff_t d, REAL scale, int kv_half);
    void (*add_pv)(REAL *acc, const REAL *p, const void *v, ptrdiff_t v_row, ptrdiff_t keys,
                   ptrdiff_t e, int kv_half);
} SFX(decode_kernels);

/* x's number at index `at`: a REAL, or half-precision bits widened
 * (kv_half, float32 only) */
static inline REAL SFX(kv_at)(const void *x, ptrdiff_t at, int kv_half)
{
#if !REAL_IS_DOUBLE
    if (kv_half == ATTNX_BF16) return attnx_bf16_widened(((const uint16_t *)x)[at]);
    if (kv_half == ATTNX_F16) return attnx_f16_widened(((const uint16_t *)x)[at]);
#endif
    (void)kv_half;
    return ((const REAL *)x)[at];
}

/* the plain set's: the same loops in C (vectorised where the compiler
 * can), each for one kv_half, a constant where inlined, since a choice of
 * format inside the loops keeps them from vectorising; the dot products
 * by DECODE_PARTIALS partial sums */
static inline __attribute__((always_inline)) void SFX(decode_scores_loops)(
    REAL *s, ptrdiff_t s_ld, const REAL *const *q, ptrdiff_t rows, const void *k,
    ptrdiff_t k_row, ptrdiff_t keys, ptrdiff_t d, REAL scale, const int kv_half)
{
    const ptrdiff_t whole = d / DECODE_PARTIALS * DECODE_PARTIALS;
    for (ptrdiff_t j = 0; j < keys; j++)
        for (ptrdiff_t r = 0; r < rows; r++) {
            REAL partial[DECODE_PARTIALS] = {0};
            for (ptrdiff_t c = 0; c < whole; c += DECODE_PARTIALS)
                for (int l = 0; l < DECODE_PARTIALS; l++)
                    partial[l] += q[r][c + l] * SFX(kv_at)(k, j * k_row + c + l, kv_half);
            for (ptrdiff_t c = whole; c < d; c++)
                partial[c - whole] += q[r][c] * SFX(kv_at)(k, j * k_row + c, kv_half);
            REAL dot = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                       ((partial[4] + partial[5]) + (partial[6] + partial[7]));
            s[r * s_ld + j] = dot * scale;
        }
}

static inline __attribute__((always_inline)) void SFX(decode_pv_loops)(
    REAL *acc, const REAL *p, const void *v, ptrdiff_t v_row, ptrdiff_t keys, ptrdiff_t e,
    const int kv_half)
{
    for (ptrdiff_t j = 0; j < keys; j++)
        if (p[j] != 0)
#pragma omp simd
            for (ptrdiff_t c = 0; c < e; c++) acc[c] += p[j] * SFX(kv_at)(v, j * v_row + c, kv_half);
}

static ATTNX_HOT void SFX(decode_scores_plain)(REAL *s, ptrdiff_t s_ld, const REAL *const *q,
                                               ptrdiff_t rows, const void *k, ptrdiff_t k_row,
                                               ptrdiff_t keys, ptrdiff_t d, REAL scale,
                                               int kv_half)
{
    if (kv_half == ATTNX_BF16)
        SFX(decode_scores_loops)(s, s_ld, q, rows, k, k_row, keys, d, scale, ATTNX_BF16);
    else if (kv_half == ATTNX_F16)
        SFX(decode_scores_loops)(s, s_ld, q, rows, k, k_row, keys, d, scale, ATTNX_F16);
    else
        SFX(decode_scores_loops)(s, s_ld, q, rows, k, k_row, keys, d, scale, 0);
}

static ATTNX_HOT void SFX(decode_pv_plain)(REAL *acc, const REAL *p, const void *v,
                                           ptrdiff_t v_row, ptrdiff_t keys, ptrdiff_t e,
                                           int kv_half)
{
    if (kv_half == ATTNX_BF16)
        SFX(decode_pv_loops)(acc, p, v, v_row, keys, e, ATTNX_BF16);
    else if (kv_half == ATTNX_F16)
        SFX(decode_pv_loops)(acc, p, v, v_row, keys, e, ATTNX_F16);
    else
        SFX(decode_pv_loops)(acc, p, v, v_row, keys, e, 0);
}

static const SFX(decode_kernels) SFX(decode_plain) = {SFX(decode_scores_plain),
                                                      SFX(decode_pv_plain)};
#if defined(MK_HAVE_X86)
static const SFX(decode_kernels) SFX(decode_avx512) = {
    TYPED(mk_decode_scores_w16, mk_decode_scores_d8), TYPED(mk_decode_pv_w16, mk_decode_pv_d8)};
static const SFX(decode_kernels) SFX(decode_avx2) = {
    TYPED(mk_decode_scores_w8, mk_decode_scores_d4), TYPED(mk_decode_pv_w8, mk_decode_pv_d4)};
#elif defined(MK_HAVE_NEON)
static const SFX(decode_kernels) SFX(decode_neon) = {
    TYPED(mk_decode_scores_n4, mk_decode_scores_nd2), TYPED(mk_decode_pv_n4, mk_decode_pv_nd2)};
#endif

static const SFX(decode_kernels) *SFX(decode_choose)(void)
{
    int width = attnx_kernels_width(attnx_kernels(ATTNX_FAMILY_SOFTMAX_FWD));
#if defined(MK_HAVE_X86)
    if (width == 16) return &SFX(decode_avx512);
    if (width == 8) return &SFX(decode_avx2);
#elif defined(MK_HAVE_NEON)
    if (width == 4) return &SFX(decode_neon);
#endif
    (void)width;
    return &SFX(decode_plain);
}

/* One call: its groups, chunks and the partials every item leaves. */
typedef struct {
    const attnx_softmax_args *a;
    const SFX(decode_kernels) *kernels;
    ptrdiff_t chunks;
    const ptrdiff_t *group_first;  /* (groups + 1) the first head of each group */
    REAL *partials;                /* (heads n, chunks, e + 2) */
} SFX(decode_call);

/* weights in place, p = 2^(s - shift), and their sum */
static ATTNX_HOT REAL SFX(decode_weights)(REAL *s, ptrdiff_t count, REAL shift)
{
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (ptrdiff_t j = 0; j < count; j++) {
        REAL p = SFX(vexp2)(s[j] - shift);
        s[j] = p;
        sum += p;
    }
    return sum;
}

/* the numbers of key or value row `row` of x (row stride x_row): REAL or
 * half-precision bits (kv_half) */
static const void *SFX(decode_rows)(const attnx_softmax_args *a, const void *x, ptrdiff_t row,
                                    ptrdiff_t x_row)
{
    return a->kv_half ? (const void *)((const uint16_t *)x + row * x_row)
                      : (const void *)((const REAL *)x + row * x_row);
}

/* Work item `item`: chunk item % chunks of group item / chunks, into its
 * rows' partials; s is the thread's scores. */
static void SFX(decode_item)(const SFX(decode_call) *call, ptrdiff_t item, REAL *s)
{
    const attnx_softmax_args *a = call->a;
    const ptrdiff_t n = a->n, e = a->e, chunks = call->chunks, group = item / chunks;
    const ptrdiff_t head0 = call->group_first[group], chunk = item % chunks;
    const ptrdiff_t rows = (call->group_first[group + 1] - head0) * n;
    const ptrdiff_t c0 = chunk * DECODE_CHUNK, c1 = ATTNX_MIN(a->m, c0 + DECODE_CHUNK);
    const ptrdiff_t *off0 = a->offsets + head0 * ATTNX_SM_NOPS;
    const void *k = (const char *)a->k + off0[ATTNX_SM_K];
    const void *v = (const char *)a->v + off0[ATTNX_SM_V];
    const REAL scale2 = (REAL)(a->scale * 1.44269504088896340736), neg_inf = -(REAL)INFINITY;
    const REAL *q[DECODE_MAX_ROWS];
    ptrdiff_t first[DECODE_MAX_ROWS], end[DECODE_MAX_ROWS];

    /* each row's visible keys of the chunk, and the span of them all */
    ptrdiff_t lo = c1, hi = c0;
    for (ptrdiff_t r = 0; r < rows; r++) {
        const ptrdiff_t *off = a->offsets + (head0 + r / n) * ATTNX_SM_NOPS, i = r % n;
        q[r] = (const REAL *)((const char *)a->q + off[ATTNX_SM_Q]) + i * a->q_row;
        first[r] = ATTNX_MAX(attnx_band_first(&a->band, i), c0);
        end[r] = ATTNX_MIN(attnx_band_end(&a->band, i), c1);
        if (first[r] < end[r]) {
            lo = ATTNX_MIN(lo, first[r]);
            hi = ATTNX_MAX(hi, end[r]);
        }
    }

    /* scores: K block by block, each block read by every row */
    for (ptrdiff_t b0 = lo; b0 < hi; b0 += DECODE_BLOCK) {
        ptrdiff_t keys = ATTNX_MIN(DECODE_BLOCK, hi - b0);
        for (ptrdiff_t r0 = 0; r0 < rows; r0 += MK_DECODE_ROWS)
            call->kernels->scores(s + r0 * DECODE_CHUNK + (b0 - lo), DECODE_CHUNK, q + r0,
                                  ATTNX_MIN(MK_DECODE_ROWS, rows - r0),
                                  SFX(decode_rows)(a, k, b0, a->k_row), a->k_row, keys, a->d,
                                  scale2, a->kv_half);
    }

    /* per row: hide what it does not see, add its bias, its weights */
    for (ptrdiff_t r = 0; r < rows; r++) {
        const ptrdiff_t *off = a->offsets + (head0 + r / n) * ATTNX_SM_NOPS, i = r % n;
        REAL *s_r = s + r * DECODE_CHUNK - lo, row_max = neg_inf;
        REAL *part = call->partials + ((head0 * n + r) * chunks + chunk) * (e + 2);
        if (first[r] >= end[r]) first[r] = end[r] = hi;
        for (ptrdiff_t j = lo; j < first[r]; j++) s_r[j] = neg_inf;
        for (ptrdiff_t j = end[r]; j < hi; j++) s_r[j] = neg_inf;
        if (a->bias) {
            const REAL *bias = (const REAL *)((const char *)a->bias + off[ATTNX_SM_BIAS]) +
                               i * a->bias_row;
            for (ptrdiff_t j = first[r]; j < end[r]; j++) s_r[j] += LOG2E * bias[j * a->bias_col];
        }
        if (a->mask) {
            const unsigned char *mask = a->mask + off[ATTNX_SM_MASK] + i * a->mask_row;
            for (ptrdiff_t j = first[r]; j < end[r]; j++)
                if (!mask[j * a->mask_col]) s_r[j] = neg_inf;
        }
        /* a NaN score is no max; it makes its row's sum NaN below */
        for (ptrdiff_t j = lo; j < hi; j++) row_max = s_r[j] > row_max ? s_r[j] : row_max;
        /* a row that sees nothing subtracts 0: its weights are 2^-inf = 0 */
        REAL sum = SFX(decode_weights)(s_r + lo, hi - lo, row_max == neg_inf ? 0 : row_max);
        part[0] = row_max;
        part[1] = sum;
        memset(part + 2, 0, (size_t)e * sizeof(REAL));
    }

    /* out += P V: V block by block, each block read by every row */
    for (ptrdiff_t b0 = lo; b0 < hi; b0 += DECODE_BLOCK) {
        ptrdiff_t keys = ATTNX_MIN(DECODE_BLOCK, hi - b0);
        for (ptrdiff_t r = 0; r < rows; r++)
            call->kernels->add_pv(
                call->partials + ((head0 * n + r) * chunks + chunk) * (e + 2) + 2,
                s + r * DECODE_CHUNK + (b0 - lo), SFX(decode_rows)(a, v, b0, a->v_row),
                a->v_row, keys, e, a->kv_half);
    }
}

/* Row `row` (head row / n, query row % n): its chunks' partials merged in
 * their order, normalised into out, and its lse. */
static void SFX(decode_merge)(const SFX(decode_call) *call, ptrdiff_t row)
{
    const attnx_softmax_args *a = call->a;
    const ptrdiff_t e = a->e, chunks = call->chunks, i = row % a->n;
    const ptrdiff_t *off = a->offsets + row / a->n * ATTNX_SM_NOPS;
    const REAL *parts = call->partials + row * chunks * (e + 2), neg_inf = -(REAL)INFINITY;
    REAL *out = (REAL *)((char *)a->out + off[ATTNX_SM_OUT]) + i * a->out_row;
    REAL row_max = neg_inf, sum = 0;
    int nan_sum = 0;
    for (ptrdiff_t c = 0; c < chunks; c++) {
        row_max = parts[c * (e + 2)] > row_max ? parts[c * (e + 2)] : row_max;
        nan_sum |= isnan(parts[c * (e + 2) + 1]);
    }
    for (ptrdiff_t col = 0; col < e; col++) out[col] = 0;
    /* a NaN score (whose chunk may have no max: all its scores NaN) makes
     * the row NaN, out and lse */
    if (nan_sum) sum = (REAL)NAN;
    else if (row_max != neg_inf)
        for (ptrdiff_t c = 0; c < chunks; c++) {
            const REAL *part = parts + c * (e + 2);
            if (part[0] == neg_inf) continue; /* the chunk holds none of the row's keys */
            REAL weight = (REAL)exp2((double)(part[0] - row_max));
            sum += weight * part[1];
            for (ptrdiff_t col = 0; col < e; col++) out[col] += weight * part[2 + col];
        }
    REAL inverse_sum = sum == 0 ? 0 : 1 / sum;
    for (ptrdiff_t col = 0; col < e; col++) out[col] *= inverse_sum;
    if (a->lse)
        ((REAL *)((char *)a->lse + off[ATTNX_SM_LSE]))[i] =
            sum == 0 ? neg_inf
                     : (REAL)(((double)row_max + log2((double)sum)) * 0.69314718055994530942);
}

int TYPED(softmax_decode_f32, softmax_decode_f64)(const attnx_softmax_args *a)
{
    const ptrdiff_t n = a->n, chunks = (a->m + DECODE_CHUNK - 1) / DECODE_CHUNK;
    if (REAL_IS_DOUBLE && a->kv_half) return ATTNX_EINVAL;
    if (a->heads == 0 || n == 0) return ATTNX_OK;
    int status = ATTNX_ENOMEM;
    ptrdiff_t *group_first = malloc((size_t)(a->heads + 1) * sizeof *group_first);
    REAL *partials = malloc((size_t)(a->heads * n * chunks * (a->e + 2)) * sizeof(REAL) + 1);
    REAL *scores = NULL;
    item_range *shares = NULL;
    if (!group_first || !partials) goto done;

    /* groups: runs of heads on the same keys and values */
    ptrdiff_t groups = 0;
    for (ptrdiff_t h = 0; h < a->heads; h++) {
        const ptrdiff_t *off = a->offsets + h * ATTNX_SM_NOPS;
        const ptrdiff_t *lead = groups ? a->offsets + group_first[groups - 1] * ATTNX_SM_NOPS : NULL;
        if (!lead || off[ATTNX_SM_K] != lead[ATTNX_SM_K] || off[ATTNX_SM_V] != lead[ATTNX_SM_V] ||
            (h - group_first[groups - 1] + 1) * n > DECODE_MAX_ROWS)
            group_first[groups++] = h;
    }
    group_first[groups] = a->heads;

    const ptrdiff_t work = groups * chunks;
    int threads = a->num_threads < work ? a->num_threads : (int)work;
    /* waking a second thread costs more than ~a million flops take */
    if ((double)a->heads * n * a->m * (a->d + a->e) < 1e6 || threads < 1) threads = 1;
    const ptrdiff_t per_thread = softmax_lines(DECODE_MAX_ROWS * DECODE_CHUNK, sizeof(REAL));
    shares = malloc((size_t)threads * sizeof *shares);
    scores = attnx_aligned_alloc(64, (size_t)(per_thread * threads) * sizeof(REAL));
    if (!shares || !scores) goto done;
    const SFX(decode_call) call = {a, SFX(decode_choose)(), chunks, group_first, partials};

    if (threads == 1) {
        for (ptrdiff_t item = 0; item < work; item++) {
            if (attnx_interrupted(a->interrupt, 1)) break;
            SFX(decode_item)(&call, item, scores);
        }
        if (!(a->interrupt && a->interrupt->stopped))
            for (ptrdiff_t row = 0; row < a->heads * n; row++) SFX(decode_merge)(&call, row);
    } else {
        for (int t = 0; t < threads; t++)
            shares[t] = (item_range){work * t / threads, work * (t + 1) / threads};
#pragma omp parallel num_threads(attnx_omp_threads(threads))
        {
            int self = omp_get_thread_num(), team = omp_get_num_threads();
            for (ptrdiff_t item; !attnx_interrupted(a->interrupt, self == 0) &&
                                 (item = softmax_claim_item(shares, threads, self)) >= 0;)
                SFX(decode_item)(&call, item, scores + per_thread * self);
#pragma omp barrier
            if (!(a->interrupt && a->interrupt->stopped))
                for (ptrdiff_t row = self; row < a->heads * n; row += team)
                    SFX(decode_merge)(&call, row);
        }
    }
    status = a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
done:
    free(group_first);
    free(partials);
    attnx_aligned_free(scores);
    free(shares);
    return status;
}

#undef LOG2E
#endif /* REAL */
