/* softmax_amx.c - the softmax backend on AMX tiles, float32 only (amx.h:
 * Q K^T and P V as bfloat16 x 3 splits, accumulated in float32; one plane
 * for an operand whose numbers are bfloat16 values, per block of 32 keys
 * for K and V, per tile for Q, and for P where the caller asks for
 * bfloat16 arithmetic: bf16_products, attnx.h).
 *
 * A query tile of AMX_Q_TILE rows is walked block of 32 rows by block,
 * each through its scores, online softmax and P V in turn, per key tile.
 * The keys and V^T of a head are split once, block by block of 32 keys as
 * query tiles first need them; the tile's scaled Q^T once per tile. The
 * output accumulates transposed in ot and is written out as the
 * micro-kernels' is (mk_write_output). Legend as in softmax.c. */
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h" /* vec_real.h declares the BLAS calls */
#include "softmax_internal.h"

#ifdef ATTNX_HAVE_AMX
#define REAL float
#define REAL_IS_DOUBLE 0
#define SFX(name) name##_f32
#include "vec_real.h"
#include "softmax_internal.h"

/* One thread's operands for the AMX products: the keys and V^T of one
 * head, split once, block by block of 32 keys as query tiles first need
 * them; the tile's scaled Q^T; one row block's P^T. Planes are AMX_PLANES
 * apart by the sizes given. A product's tiles each read 16 rows of 64
 * bytes: rows 64 bytes apart (not a row of the whole tile or head apart)
 * keep them out of each other's cache sets. */
typedef struct {
    uint16_t *k_op;          /* rows (m_pad, d_pad) */
    uint16_t *v_op;          /* rows (m_pad / 32, e_pad, 32): V^T by blocks of keys */
    uint16_t *q_op;          /* pairs (st_ld / 32, d_pad / 2, 64) by blocks of rows */
    uint16_t *p_op;          /* pairs (KEY_TILE / 2, 64) */
    float *v_t;              /* (e, 32) V^T of one block of keys, to split */
    /* per block of 32 keys, the planes its keys' and V^T's operands need
     * (1 or AMX_PLANES); 0 while k_op, v_op do not hold it */
    unsigned char *key_planes, *value_planes;
    int query_planes;        /* those of the tile's Q^T */
    const void *k, *v;       /* the keys and values they hold */
    ptrdiff_t d_pad, e_pad, m_pad;
} amx_operands;

/* The blocks of 32 keys in [j0, j1) (multiples of 32) that x does not hold
 * yet into its keys' and V^T's operands; keys past m are 0. */
static void amx_pack_keys(const attnx_softmax_args *a, amx_operands *x, const float *k,
                          const float *v, ptrdiff_t j0, ptrdiff_t j1)
{
    const ptrdiff_t d_pad = x->d_pad, m_pad = x->m_pad;
    for (ptrdiff_t b = j0 / 32; b < j1 / 32; b++) {
        if (x->key_planes[b]) continue;
        ptrdiff_t first = b * 32, count = ATTNX_MIN(32, a->m - first);
        x->key_planes[b] = (unsigned char)amx_split_rows(x->k_op + first * d_pad, d_pad,
                                                         m_pad * d_pad, k + first * a->k_row,
                                                         a->k_row, count, 32, a->d, d_pad);
        mk_pack_f32(x->v_t, v + first * a->v_row, a->v_row, count, a->e, 32, 16);
        x->value_planes[b] = (unsigned char)amx_split_rows(
            x->v_op + first * x->e_pad, 32, x->e_pad * m_pad, x->v_t, 32, a->e, x->e_pad, 32, 32);
    }
}

/* The tile's output (zero, e_pad rows of ot), the head's operands
 * forgotten when its keys or values are not the ones split, the tile
 * registers configured, and Q^T (rows d to d_pad stay 0), then its pairs
 * (unscaled: amx_finish_scores scales the products). */
static void amx_prepare_tile(const softmax_backend_f32 *be, const attnx_softmax_args *a,
                             tile_work_f32 *w, const float *q, const float *k, const float *v,
                             float *out, ptrdiff_t rows, float scale2)
{
    amx_operands *x = w->operands;
    const ptrdiff_t st_ld = w->st_ld, d_pad = x->d_pad, q_plane = d_pad * st_ld;
    memset(w->ot, 0, (size_t)(x->e_pad * st_ld) * sizeof(float));
    if (x->k != k || x->v != v) {
        memset(x->key_planes, 0, (size_t)(x->m_pad / 32));
        x->k = k;
        x->v = v;
    }
    amx_configure();
    mk_pack_f32(w->qt, q, a->q_row, rows, a->d, st_ld, 16);
    x->query_planes = 1;
    for (ptrdiff_t g = 0; g + 32 <= st_ld; g += 16) {
        int needed;
        amx_split_pairs(x->q_op + g / 32 * d_pad * 32 + g % 32 * 2, 64, q_plane, w->qt + g, st_ld,
                        d_pad / 2, AMX_PLANES, &needed);
        x->query_planes = ATTNX_MAX(x->query_planes, needed);
    }
}

