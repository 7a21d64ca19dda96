/* softmax_mk.c - the softmax backend on the register-blocked micro-kernels
 * of microkernel.h, one table per instruction set: AVX-512 and AVX2+FMA,
 * NEON on aarch64, float32 and float64 from one source (real.h).
 *
 * Per query tile the queries are packed into strips of Q^T (qt), and the
 * keys (and values, when more than one query tile reads them) of a head
 * into panels, each the first time a query tile needs it (packed_panels).
 * The scores and P V of a key tile are one micro-kernel call each; the
 * output accumulates transposed in ot and is written out at the tile's
 * end. Legend as in softmax.c; see microkernel.h for qt, kt, vt.
 *
 * float32 on AVX-512 with the bfloat16 dot products (dispatch.h: the
 * avx512_bf16 and amx sets): the
 * query strips and key panels are also put in pair rows (mk_pair_rows),
 * which tells whether their numbers are all bfloat16 values, as they are
 * for tensors widened from bfloat16. A tile whose queries and keys all are
 * takes its scores from the pairs, in half the instructions; any other
 * tile the float32 kernels. The inputs decide, never the caller: a float32
 * number that is no bfloat16 value keeps its tile on float32. P V is
 * float32 (P is no bfloat16 value), unless the caller asks for bfloat16
 * arithmetic (bf16_products, attnx.h): then the value panels are put in
 * pairs of keys too, and a tile whose values are all bfloat16 values takes
 * P V from the pairs, each strip's P rounded to bfloat16 on the way
 * (mk_add_pv_pairs_w16); the online softmax's sums and rescaling stay
 * float32. Keys and values given as bfloat16 bits (kv_half, as attnx.torch
 * passes bfloat16 tensors) are paired straight from the bits, with no
 * float32 copy: a key's pair c is the 32-bit word c of its row, so its
 * panel's pair rows are a transpose of words, and a value pair
 * interleaves two rows (softmax_mk_reads_half_kv). */
#ifndef REAL
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h" /* vec_real.h declares the BLAS calls */
#include "convert.h"
#include "softmax_internal.h"

#ifdef SOFTMAX_MK
/* One thread's keys and values of one head, packed for the micro-kernels; a
 * panel is packed the first time a query tile needs it, and reused by every
 * later tile of the head (and of heads that share them). Panel p lives
 * in slot p % slots: every panel of the head when the query tiles may see
 * any key, or, under a window, a ring over the keys two neighbouring query
 * tiles see, so that memory (and its page faults) does not grow with m. */
typedef struct {
    int width;            /* the micro-kernels' instruction set (attnx_kernels_width) */
    void *kt;             /* (slots, d, KB) numbers of the call's type, KB = MK_KB(width) */
    void *vt;             /* (slots, e / KB, KB, KB); NULL: the values are read in place */
    ptrdiff_t *owner;     /* per slot: 1 + the panel it holds, 0 for none */
    ptrdiff_t slots;
    const void *k, *v;    /* the keys and values whose panels are in kt and vt */
    /* the bfloat16 dot products (float32, AVX-512); kt_pairs NULL: none */
    float *kt_pairs;      /* (slots, ceil(d / 2), KB) kt's panels in pair rows */
    unsigned char *exact; /* per slot: the panel's keys are all bfloat16 values */
    float *qt_pairs;      /* (strips, ceil(d / 2), strip) the tile's queries in pair rows */
    int q_exact;          /* the tile's queries are all bfloat16 values */
    /* and P V by them (bf16_products); vt_pairs NULL: not asked for */
    float *vt_pairs;      /* (slots, e / KB, KB / 2, KB) the value panels, keys paired */
    unsigned char *v_exact; /* per slot: the panel's values are all bfloat16 values */
    float *p_pairs;       /* (MK_KC / 2, strip) a strip's slice of P, rounded and paired */
} packed_panels;

