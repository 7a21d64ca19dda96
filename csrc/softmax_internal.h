/* softmax_internal.h - what the softmax kernel's files share: the driver
 * (softmax.c: work split, tile loop, masks, the plain C + BLAS backend)
 * and the backends beside it (softmax_mk.c: micro-kernels; softmax_amx.c:
 * AMX). A backend is a table of the steps of one query tile
 * (softmax_backend), chosen once per call by softmax.c from what the CPU
 * has and the call's shape.
 *
 * The first part is untyped; the second is included from each file's body
 * once per REAL (real.h), and declares the typed tile state, the backend
 * table and the typed helpers softmax.c defines for every backend.
 *
 * Legend as in softmax.c: n queries, m keys, d features, e value features;
 *   st    (cols, st_ld)  scores tile, transposed: one query row per column
 *   ot    (e, st_ld)     the tile's output, transposed (micro-kernels, AMX)
 */
#ifndef ATTNX_SOFTMAX_INTERNAL_H
#define ATTNX_SOFTMAX_INTERNAL_H
#include <stddef.h>

#include "amx.h"
#include "attnx.h"
#include "dispatch.h"
#include "microkernel.h"

/* this build has micro-kernel backends (softmax_mk.c) */
#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
#define SOFTMAX_MK 1
#endif

/* Tile sizes: a scores tile of Q_TILE x KEY_TILE stays in L2, and tall
 * query tiles amortise the packing of each key tile over many rows. Q_TILE
 * is a whole number of micro-kernel strips (MK_ROW_ALIGN); KEY_TILE a whole
 * number of panels. (Measured at n = 2048, d = 64: 240 x 512, 480 x 256,
 * 144 x 256 and 240 x 128 all within the noise of 240 x 256.) */
#define Q_TILE 240
#define KEY_TILE 256

/* Query tiles on AMX (float32, amx.h) hold this many rows, 8 blocks of
 * 32: a block is the rows of one product block. */
#define AMX_Q_TILE 256

/* Decoding (softmax_decode.c): calls with at most DECODE_MAX_QUERIES query
 * rows per head and at least DECODE_MIN_KEYS keys split each head's keys
 * across the threads; a group of heads that share their keys and values
 * holds at most DECODE_MAX_ROWS query rows. */
#define DECODE_MAX_QUERIES 8
#define DECODE_MIN_KEYS 128
#define DECODE_MAX_ROWS 32

/* Values are checked for inf and NaN (see softmax_values_finite) in blocks
 * of this many keys, once per head and thread. */
#define V_BLOCK 64

/* The per-call sizes every backend sees: query rows per tile, the number
 * of query tiles per head, and the lanes of st (st_ld >= the tile's rows). */
typedef struct {
    ptrdiff_t q_tile, q_tiles, st_ld;
    int threads;
} softmax_plan;

/* The items [next, end) of one thread's share of the work. */
typedef struct {
    ptrdiff_t next, end;
} item_range;

/* softmax.c: the next work item for thread `self`: its own share's first
 * one left, or, when its share is done, another share's last one; -1 when
 * none is left. A thread slowed by other work on its core then does not
 * hold up the call, and a head's query tiles still mostly go to one
 * thread, which packs the head's keys and values once. */
ptrdiff_t softmax_claim_item(item_range *shares, int threads, int self) ATTNX_HIDDEN;

/* count numbers of `size` bytes rounded up to whole cache lines: each
 * part of a thread's scratch starts on its own line */
static inline ptrdiff_t softmax_lines(ptrdiff_t count, ptrdiff_t size)
{
    ptrdiff_t line = 64 / size;
    return (count + line - 1) / line * line;
}

/* What a backend allocates for one call (its per-thread operands); the
 * driver releases them when the call ends: blocks[0] with
 * attnx_aligned_free (the aligned scratch, from attnx_aligned_alloc), the
 * others with free(). */
#define SOFTMAX_BLOCKS 4
typedef struct {
    void *blocks[SOFTMAX_BLOCKS];
} softmax_memory;

/* A bias or mask that depends on the key only (key padding: shape (..., 1,
 * m)) joins the per-key term; one that depends on the query too is
 * applied to the scores tile. */
static inline int softmax_bias_per_key(const attnx_softmax_args *a)
{
    return a->bias_row == 0 || a->n == 1;
}
static inline int softmax_mask_per_key(const attnx_softmax_args *a)
{
    return a->mask_row == 0 || a->n == 1;
}
#endif /* ATTNX_SOFTMAX_INTERNAL_H */

#ifdef REAL /* the typed part, once per REAL */

/* One thread's working memory for a query tile (arrays of st_ld lanes are
 * indexed by the tile's query rows). */