/* The key tile t (j0 a multiple of 32) block of 32 rows by block: its
 * scores, their online softmax, then its output += P V into ot. */
static void amx_key_tile(const softmax_backend_f32 *be, const attnx_softmax_args *a,
                         const mk_tile *t, tile_work_f32 *w, const float *q, const float *k,
                         const float *v, float *out, const float *bias, const unsigned char *mask,
                         float scale2, int per_query)
{
    amx_operands *x = w->operands;
    const ptrdiff_t st_ld = w->st_ld, d_pad = x->d_pad, e_pad = x->e_pad, m_pad = x->m_pad;
    const ptrdiff_t k_plane = m_pad * d_pad, v_plane = e_pad * m_pad, q_plane = d_pad * st_ld;
    const ptrdiff_t p_plane = KEY_TILE * 32;
    const ptrdiff_t j0 = t->j0, rows = t->rows, padded = (t->cols + 31) / 32 * 32;
    float *st = w->st, *ot = w->ot;
    amx_pack_keys(a, x, k, v, j0, j0 + padded);
    /* every value the products read, the padding up to 32 keys too:
     * their weights are 0, but 0 times inf is NaN */
    int finite = softmax_values_finite_f32(a, w, v, j0, ATTNX_MIN(padded, a->m - j0));
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += 32) {
        ptrdiff_t lo, hi, r1 = ATTNX_MIN(r0 + 32, rows);
        mk_strip_keys(t, r0, 32, 32, &lo, &hi);
        if (hi <= lo) continue; /* nothing to see: the rows' state stays */
        for (ptrdiff_t r = r0; r < r0 + 32; r++) w->tile_max[r] = -INFINITY;
        int value_planes = 1;
        for (ptrdiff_t c0 = lo; c0 < hi; c0 += 32) {
            ptrdiff_t block = (j0 + c0) / 32;
            amx_product(st + c0 * st_ld + r0, st_ld, x->k_op + (j0 + c0) * d_pad, d_pad, 32,
                        k_plane, x->key_planes[block], x->q_op + r0 * d_pad, 64, q_plane,
                        x->query_planes, d_pad / 32, 0);
            amx_finish_scores(t, st, st_ld, r0, c0, scale2, w->key_term, w->tile_max);
            value_planes = ATTNX_MAX(value_planes, x->value_planes[block]);
        }
        if (per_query) softmax_apply_bias_mask_f32(a, t, w, bias, mask, r0, r1, lo, hi);
        mk_softmax_strip_w16(st + r0, st_ld, lo, hi, w->tile_max + r0, w->row_max + r0,
                             w->row_sum + r0, w->correction + r0, 2);
        amx_rescale(ot + r0, st_ld, a->e, w->correction + r0);
        if (!finite) {
            const mk_tile block = {&a->band, t->i0 + r0, r1 - r0, j0, t->cols};
            softmax_add_visible_values_f32(&block, ot + r0, 1, st_ld, st + r0, st_ld,
                                           v + j0 * a->v_row, a->v_row, a->e, 0);
            continue;
        }
        /* bfloat16 arithmetic: P rounded to bfloat16, as torch's flash
         * attention rounds it for bfloat16 tensors, where the values are
         * bfloat16 values (as the micro-kernels' pairs, softmax_mk.c) */
        int p_planes = a->bf16_products && value_planes == 1 ? 1 : AMX_PLANES;
        for (ptrdiff_t g = 0; g < 32; g += 16)
            amx_split_pairs(x->p_op + 2 * g, 64, p_plane, st + lo * st_ld + r0 + g, st_ld,
                            (hi - lo) / 2, p_planes, NULL);
        for (ptrdiff_t c0 = 0; c0 < e_pad; c0 += 32)
            amx_product(ot + c0 * st_ld + r0, st_ld, x->v_op + (j0 + lo) * e_pad + c0 * 32, 32,
                        e_pad * 32, v_plane, value_planes, x->p_op, 64, p_plane, p_planes,
                        (hi - lo) / 32, 1);
    }
}