#ifdef MK_HAVE_X86
/* dst (ceil(count / 2), lanes): pair row c from the bfloat16 bits of rows
 * 2c and 2c + 1 of x (count, lanes), the first in the low half (as
 * mk_pair_rows pairs), 0 for the second past an odd count; rows x_row and
 * dst_row apart */
static void mk_pair_bf16_rows(float *dst, ptrdiff_t dst_row, const uint16_t *x, ptrdiff_t x_row,
                              ptrdiff_t count, ptrdiff_t lanes)
{
    for (ptrdiff_t c = 0; c < count; c += 2) {
        const uint16_t *first = x + c * x_row, *second = x + (c + 1) * x_row;
        uint32_t *pair = (uint32_t *)(dst + c / 2 * dst_row);
        if (c + 1 < count)
            for (ptrdiff_t l = 0; l < lanes; l++) pair[l] = first[l] | (uint32_t)second[l] << 16;
        else
            for (ptrdiff_t l = 0; l < lanes; l++) pair[l] = first[l];
    }
}

/* the panels (d, KB) of the keys [j0, j0 + cols) widened from their
 * bfloat16 bits into kt: a tile whose queries are no bfloat16 values
 * needs them (every call attnx.torch makes has bfloat16 queries) */
static void mk_widen_panels(float *kt, ptrdiff_t slots, const uint16_t *k, ptrdiff_t k_row,
                            ptrdiff_t m, ptrdiff_t d, ptrdiff_t kb, ptrdiff_t j0, ptrdiff_t cols)
{
    for (ptrdiff_t p = j0 / kb; p * kb < j0 + cols; p++) {
        float *panel = kt + p % slots * kb * d;
        ptrdiff_t count = m - p * kb < kb ? m - p * kb : kb;
        if (count < kb) memset(panel, 0, (size_t)(d * kb) * sizeof *panel);
        for (ptrdiff_t r = 0; r < count; r++)
            for (ptrdiff_t c = 0; c < d; c++)
                panel[c * kb + r] = attnx_bf16_widened(k[(p * kb + r) * k_row + c]);
    }
}
#endif
#endif

#define ATTNX_FAMILY_FILE "softmax_mk.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */
#ifdef SOFTMAX_MK
#include "softmax_internal.h"

/* The micro-kernels of one instruction set (microkernel.h), named outright. */
struct SFX(mk_kernels) {
    void (*scores)(const mk_tile *t, REAL *st, ptrdiff_t st_ld, const REAL *qt, const REAL *kt,
                   ptrdiff_t slots, ptrdiff_t d, REAL scale, const REAL *key_term,
                   REAL *tile_max);
    void (*add_pv)(const mk_tile *t, REAL *ot, ptrdiff_t ot_ld, const REAL *pt, ptrdiff_t pt_ld,
                   const mk_values *values, ptrdiff_t e, const REAL *correction);
    /* the scores by the bfloat16 dot products (float32 on AVX-512), or NULL */
    void (*scores_pairs)(const mk_tile *t, REAL *st, ptrdiff_t st_ld, const REAL *qt,
                         const REAL *kt, ptrdiff_t slots, ptrdiff_t d_pairs, REAL scale,
                         const REAL *key_term, REAL *tile_max);
    /* P V by them, P rounded (mk_add_pv_pairs_w16), or NULL */
    void (*add_pv_pairs)(const mk_tile *t, REAL *ot, ptrdiff_t ot_ld, const REAL *pt,
                         ptrdiff_t pt_ld, const mk_values *values, ptrdiff_t e,
                         const REAL *correction, REAL *p_pairs);
};

#ifdef MK_HAVE_X86
/* dst[c][r] = x[r][c] for r < count, c < d (row strides dst_row, x_row):
 * by square blocks of `side` numbers, what they leave by blocks half as
 * big, the rest one by one. The blocks: 16 x 16 floats on AVX-512, 8 x 8
 * and 4 x 4 floats, 4 x 4 doubles (only called where the micro-kernels
 * run, so AVX2 is there). */
