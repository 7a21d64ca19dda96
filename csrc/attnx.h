/* attnx.h - the kernel API: plain C, no Python.
 *
 * Every kernel works on a batch of independent "heads" (the broadcast
 * leading axes, flattened). An operand has one base pointer; head h of
 * operand op starts offsets[h * nops + op] BYTES after it, so broadcast axes
 * (stride 0) and transposed views cost nothing. Inside a head, rows are
 * contiguous and a row stride (in elements) separates them.
 *
 * Legend: n queries, m keys, d query/key features, e value features,
 *         r kernel features (linear family).
 *
 * Kernels never abort: they return ATTNX_OK or an error status that the
 * binding turns into a Python exception.
 */
#ifndef ATTNX_H
#define ATTNX_H

#include <stddef.h>
#include <stdint.h>

enum { ATTNX_OK = 0, ATTNX_ENOMEM = 1, ATTNX_EINVAL = 2 };

/* Which keys a query row sees, from `causal` and `window`: key j is visible
 * from query i iff  i + lo_shift <= j  (when has_lo)
 *              and  j <= i + hi_shift  (when has_hi).
 * The band is monotone in i, so a tile of rows sees a contiguous key range. */
typedef struct {
    ptrdiff_t n, m;
    int has_lo, has_hi;
    ptrdiff_t lo_shift, hi_shift;
} attnx_band;

static inline ptrdiff_t attnx_band_first(const attnx_band *band, ptrdiff_t i)
{
    if (!band->has_lo) return 0;
    ptrdiff_t j = i + band->lo_shift;
    return j < 0 ? 0 : (j > band->m ? band->m : j);
}

/* one past the last visible key of row i (<= first when it sees nothing) */
static inline ptrdiff_t attnx_band_end(const attnx_band *band, ptrdiff_t i)
{
    if (!band->has_hi) return band->m;
    ptrdiff_t j = i + band->hi_shift + 1;
    return j < 0 ? 0 : (j > band->m ? band->m : j);
}

/* ------------------------------------------------------------------------
 * Softmax (scaled dot product) attention, FlashAttention-style.
 *   s_ij = exp(scale * q_i.k_j + bias_ij + key_sqnorm_coef * |k_j|^2)
 *   out_i = sum_j s_ij v_j / sum_j s_ij,  lse_i = log sum_j s_ij
 * over the keys visible through band and mask.
 */
enum {
    ATTNX_SM_Q, ATTNX_SM_K, ATTNX_SM_V, ATTNX_SM_OUT, ATTNX_SM_LSE,
    ATTNX_SM_BIAS, ATTNX_SM_MASK, ATTNX_SM_NOPS
};

typedef struct {
    ptrdiff_t n, m, d, e;
    ptrdiff_t heads;
    const ptrdiff_t *offsets;          /* (heads, ATTNX_SM_NOPS) byte offsets */
    const void *q, *k, *v;             /* (n, d), (m, d), (m, e) per head */
    void *out;                         /* (n, e) per head */
    void *lse;                         /* (n,) contiguous per head, or NULL */
    const void *bias;                  /* broadcast (n, m) view, or NULL */
    const unsigned char *mask;         /* broadcast (n, m) bool view, or NULL */
    ptrdiff_t q_row, k_row, v_row, out_row;  /* row strides, elements */
    ptrdiff_t bias_row, bias_col;      /* element strides, 0 when broadcast */
    ptrdiff_t mask_row, mask_col;      /* byte strides, 0 when broadcast */
    double scale;
    double key_sqnorm_coef;            /* gaussian attention: -1/(2 sigma^2) */
    attnx_band band;
    int num_threads;
} attnx_softmax_args;

int attnx_softmax_fwd_f32(const attnx_softmax_args *args);
int attnx_softmax_fwd_f64(const attnx_softmax_args *args);

/* Threads: one pool size for every kernel (set from Python). */
int attnx_get_num_threads(void);
void attnx_set_num_threads(int num_threads);
void attnx_blas_init(void);
const char *attnx_blas_name(void);
const char *attnx_simd_level(void);

#endif