/* the tile registers released, then out written as the micro-kernels do */
static void amx_finish_tile(const softmax_backend_f32 *be, const attnx_softmax_args *a,
                            tile_work_f32 *w, float *out, ptrdiff_t rows, const float *inverse_sum)
{
    amx_release();
    mk_write_output_f32(a, w, out, rows, inverse_sum, 16);
}

/* Per thread: Q^T (d_pad rows) and the transposed output (e_pad rows),
 * then the operands (in floats: two bfloat16 per float): keys, V^T, Q^T's
 * pairs, one row block's P^T, one block of V^T to split. */
static int amx_setup(const softmax_backend_f32 *be, const attnx_softmax_args *a,
                     const softmax_plan *plan, tile_work_f32 *works, softmax_memory *memory)
{
    const ptrdiff_t size = (ptrdiff_t)sizeof(float), st_ld = plan->st_ld;
    const int threads = plan->threads;
    /* AMX operands pad d, e and m to whole steps of 32 */
    ptrdiff_t d_pad = (a->d + 31) / 32 * 32, e_pad = (a->e + 31) / 32 * 32;
    ptrdiff_t m_pad = (a->m + 31) / 32 * 32;
    ptrdiff_t queries = softmax_lines(st_ld * d_pad, size), outputs = softmax_lines(st_ld * e_pad, size);
    ptrdiff_t k_op = softmax_lines(AMX_PLANES * m_pad * d_pad / 2, size);
    ptrdiff_t v_op = softmax_lines(AMX_PLANES * e_pad * m_pad / 2, size);
    ptrdiff_t q_op = softmax_lines(AMX_PLANES * d_pad * st_ld / 2, size);
    ptrdiff_t p_op = softmax_lines(AMX_PLANES * KEY_TILE * 32 / 2, size);
    ptrdiff_t v_t = softmax_lines(a->e * 32, size);
    ptrdiff_t per_thread = queries + outputs + k_op + v_op + q_op + p_op + v_t;
    float *scratch = NULL;
    /* per thread: the planes of its blocks' keys, then of their V^T */
    unsigned char *planes = malloc((size_t)(2 * threads * (m_pad / 32)) + 1);
    amx_operands *amxs = calloc((size_t)threads, sizeof *amxs);
    memory->blocks[1] = planes;
    memory->blocks[2] = amxs;
    if (!planes || !amxs ||
        !(scratch = attnx_aligned_alloc(64, (size_t)(per_thread * threads) * sizeof(float))))
        return ATTNX_ENOMEM;
    memory->blocks[0] = scratch;
    for (int t = 0; t < threads; t++) {
        tile_work_f32 *w = &works[t];
        float *qt = scratch + per_thread * t, *ops = qt + queries + outputs;
        amxs[t] = (amx_operands){
            .k_op = (uint16_t *)ops,
            .v_op = (uint16_t *)(ops + k_op),
            .q_op = (uint16_t *)(ops + k_op + v_op),
            .p_op = (uint16_t *)(ops + k_op + v_op + q_op),
            .v_t = ops + k_op + v_op + q_op + p_op,
            .key_planes = planes + 2 * t * (m_pad / 32),
            .value_planes = planes + (2 * t + 1) * (m_pad / 32),
            .d_pad = d_pad,
            .e_pad = e_pad,
            .m_pad = m_pad,
        };
        w->operands = &amxs[t];
        w->qt = qt;
        w->ot = qt + queries;
        /* Q^T's padding rows past d, which no pass writes */
        memset(qt + a->d * st_ld, 0, (size_t)((d_pad - a->d) * st_ld) * sizeof(float));
    }
    return ATTNX_OK;
}

const softmax_backend_f32 softmax_amx_f32 = {
    .width = 16,
    .mk = NULL, /* its own kernels, amx.h */
    .q_tile = AMX_Q_TILE,
    .row_align = 32, /* whole blocks of rows */
    /* AMX reads and writes 16 rows of st and ot at a time: rows 1 KiB
     * apart would share 4 of L1's 64 sets */
    .st_pad = 16,
    .kb = 32,
    .strip = 32,
    .setup = amx_setup,
    .prepare_tile = amx_prepare_tile,
    .key_tile = amx_key_tile,
    /* amx_key_tile runs its own steps block by block */
    .scores = NULL,
    .softmax_strip = NULL,
    .add_pv = NULL,
    .finish_tile = amx_finish_tile,
};

#undef REAL
#undef REAL_IS_DOUBLE
#undef SFX
#endif /* ATTNX_HAVE_AMX */