static void SFX(mk_transpose_by)(REAL *dst, ptrdiff_t dst_row, const REAL *x, ptrdiff_t x_row,
                                 ptrdiff_t count, ptrdiff_t d, ptrdiff_t side)
{
    if (side < 4) {
        for (ptrdiff_t r = 0; r < count; r++)
            for (ptrdiff_t c = 0; c < d; c++) dst[c * dst_row + r] = x[r * x_row + c];
        return;
    }
    ptrdiff_t rows = count / side * side, cols = d / side * side;
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += side)
        for (ptrdiff_t c0 = 0; c0 < cols; c0 += side) {
            REAL *block = dst + c0 * dst_row + r0;
            const REAL *from = x + r0 * x_row + c0;
#if REAL_IS_DOUBLE
            mk_transpose4_f64(block, dst_row, from, x_row);
#else
            if (side == 16)
                mk_transpose16(block, dst_row, from, x_row);
            else if (side == 8)
                mk_transpose8(block, dst_row, from, x_row);
            else
                mk_transpose4(block, dst_row, from, x_row);
#endif
        }
    /* the columns right of the blocks, then the rows below them */
    SFX(mk_transpose_by)(dst + cols * dst_row, dst_row, x + cols, x_row, rows, d - cols, side / 2);
    SFX(mk_transpose_by)(dst + rows, dst_row, x + rows * x_row, x_row, count - rows, d, side / 2);
}

#endif

/* the transpose by the largest blocks this type has on instruction set
 * `width` (x86); on NEON number by number, for now */
void SFX(mk_transpose)(REAL *dst, ptrdiff_t dst_row, const REAL *x, ptrdiff_t x_row,
                              ptrdiff_t count, ptrdiff_t d, int width)
{
#ifdef MK_HAVE_X86
    SFX(mk_transpose_by)(dst, dst_row, x, x_row, count, d,
                         REAL_IS_DOUBLE ? 4 : width == 16 ? 16 : 8);
#else
    for (ptrdiff_t r = 0; r < count; r++)
        for (ptrdiff_t c = 0; c < d; c++) dst[c * dst_row + r] = x[r * x_row + c];
#endif
}

/* block (d, lanes) <- rows [0, count) of x transposed, lanes past `count`
 * 0: a panel of keys or a strip of queries */
void TYPED(mk_pack_f32, mk_pack_f64)(
    REAL *block, const REAL *x, ptrdiff_t x_row, ptrdiff_t count, ptrdiff_t d, ptrdiff_t lanes,
    int width)
{
    if (count < lanes) memset(block, 0, (size_t)(d * lanes) * sizeof *block);
    SFX(mk_transpose)(block, lanes, x, x_row, count, d, width);
}

/* block (e / kb, kb, kb) <- rows [0, count) of v, by groups of kb columns,
 * keys past `count` 0: a panel of values. The copies are of kb numbers, a
 * constant in each branch. */
static void SFX(mk_pack_values)(REAL *block, const REAL *v, ptrdiff_t v_row, ptrdiff_t count,
                                ptrdiff_t e, ptrdiff_t kb)
{
#define MK_PACK(kb)                                                                 \
    for (ptrdiff_t j = 0; j < count; j++)                                           \
        for (ptrdiff_t g = 0; g < e; g += (kb))                                     \
            memcpy(block + (g + j) * (kb), v + j * v_row + g, (kb) * sizeof(REAL))
    if (count < kb) memset(block, 0, (size_t)(e * kb) * sizeof(REAL));
    if (kb == 8)
        MK_PACK(8);
    else
        MK_PACK(kb);
#undef MK_PACK
}

/* The panels of the keys [j0, j0 + cols) and of their values into their
 * slots, those not there already. */