typedef struct {
    REAL *st;           /* (KEY_TILE, st_ld) scores, then probabilities */
    ptrdiff_t st_ld;
    REAL *key_term;     /* (KEY_TILE) per-key addend of the scores, log2 units */
    REAL *tile_max;     /* max of the row's scores in the current key tile */
    REAL *row_max, *row_sum;  /* the online softmax, log2 units */
    REAL *correction;   /* 2^(old max - new max), to rescale the output */
    REAL *shift, *tile_sum;   /* plain-loop softmax: the max subtracted, the running sum;
                               * at the tile's end, shift holds the rows' 1 / sum */
    ptrdiff_t head;           /* the tile's head, flat index (dropout's counter) */
    int calling_thread;       /* this thread is the caller's (it polls for interrupts) */
    unsigned char *v_state;   /* per block of V_BLOCK values: 0 unchecked, 1 finite, 2 not */
    const void *v_seen;       /* the values v_state describes */
    /* the backend's own, set by its setup (plain: none) */
    REAL *qt;           /* the tile's queries, packed (micro-kernels) or transposed (AMX) */
    REAL *ot;           /* (e or e padded, st_ld) the output, transposed */
    void *operands;     /* the packed keys and values of a head */
} SFX(tile_work);

/* One backend: the steps of a query tile [i0, i0 + rows) of one head, in
 * the order the driver (softmax_tile in softmax.c) calls them:
 *   prepare_tile  zero the tile's output, pack its queries
 *   for each key tile [j0, j0 + cols) the rows can see, from a multiple of
 *   kb (the driver fills key_term first, up to cols rounded up to kb):
 *     key_tile    its scores, the online softmax of the rows and output +=
 *                 P V; plain and micro-kernels: softmax_strips_key_tile,
 *                 which runs scores, then softmax_strip per strip of rows,
 *                 then add_pv; AMX its own walk by blocks of 32 rows (and
 *                 no scores, softmax_strip, add_pv)
 *   finish_tile   out = the output over the rows' sums (inverse_sum)
 * setup sizes and allocates the per-thread operands of a call. */
typedef struct SFX(softmax_backend) SFX(softmax_backend);
typedef struct SFX(mk_kernels) SFX(mk_kernels);
struct SFX(softmax_backend) {
    int width;             /* the micro-kernels' instruction set (attnx_kernels_width), 0 none */
    const SFX(mk_kernels) *mk;  /* the micro-kernels of that width (softmax_mk.c), or NULL */
    ptrdiff_t q_tile;      /* query rows per tile */
    ptrdiff_t row_align;   /* st_ld is the rows rounded up to this (1: the rows) */
    ptrdiff_t st_pad;      /* lanes added to st_ld past that */
    ptrdiff_t kb;          /* keys per panel: key tiles start at multiples of kb */
    ptrdiff_t strip;       /* rows per strip of softmax_strip (0: the tile's rows) */
    int (*setup)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                 const softmax_plan *plan, SFX(tile_work) *works, softmax_memory *memory);
    void (*prepare_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                         SFX(tile_work) *w, const REAL *q, const REAL *k, const REAL *v,
                         REAL *out, ptrdiff_t rows, REAL scale2);
    void (*key_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                     const mk_tile *t, SFX(tile_work) *w, const REAL *q, const REAL *k,
                     const REAL *v, REAL *out, const REAL *bias, const unsigned char *mask,
                     REAL scale2, int per_query);
    /* st = the tile's scores (log2 units, hidden keys -inf), tile_max their
     * row max, for the keys each strip computes (mk_strip_keys, kb) */
    void (*scores)(const SFX(softmax_backend) *be, const attnx_softmax_args *a, const mk_tile *t,
                   SFX(tile_work) *w, const REAL *q, const REAL *k, const REAL *v, REAL scale2);
    /* the online softmax of rows [r0, r1) over the keys [lo, hi) */
    void (*softmax_strip)(SFX(tile_work) *w, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t lo,
                          ptrdiff_t hi);
    /* the output times the rows' correction, plus P V_tile */
    void (*add_pv)(const SFX(softmax_backend) *be, const attnx_softmax_args *a, const mk_tile *t,
                   SFX(tile_work) *w, REAL *out, const REAL *v);
    void (*finish_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                        SFX(tile_work) *w, REAL *out, ptrdiff_t rows, const REAL *inverse_sum);
};

/* Not exported from the module: calls between the files stay direct. */
#pragma GCC visibility push(hidden)

/* softmax.c: the backend of a call, and the steps every backend shares */
const SFX(softmax_backend) *SFX(softmax_choose_backend)(const attnx_softmax_args *a);
/* bias[j] = coef * |x_j|^2 over rows x_j (gaussian attention's -|k_j|^2 /
 * (2 sigma^2), and the query's own term of its lse) */