static void SFX(mk_pack_panels)(const attnx_softmax_args *a, packed_panels *pk, const REAL *k,
                                const REAL *v, ptrdiff_t j0, ptrdiff_t cols)
{
    ptrdiff_t kb = MK_KB(pk->width), d = a->d, e = a->e;
    for (ptrdiff_t p = j0 / kb; p * kb < j0 + cols; p++) {
        ptrdiff_t slot = p % pk->slots, count = ATTNX_MIN(kb, a->m - p * kb);
        if (pk->owner[slot] == p + 1) continue;
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
        if (a->kv_half) {
            /* the keys' rows as 32-bit words (d, k_row even): pairs */
            const uint16_t *k_bits = (const uint16_t *)k + p * kb * a->k_row;
            SFX(mk_pack)(pk->kt_pairs + slot * kb * (d / 2), (const REAL *)k_bits, a->k_row / 2,
                         count, d / 2, kb, pk->width);
            pk->exact[slot] = 1;
            for (ptrdiff_t g = 0; g < e; g += kb)
                mk_pair_bf16_rows(pk->vt_pairs + slot * kb * e / 2 + g * kb / 2, kb,
                                  (const uint16_t *)v + p * kb * a->v_row + g, a->v_row, count, kb);
            pk->v_exact[slot] = 1;
            pk->owner[slot] = p + 1;
            continue;
        }
#endif
        SFX(mk_pack)((REAL *)pk->kt + slot * kb * d, k + p * kb * a->k_row, a->k_row, count, d, kb,
                     pk->width);
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
        if (pk->kt_pairs)
            pk->exact[slot] = (unsigned char)mk_pair_rows(pk->kt_pairs + slot * kb * ((d + 1) / 2),
                                                          kb, (REAL *)pk->kt + slot * kb * d, kb, d,
                                                          kb);
#endif
        if (pk->vt)
            SFX(mk_pack_values)((REAL *)pk->vt + slot * kb * e, v + p * kb * a->v_row, a->v_row,
                                count, e, kb);
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
        /* group by group, the keys paired (the second of the last pair 0
         * past an odd count; the pairs past it are never read: P V stops
         * at the tile's last key) */
        if (pk->vt_pairs) {
            int exact = 1;
            for (ptrdiff_t g = 0; g < e; g += kb)
                exact &= mk_pair_rows(pk->vt_pairs + slot * kb * e / 2 + g * kb / 2,
                                      kb, v + p * kb * a->v_row + g, a->v_row, count, kb);
            pk->v_exact[slot] = (unsigned char)exact;
        }
#endif
        pk->owner[slot] = p + 1;
    }
}

/* The tile's output (zero), its queries packed strip by strip into qt
 * (strips, d, strip), and the panels forgotten when this head's keys or
 * values are not the ones packed. */
static void SFX(mk_prepare_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                 SFX(tile_work) *w, const REAL *q, const REAL *k, const REAL *v,
                                 REAL *out, ptrdiff_t rows, REAL scale2)
{
    packed_panels *pk = w->operands;
    memset(w->ot, 0, (size_t)(a->e * w->st_ld) * sizeof(REAL));
    if (pk->k != k || ((pk->vt || pk->vt_pairs) && pk->v != v)) {
        memset(pk->owner, 0, (size_t)pk->slots * sizeof *pk->owner);
        pk->k = k;
        pk->v = v;
    }
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += be->strip)
        SFX(mk_pack)(w->qt + r0 * a->d, q + r0 * a->q_row, a->q_row,
                     ATTNX_MIN(be->strip, rows - r0), a->d, be->strip, be->width);
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
    if (pk->kt_pairs) {
        /* the padding rows past `rows` are 0, a bfloat16 value */
        pk->q_exact = 1;
        for (ptrdiff_t r0 = 0; r0 < rows; r0 += be->strip)
            pk->q_exact &= mk_pair_rows(pk->qt_pairs + r0 * ((a->d + 1) / 2), be->strip,
                                        w->qt + r0 * a->d, be->strip, a->d, be->strip);
    }