void SFX(softmax_sqnorm_terms)(REAL *bias, const REAL *rows_x, ptrdiff_t x_row, ptrdiff_t count,
                               ptrdiff_t d, REAL coef);

/* key_term[j] for the tile's keys [j0, j0 + cols), in log2 units: the
 * gaussian term, a per-key bias, -inf for a key its mask removes; 0 in the
 * panel padding up to `padded`. */
void SFX(softmax_fill_key_term)(const attnx_softmax_args *a, REAL *key_term, const REAL *k,
                                const REAL *bias, const unsigned char *mask, ptrdiff_t j0,
                                ptrdiff_t cols, ptrdiff_t padded);
/* a bias or mask that depends on the query as well, on rows [r0, r1) over
 * the keys [lo, hi), and those rows' tile_max taken anew */
void SFX(softmax_apply_bias_mask)(const attnx_softmax_args *a, const mk_tile *t,
                                  SFX(tile_work) *w, const REAL *bias, const unsigned char *mask,
                                  ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t lo, ptrdiff_t hi);
/* the online softmax of rows [r0, r1) in plain loops */
void SFX(softmax_online_strip)(SFX(tile_work) *w, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t lo,
                               ptrdiff_t hi);
/* 1 when the values of the keys [j0, j0 + cols) are all finite */
int SFX(softmax_values_finite)(const attnx_softmax_args *a, SFX(tile_work) *w, const void *v,
                               ptrdiff_t j0, ptrdiff_t cols);
/* acc_r += sum_j p_rj v_j over the keys with p_rj != 0 only (values with
 * inf or NaN); acc's element (r, c) at acc[r acc_row + c acc_col]; v_tile
 * holds half-precision bits when kv_half says so */
void SFX(softmax_add_visible_values)(const mk_tile *t, REAL *acc, ptrdiff_t acc_row,
                                     ptrdiff_t acc_col, const REAL *pt, ptrdiff_t pt_ld,
                                     const void *v_tile, ptrdiff_t v_row, ptrdiff_t e,
                                     int kv_half);
/* a key tile on backends that take the tile's rows strip by strip */
void SFX(softmax_strips_key_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                  const mk_tile *t, SFX(tile_work) *w, const REAL *q,
                                  const REAL *k, const REAL *v, REAL *out, const REAL *bias,
                                  const unsigned char *mask, REAL scale2, int per_query);

/* softmax_decode.c: 1 when the call is decoding's (few queries, many
 * keys, no dropout nor gaussian key term), and its forward */
int SFX(softmax_decode_applies)(const attnx_softmax_args *a);
int SFX(softmax_decode)(const attnx_softmax_args *a);

/* softmax_mk.c: 1 when backend `be` reads the call's keys and values as
 * the bfloat16 bits they are given in (kv_half: the AVX-512 micro-kernels
 * with bf16_products pair them straight from the bits) */
int SFX(softmax_mk_reads_half_kv)(const attnx_softmax_args *a, const SFX(softmax_backend) *be);

/* softmax_mk.c: the micro-kernels' backends, one per instruction set, and
 * the packing and transposes AMX (and lsh.c) use too */
#ifdef SOFTMAX_MK
#ifdef MK_HAVE_NEON
extern const SFX(softmax_backend) SFX(softmax_mk_neon);
#else
extern const SFX(softmax_backend) SFX(softmax_mk_avx512);
extern const SFX(softmax_backend) SFX(softmax_mk_avx2);
#endif
/* block (d, lanes) <- rows [0, count) of x transposed, lanes past count 0 */
void SFX(mk_pack)(REAL *block, const REAL *x, ptrdiff_t x_row, ptrdiff_t count, ptrdiff_t d,
                  ptrdiff_t lanes, int width);
/* dst[c][r] = x[r][c] for r < count, c < d (row strides dst_row, x_row), by
 * the register transposes of instruction set `width` (x86) */
void SFX(mk_transpose)(REAL *dst, ptrdiff_t dst_row, const REAL *x, ptrdiff_t x_row,
                       ptrdiff_t count, ptrdiff_t d, int width);
/* out (rows, e) <- ot (e, st_ld) over the rows' sums, transposed */
void SFX(mk_write_output)(const attnx_softmax_args *a, SFX(tile_work) *w, REAL *out,
                          ptrdiff_t rows, const REAL *inverse_sum, int width);
#endif

/* softmax_amx.c: float32 on AMX */
#if !REAL_IS_DOUBLE && defined(ATTNX_HAVE_AMX)
extern const softmax_backend_f32 softmax_amx_f32;
#endif
#pragma GCC visibility pop

#endif /* REAL */