#endif
}

/* ot (e, st_ld) times the rows' correction */
static void SFX(mk_rescale_output)(SFX(tile_work) *w, ptrdiff_t rows, ptrdiff_t e)
{
    for (ptrdiff_t c = 0; c < e; c++)
        for (ptrdiff_t r = 0; r < rows; r++) w->ot[c * w->st_ld + r] *= w->correction[r];
}

/* 1 when the values of the tile's panels are all bfloat16 values, with
 * their pairs packed */
static int SFX(mk_values_exact)(const packed_panels *pk, const mk_tile *t, ptrdiff_t kb)
{
    if (!pk->vt_pairs) return 0;
    for (ptrdiff_t p = t->j0 / kb; p * kb < t->j0 + t->cols; p++)
        if (!pk->v_exact[p % pk->slots]) return 0;
    return 1;
}

/* ot += (P V_tile)^T after ot is rescaled by the rows' correction (folded
 * into the P V kernel), values from their panels or read in place, or
 * from their pairs (bf16_products, values all bfloat16 values); values
 * with inf or NaN take the plain path (softmax_add_visible_values) */
static void SFX(mk_tile_add_pv)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                const mk_tile *t, SFX(tile_work) *w, REAL *out, const REAL *v)
{
    const packed_panels *pk = w->operands;
    if (!SFX(softmax_values_finite)(a, w, v, t->j0, t->cols)) {
        SFX(mk_rescale_output)(w, t->rows, a->e);
        ptrdiff_t value_size = a->kv_half ? 2 : (ptrdiff_t)sizeof(REAL);
        const char *v_tile = (const char *)v + t->j0 * a->v_row * value_size;
        SFX(softmax_add_visible_values)(t, w->ot, 1, w->st_ld, w->st, w->st_ld, v_tile, a->v_row,
                                        a->e, a->kv_half);
        return;
    }
    ptrdiff_t kb = be->kb;
    if (SFX(mk_values_exact)(pk, t, kb)) {
        /* pair c of a group: keys 2c and 2c + 1 of its panel */
        mk_values pairs = {pk->vt_pairs, pk->slots, kb * a->e / 2, kb, kb * kb / 2};
        be->mk->add_pv_pairs(t, w->ot, w->st_ld, w->st, w->st_ld, &pairs, a->e, w->correction,
                             (REAL *)pk->p_pairs);
        return;
    }
    mk_values values = {pk->vt, pk->slots, kb * a->e, kb, kb * kb};
    if (!pk->vt) values = (mk_values){v, PTRDIFF_MAX, kb * a->v_row, a->v_row, kb};
    be->mk->add_pv(t, w->ot, w->st_ld, w->st, w->st_ld, &values, a->e, w->correction);
}

/* 1 when the tile's queries and the keys of its panels are all bfloat16
 * values, with their pair rows packed */
static int SFX(mk_tile_exact)(const packed_panels *pk, const mk_tile *t, ptrdiff_t kb)
{
    if (!pk->kt_pairs || !pk->q_exact) return 0;
    for (ptrdiff_t p = t->j0 / kb; p * kb < t->j0 + t->cols; p++)
        if (!pk->exact[p % pk->slots]) return 0;
    return 1;
}

/* st = the scores of the key tile's panels, packed first where needed */
static void SFX(mk_tile_scores)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                const mk_tile *t, SFX(tile_work) *w, const REAL *q,
                                const REAL *k, const REAL *v, REAL scale2)
{
    packed_panels *pk = w->operands;
    SFX(mk_pack_panels)(a, pk, k, v, t->j0, t->cols);
    if (SFX(mk_tile_exact)(pk, t, be->kb)) {
        be->mk->scores_pairs(t, w->st, w->st_ld, (const REAL *)pk->qt_pairs,
                             (const REAL *)pk->kt_pairs, pk->slots, (a->d + 1) / 2, scale2,
                             w->key_term, w->tile_max);
        return;
    }
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
    if (a->kv_half)
        mk_widen_panels(pk->kt, pk->slots, (const uint16_t *)k, a->k_row, a->m, a->d, be->kb,
                        t->j0, t->cols);
#endif
    be->mk->scores(t, w->st, w->st_ld, w->qt, pk->kt, pk->slots, a->d, scale2, w->key_term,
                   w->tile_max);
}

void TYPED(mk_write_output_f32, mk_write_output_f64)(
    const attnx_softmax_args *a, SFX(tile_work) *w, REAL *out, ptrdiff_t rows,
    const REAL *inverse_sum, int width)
{
    /* normalised down ot's columns, then copied out: the output rows are
     * written once */
    for (ptrdiff_t c = 0; c < a->e; c++)
        for (ptrdiff_t r = 0; r < rows; r++) w->ot[c * w->st_ld + r] *= inverse_sum[r];
    SFX(mk_transpose)(out, a->out_row, w->ot, w->st_ld, a->e, rows, width);
}

static void SFX(mk_finish_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                SFX(tile_work) *w, REAL *out, ptrdiff_t rows,
                                const REAL *inverse_sum)
{
    SFX(mk_write_output)(a, w, out, rows, inverse_sum, be->width);
}

/* Per thread: packed keys and values (slots of panels), packed queries,
 * the transposed output. */
static int SFX(mk_setup)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                         const softmax_plan *plan, SFX(tile_work) *works, softmax_memory *memory)
{
    const ptrdiff_t kb = be->kb, size = (ptrdiff_t)sizeof(REAL), st_ld = plan->st_ld;
    const int threads = plan->threads;
    /* slots of packed keys: every panel, or under a window the keys of two
     * neighbouring query tiles, and at least one key tile's panels (the
     * band may be empty: hi_shift < lo_shift) */
    ptrdiff_t slots = (a->m + kb - 1) / kb;
    if (a->band.has_lo && a->band.has_hi) {
        ptrdiff_t span = ATTNX_MAX(2 * Q_TILE + (a->band.hi_shift - a->band.lo_shift) + 1, KEY_TILE);
        slots = ATTNX_MIN(slots, (span + kb - 1) / kb + 2);
    }
    /* values are packed when more than one query tile reads them (as
     * pairs only, when read from their bits) */
    int pack_values = plan->q_tiles > 1 && !a->kv_half;
    ptrdiff_t packed = softmax_lines(slots * kb * a->d, size);
    ptrdiff_t packed_v = pack_values ? softmax_lines(slots * kb * a->e, size) : 0;
    ptrdiff_t queries = softmax_lines(st_ld * a->d, size), outputs = softmax_lines(st_ld * a->e, size);
    /* the pair rows of the bfloat16 dot products, where they run */
    int pairs = be->mk->scores_pairs &&
                attnx_kernels_bf16_dot(attnx_kernels(ATTNX_FAMILY_SOFTMAX_FWD));
    ptrdiff_t d_pairs = (a->d + 1) / 2;
    ptrdiff_t packed_pairs = pairs ? softmax_lines(slots * kb * d_pairs, size) : 0;
    ptrdiff_t query_pairs = pairs ? softmax_lines(st_ld * d_pairs, size) : 0;
    /* and of P V, where the caller asks for bfloat16 arithmetic: the values
     * in pairs (whether or not the float32 path packs them) and a strip's P */
    int pv_pairs = pairs && a->bf16_products && be->mk->add_pv_pairs;
    ptrdiff_t value_pairs = pv_pairs ? softmax_lines(slots * kb * a->e / 2, size) : 0;
    ptrdiff_t p_pairs = pv_pairs ? softmax_lines(MK_KC / 2 * be->strip, size) : 0;
    ptrdiff_t per_thread = packed + packed_v + queries + outputs + packed_pairs + query_pairs +
                           value_pairs + p_pairs;
    REAL *scratch = NULL;
    ptrdiff_t *owners = malloc((size_t)(slots * threads + 1) * sizeof *owners);
    packed_panels *pks = calloc((size_t)threads, sizeof *pks);
    /* per slot: the keys' exact, then (pv_pairs) the values' */
    unsigned char *exact = pairs ? malloc((size_t)((1 + pv_pairs) * slots * threads)) : NULL;
    memory->blocks[1] = owners;
    memory->blocks[2] = pks;
    memory->blocks[3] = exact;
    if (!owners || !pks || (pairs && !exact) ||
        !(scratch = attnx_aligned_alloc(64, (size_t)(per_thread * threads) * sizeof(REAL))))
        return ATTNX_ENOMEM;
    memory->blocks[0] = scratch;
    for (int t = 0; t < threads; t++) {
        REAL *base = scratch + per_thread * t;
        pks[t] = (packed_panels){be->width, base, pack_values ? base + packed : NULL,
                                 owners + slots * t, slots, NULL, NULL};
        works[t].operands = &pks[t];
        works[t].qt = base + packed + packed_v;
        works[t].ot = works[t].qt + queries;
        if (pairs) {
            /* float32 here: scores_pairs is NULL for float64 */
            pks[t].kt_pairs = (float *)(works[t].ot + outputs);
            pks[t].qt_pairs = pks[t].kt_pairs + packed_pairs;
            pks[t].exact = exact + slots * t;
        }
        if (pv_pairs) {
            pks[t].vt_pairs = pks[t].qt_pairs + query_pairs;
            pks[t].p_pairs = pks[t].vt_pairs + value_pairs;
            pks[t].v_exact = exact + slots * (threads + t);
        }
    }
    return ATTNX_OK;
}

/* The kernels of each instruction set (microkernel.h's suffixes: float32
 * _w16 on AVX-512 and _w8 on AVX2, float64 _d8 and _d4; NEON _n4, _nd2) */
#ifdef MK_HAVE_NEON
#if REAL_IS_DOUBLE
static const mk_kernels_f64 mk_neon_f64 = {mk_scores_nd2, mk_add_pv_nd2, NULL, NULL};
#else
static const mk_kernels_f32 mk_neon_f32 = {mk_scores_n4, mk_add_pv_n4, NULL, NULL};
#endif

const SFX(softmax_backend) SFX(softmax_mk_neon) = {
    .width = 4,
    .mk = &SFX(mk_neon),
    .q_tile = Q_TILE,
    .row_align = MK_ROW_ALIGN,
    .st_pad = 0,
    .kb = MK_KB(4),
    .strip = MK_STRIP(MK_LANES(4, sizeof(REAL))),
    .setup = SFX(mk_setup),
    .prepare_tile = SFX(mk_prepare_tile),
    .key_tile = SFX(softmax_strips_key_tile),
    .scores = SFX(mk_tile_scores),
    .softmax_strip = SFX(softmax_online_strip),
    .add_pv = SFX(mk_tile_add_pv),
    .finish_tile = SFX(mk_finish_tile),
};
#else
#if REAL_IS_DOUBLE
static const mk_kernels_f64 mk_avx512_f64 = {mk_scores_d8, mk_add_pv_d8, NULL, NULL};
static const mk_kernels_f64 mk_avx2_f64 = {mk_scores_d4, mk_add_pv_d4, NULL, NULL};
#else
static const mk_kernels_f32 mk_avx512_f32 = {mk_scores_w16, mk_add_pv_w16, mk_scores_pairs_w16,
                                             mk_add_pv_pairs_w16};
static const mk_kernels_f32 mk_avx2_f32 = {mk_scores_w8, mk_add_pv_w8, NULL, NULL};

/* the online softmax of a whole strip (3 vectors of 16 rows) in registers */
static void mk_softmax_strip_avx512_f32(SFX(tile_work) *w, ptrdiff_t r0, ptrdiff_t r1,
                                        ptrdiff_t lo, ptrdiff_t hi)
{
    mk_softmax_strip_w16(w->st + r0, w->st_ld, lo, hi, w->tile_max + r0, w->row_max + r0,
                         w->row_sum + r0, w->correction + r0, MK_RV);
}

/* the same on AVX2 (3 vectors of 8 rows) */
static void mk_softmax_strip_avx2_f32(SFX(tile_work) *w, ptrdiff_t r0, ptrdiff_t r1,
                                      ptrdiff_t lo, ptrdiff_t hi)
{
    mk_softmax_strip_w8(w->st + r0, w->st_ld, lo, hi, w->tile_max + r0, w->row_max + r0,
                        w->row_sum + r0, w->correction + r0, MK_RV);
}
#endif

const SFX(softmax_backend) SFX(softmax_mk_avx512) = {
    .width = 16,
    .mk = &SFX(mk_avx512),
    .q_tile = Q_TILE,
    .row_align = MK_ROW_ALIGN,
    .st_pad = 0,
    .kb = MK_KB(16),
    .strip = MK_STRIP(MK_LANES(16, sizeof(REAL))),
    .setup = SFX(mk_setup),
    .prepare_tile = SFX(mk_prepare_tile),
    .key_tile = SFX(softmax_strips_key_tile),
    .scores = SFX(mk_tile_scores),
#if REAL_IS_DOUBLE
    .softmax_strip = SFX(softmax_online_strip),
#else
    .softmax_strip = mk_softmax_strip_avx512_f32,
#endif
    .add_pv = SFX(mk_tile_add_pv),
    .finish_tile = SFX(mk_finish_tile),
};

const SFX(softmax_backend) SFX(softmax_mk_avx2) = {
    .width = 8,
    .mk = &SFX(mk_avx2),
    .q_tile = Q_TILE,
    .row_align = MK_ROW_ALIGN,
    .st_pad = 0,
    .kb = MK_KB(8),
    .strip = MK_STRIP(MK_LANES(8, sizeof(REAL))),
    .setup = SFX(mk_setup),
    .prepare_tile = SFX(mk_prepare_tile),
    .key_tile = SFX(softmax_strips_key_tile),
    .scores = SFX(mk_tile_scores),
#if REAL_IS_DOUBLE
    .softmax_strip = SFX(softmax_online_strip),
#else
    .softmax_strip = mk_softmax_strip_avx2_f32,
#endif
    .add_pv = SFX(mk_tile_add_pv),
    .finish_tile = SFX(mk_finish_tile),
};
#endif /* MK_HAVE_NEON */
#endif /* SOFTMAX_MK */

int SFX(softmax_mk_reads_half_kv)(const attnx_softmax_args *a, const SFX(softmax_backend) *be)
{
#if !REAL_IS_DOUBLE && defined(SOFTMAX_MK) && defined(MK_HAVE_X86)
    /* the pairs of bits: whole 32-bit words in every row and head */
    if (a->kv_half != ATTNX_BF16 || !a->bf16_products || be != &SFX(softmax_mk_avx512) ||
        !attnx_kernels_bf16_dot(attnx_kernels(ATTNX_FAMILY_SOFTMAX_FWD)) ||
        a->key_sqnorm_coef != 0 || a->d % 2 || a->k_row % 2 || (uintptr_t)a->k % 4)
        return 0;
    for (ptrdiff_t head = 0; head < a->heads; head++)
        if (a->offsets[head * ATTNX_SM_NOPS + ATTNX_SM_K] % 4) return 0;
    return 1;
#else
    (void)a;
    (void)be;
    return 0;
#endif
}
#endif /* REAL */
