/* mk_linear.h - the linear family's AVX-512 float32 kernels: one chunk of
 * the chunk method forward (linear.c, fused_chunk) and its backward
 * (bwd_fused_chunk). Included by microkernel.h in its AVX-512 float32 body
 * (MK_W == 16), after the softmax tiles' kernels and before mk_decode.h,
 * which uses MK_CHUNK_COLUMNS and mk_add_keys_w16 from here. */
#if !defined(MK_W) || MK_W != 16
#error "mk_linear.h is included by microkernel.h, in its AVX-512 float32 body"
#endif

/* ------------------------------------------------------------------------
 * Kernelised attention, the chunk method (linear.c): one chunk of 16 query
 * rows against the state and the 16 keys of its diagonal block.
 *   phi, psi (16, r)  features of the chunk's queries and keys, rows r apart
 *   P        (16, 16) phi psi^T, the pairs a row cannot see zeroed
 *   S (r, e), z (r,)  the state, S contiguous
 */

/* The rows that the next chunk reads and writes, asked of the memory a
 * line at a time from inside the kernels' loops (mk_ahead_step), so that
 * they arrive while this chunk computes. Asked all at once before it, they
 * stall the core: each operand's chunk is a 4 KiB page of its own, where
 * the hardware's stream prefetch stops, and the memory takes a few dozen
 * lines at a time. */
#define MK_AHEAD_MAX 6
typedef struct {
    const char *next[MK_AHEAD_MAX];  /* the next line of each region */
    const char *end[MK_AHEAD_MAX];   /* past the last byte of its current row */
    ptrdiff_t stride[MK_AHEAD_MAX];  /* bytes between its rows */
    ptrdiff_t row_bytes[MK_AHEAD_MAX];
    ptrdiff_t rows_left[MK_AHEAD_MAX];  /* rows after the current one */
    int write[MK_AHEAD_MAX];         /* the chunk writes it */
    int regions, current;
} mk_ahead;

/* `rows` rows of `row_bytes` bytes from `first`, `stride` bytes apart */
static inline void mk_ahead_add(mk_ahead *ahead, const void *first, ptrdiff_t stride,
                                ptrdiff_t row_bytes, ptrdiff_t rows, int write)
{
    if (rows <= 0 || row_bytes <= 0 || ahead->regions == MK_AHEAD_MAX) return;
    int k = ahead->regions++;
    ahead->next[k] = (const char *)((uintptr_t)first & ~(uintptr_t)63);
    ahead->end[k] = (const char *)first + row_bytes;
    ahead->stride[k] = stride;
    ahead->row_bytes[k] = row_bytes;
    ahead->rows_left[k] = rows - 1;
    ahead->write[k] = write;
}

/* ask for the next line, if any is left */
static inline __attribute__((always_inline)) void mk_ahead_step(mk_ahead *ahead)
{
    if (!ahead || ahead->current == ahead->regions) return;
    int k = ahead->current;
    if (ahead->write[k]) __builtin_prefetch(ahead->next[k], 1);
    else __builtin_prefetch(ahead->next[k], 0);
    ahead->next[k] += 64;
    if (ahead->next[k] < ahead->end[k]) return;
    if (ahead->rows_left[k]-- > 0) {
        const char *row = ahead->end[k] - ahead->row_bytes[k] + ahead->stride[k];
        ahead->next[k] = (const char *)((uintptr_t)row & ~(uintptr_t)63);
        ahead->end[k] = row + ahead->row_bytes[k];
    } else {
        ahead->current++;
    }
}

/* acc[i][h] += sum_p A[i][p] B[p][16 h .. 16 h + 16) over p < k, for mr
 * rows of A (element (i, p) at a[i a_row + p a_col]) and nv vectors of
 * B's rows; mr and nv are constants after inlining. */
static inline __attribute__((always_inline)) void mk_rank_w16(__m512 acc[6][4], int mr, int nv,
                                                              const float *a, ptrdiff_t a_row,
                                                              ptrdiff_t a_col, const float *b,
                                                              ptrdiff_t b_row, ptrdiff_t k,
                                                              mk_ahead *ahead)
{
    for (ptrdiff_t p = 0; p < k; p++) {
        mk_ahead_step(ahead);
        __m512 b_p[4];
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) b_p[h] = _mm512_loadu_ps(b + p * b_row + h * 16);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m512 a_ip = _mm512_set1_ps(a[i * a_row + p * a_col]);
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) acc[i][h] = _mm512_fmadd_ps(a_ip, b_p[h], acc[i][h]);
        }
    }
}

/* rows [0, mr) of the chunk's output, columns [0, 16 nv): phi S + P V,
 * S still without the chunk's keys */
static inline __attribute__((always_inline)) void mk_chunk_out_w16(
    int mr, int nv, const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *p,
    const float *v, ptrdiff_t v_row, float *out, ptrdiff_t out_row, mk_ahead *ahead)
{
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = _mm512_setzero_ps();
    mk_rank_w16(acc, mr, nv, phi, r, 1, S, e, r, ahead);
    mk_rank_w16(acc, mr, nv, p, 16, 1, v, v_row, 16, ahead);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + i * out_row + h * 16, acc[i][h]);
}

/* rows [0, mr) of S, columns [0, 16 nv): S += psi^T V over `keys` keys */
static inline __attribute__((always_inline)) void mk_chunk_state_w16(
    int mr, int nv, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    ptrdiff_t keys, float *S, ptrdiff_t e, mk_ahead *ahead)
{
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = _mm512_loadu_ps(S + i * e + h * 16);
    mk_rank_w16(acc, mr, nv, psi, 1, r, v, v_row, keys, ahead);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) _mm512_storeu_ps(S + i * e + h * 16, acc[i][h]);
}

/* one call per width of the column block, nv a constant in each */
#define MK_CHUNK_COLUMNS(e, CALL)                             \
    for (ptrdiff_t c0 = 0; c0 < (e); c0 += 64) {              \
        switch ((e) - c0 >= 64 ? 4 : ((e) - c0) / 16) {       \
        case 4: CALL(4); break;                               \
        case 3: CALL(3); break;                               \
        case 2: CALL(2); break;                               \
        default: CALL(1); break;                              \
        }                                                     \
    }

/* S (r, e) += psi^T V over `keys` keys (psi rows r apart), in key order,
 * 6 features at a time: r % 2 == 0 (r % 6 is then 0, 2 or 4), e % 16 == 0 */
static inline __attribute__((always_inline)) void mk_add_keys_body_w16(
    const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t keys, float *S,
    ptrdiff_t e, mk_ahead *ahead)
{
#define MK_STATE(nv)                                                                            \
    do {                                                                                        \
        ptrdiff_t f0 = 0;                                                                       \
        for (; f0 + 6 <= r; f0 += 6)                                                            \
            mk_chunk_state_w16(6, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e, ahead); \
        if (r - f0 == 4)                                                                        \
            mk_chunk_state_w16(4, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e, ahead); \
        if (r - f0 == 2)                                                                        \
            mk_chunk_state_w16(2, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e, ahead); \
    } while (0)
    MK_CHUNK_COLUMNS(e, MK_STATE)
#undef MK_STATE
}

/* the same as a call of its own, for linear.c's held keys; the fused
 * kernels inline the body, so that their r = e = 64 variants (below)
 * reach it with constant sizes */
static inline void mk_add_keys_w16(const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
                                   ptrdiff_t keys, float *S, ptrdiff_t e, mk_ahead *ahead)
{
    mk_add_keys_body_w16(psi, r, v, v_row, keys, S, e, ahead);
}

/* z (r,) += sum_t w[t] x_t over 16 rows x_t (r apart), w NULL: all 1;
 * r % 8 == 0 */
static inline void mk_add_rows_w16(float *z, const float *x, ptrdiff_t r, const float *w)
{
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 16) {
        __mmask16 lanes = r - f0 >= 16 ? (__mmask16)0xffff : (__mmask16)0xff;
        __m512 sum = _mm512_maskz_loadu_ps(lanes, z + f0);
        for (int t = 0; t < 16; t++) {
            __m512 x_t = _mm512_maskz_loadu_ps(lanes, x + t * r + f0);
            sum = w ? _mm512_fmadd_ps(_mm512_set1_ps(w[t]), x_t, sum) : _mm512_add_ps(sum, x_t);
        }
        _mm512_mask_storeu_ps(z + f0, lanes, sum);
    }
}

/* out (16 rows out_row apart, e) = phi S + P V for a chunk's 16 rows:
 * phi (16, r), S (r, e), P (16, 16), V (16 rows v_row apart, e), in row
 * blocks of 6, 6 and 4 (mk_chunk_out_w16's registers) */
static inline __attribute__((always_inline)) void mk_chunk_rows_w16(
    const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *p, const float *v,
    ptrdiff_t v_row, float *out, ptrdiff_t out_row, mk_ahead *ahead)
{
#define MK_ROWS(nv)                                                                             \
    do {                                                                                        \
        mk_chunk_out_w16(6, nv, phi, r, S + c0, e, p, v + c0, v_row, out + c0, out_row, ahead); \
        mk_chunk_out_w16(6, nv, phi + 6 * r, r, S + c0, e, p + 6 * 16, v + c0, v_row,           \
                         out + 6 * out_row + c0, out_row, ahead);                               \
        mk_chunk_out_w16(4, nv, phi + 12 * r, r, S + c0, e, p + 12 * 16, v + c0, v_row,         \
                         out + 12 * out_row + c0, out_row, ahead);                              \
    } while (0)
    MK_CHUNK_COLUMNS(e, MK_ROWS)
#undef MK_ROWS
}

/* The chunk: out = phi S + P V and den[t] += sum_j P[t][j], with P =
 * phi psi^T where row t sees the keys j < visible[t] (others 0; negative
 * similarities, rounding in taylor's 1 + cos, clamped to 0 as in linear.c,
 * NaN kept); then S += psi^T V and z += sum_j psi_j. r % 8 == 0, e % 16
 * == 0, V finite (linear.c checks); psi_t (r, 16) and p (16, 16) scratch;
 * `ahead` (or NULL) the next chunk's rows, asked for along the way. */
static inline __attribute__((always_inline)) void mk_linear_chunk_body_w16(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t e,
    const ptrdiff_t *visible, float *S, float *z, float *out, ptrdiff_t out_row, float *den,
    float *psi_t, float *p, mk_ahead *ahead)
{
    /* pass 1: P, each row one vector over the 16 keys, from psi^T */
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 8)
        for (ptrdiff_t j0 = 0; j0 < 16; j0 += 8)
            mk_transpose8(psi_t + f0 * 16 + j0, 16, psi + j0 * r + f0, r);
    __m512 p_row[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) p_row[t] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f++) {
        __m512 keys_f = _mm512_loadu_ps(psi_t + f * 16);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            p_row[t] = _mm512_fmadd_ps(_mm512_set1_ps(phi[t * r + f]), keys_f, p_row[t]);
    }
    for (int t = 0; t < 16; t++) {
        __mmask16 seen = visible[t] >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << visible[t]) - 1);
        /* max(0, x) is x for NaN: the second operand wins when one is NaN */
        __m512 kept = _mm512_maskz_max_ps(seen, _mm512_setzero_ps(), p_row[t]);
        den[t] += _mm512_reduce_add_ps(kept);
        _mm512_storeu_ps(p + t * 16, kept);
    }
    /* pass 2: the output, from the state before the chunk's keys */
    mk_chunk_rows_w16(phi, r, S, e, p, v, v_row, out, out_row, ahead);
    /* pass 3: the chunk's keys into the state */
    mk_add_keys_body_w16(psi, r, v, v_row, 16, S, e, ahead);
    mk_add_rows_w16(z, psi, r, NULL);
}

/* with r = e = 64 and packed rows (the common head size) the body's
 * loops take constant bounds and strides */
static inline void mk_linear_chunk_w16(const float *phi, const float *psi, ptrdiff_t r,
                                       const float *v, ptrdiff_t v_row, ptrdiff_t e,
                                       const ptrdiff_t *visible, float *S, float *z, float *out,
                                       ptrdiff_t out_row, float *den, float *psi_t, float *p,
                                       mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64 && out_row == 64)
        mk_linear_chunk_body_w16(phi, psi, 64, v, 64, 64, visible, S, z, out, 64, den, psi_t, p,
                                 ahead);
    else
        mk_linear_chunk_body_w16(phi, psi, r, v, v_row, e, visible, S, z, out, out_row, den, psi_t,
                                 p, ahead);
}

/* ------------------------------------------------------------------------
 * The backward of one chunk (linear.c, bwd_scan_head), 16 query rows
 * against the 16 keys of their diagonal block. Most of its products read
 * the state with the chunk's rows across the vector lanes ("lanes" form:
 * X^T (cols, 16), column c of 16 rows in one vector), so that both
 * products with a transposed state, dout S^T and v dS^T, keep the state in
 * the (r, e) layout that the state updates (mk_add_keys_w16) and linear.c's
 * other paths use. Per row t, with a_t = dout_t / D_t (see linear.c):
 *   pass 1 (rows in order):  U = S dout^T,  b_t = -(dout_t . num_t) / (D_t den_t),
 *                            dphi = a S^T + b z^T + ds psi,  S += psi^T v
 *   pass 2 (reverse):        dv = psi dS + P^T a,  dpsi = v dS^T + dz + ds^T phi,
 *                            dS += phi^T a
 * with P = phi psi^T and ds_tj = a_t . v_j + b_t on the visible pairs. */

/* acc[i] += sum_p A[i][p] B[p] for mr rows of A (element (i, p) at
 * a[i a_row + p a_col]) and B (k, 16) in lanes form; mr a constant after
 * inlining */
static inline __attribute__((always_inline)) void mk_lanes_w16(__m512 acc[16], int mr,
                                                               const float *a, ptrdiff_t a_row,
                                                               ptrdiff_t a_col, const float *b,
                                                               ptrdiff_t k, mk_ahead *ahead)
{
    for (ptrdiff_t p = 0; p < k; p++) {
        mk_ahead_step(ahead);
        __m512 b_p = _mm512_loadu_ps(b + p * 16);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * a_row + p * a_col]), b_p, acc[i]);
    }
}

/* dst (cols, 16) = the 16 rows of src (rows src_row apart) transposed;
 * cols % 8 == 0 */
static inline void mk_to_lanes_w16(float *dst, const float *src, ptrdiff_t src_row, ptrdiff_t cols)
{
    ptrdiff_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) mk_transpose16(dst + c0 * 16, 16, src + c0, src_row);
    if (c0 < cols) {
        mk_transpose8(dst + c0 * 16, 16, src + c0, src_row);
        mk_transpose8(dst + c0 * 16 + 8, 16, src + 8 * src_row + c0, src_row);
    }
}

/* dst (16 rows dst_row apart, cols) = src (cols, 16) in lanes form
 * transposed back; cols % 8 == 0 */
static inline void mk_from_lanes_w16(float *dst, ptrdiff_t dst_row, const float *src, ptrdiff_t cols)
{
    ptrdiff_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) mk_transpose16(dst + c0, dst_row, src + c0 * 16, 16);
    if (c0 < cols) {
        mk_transpose8(dst + c0, dst_row, src + c0 * 16, 16);
        mk_transpose8(dst + 8 * dst_row + c0, dst_row, src + c0 * 16 + 8, 16);
    }
}

/* The pairs that key j of the block shares with the 16 rows: row t sees
 * the keys j < visible[t] */
static inline __mmask16 mk_key_lanes_w16(__m512i visible, ptrdiff_t j)
{
    return _mm512_cmpgt_epi32_mask(visible, _mm512_set1_epi32((int)j));
}

/* Where both passes meet: with the rows' features phi_t (r, 16) and the
 * keys' psi, v and the rows' dout_t (e, 16) in lanes form, p_t (16, 16)
 * = P^T (invisible pairs 0, negative similarities kept at 0 as in the
 * forward) and dv_t (16, 16) = (dout v^T)^T; returns sum_j P_tj in lane t
 * and, in *num_dot, sum_j P_tj (dout_t . v_j). */
static inline __m512 mk_bwd_block_w16(const float *psi, ptrdiff_t r, const float *v,
                                      ptrdiff_t v_row, ptrdiff_t e, __m512i visible,
                                      const float *phi_t, const float *dout_t, float *p_t,
                                      float *dv_t, __m512 *num_dot, mk_ahead *ahead)
{
    __m512 acc[16], den = _mm512_setzero_ps(), dot = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    mk_lanes_w16(acc, 16, psi, r, 1, phi_t, r, ahead);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        /* max(0, x) is x for NaN: the second operand wins when one is NaN */
        __m512 kept = _mm512_maskz_max_ps(mk_key_lanes_w16(visible, j), _mm512_setzero_ps(), acc[j]);
        den = _mm512_add_ps(den, kept);
        _mm512_storeu_ps(p_t + j * 16, kept);
        acc[j] = _mm512_setzero_ps();
    }
    mk_lanes_w16(acc, 16, v, v_row, 1, dout_t, e, ahead);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(p_t + j * 16), acc[j], dot);
        _mm512_storeu_ps(dv_t + j * 16, acc[j]);
    }
    *num_dot = dot;
    return den;
}

/* ds_t[j] = a_t . v_j + b_t on the visible pairs, 0 elsewhere, from dv_t */
static inline void mk_bwd_dscores_w16(float *ds_t, const float *dv_t, __m512i visible,
                                      __m512 inv_den, __m512 b)
{
    for (int j = 0; j < 16; j++)
        _mm512_storeu_ps(ds_t + j * 16, _mm512_maskz_fmadd_ps(mk_key_lanes_w16(visible, j), inv_den,
                                                              _mm512_loadu_ps(dv_t + j * 16), b));
}

/* one call per block of 16 (or a last 8) rows of a lanes-form result */
#define MK_LANE_ROWS(rows, CALL)                          \
    for (ptrdiff_t f0 = 0; f0 < (rows); f0 += 16) {       \
        if ((rows) - f0 >= 16) CALL(16);                  \
        else CALL(8);                                     \
    }

/* Scratch of the two passes, in floats: phi_t, grad_t (r, 16), dout_t,
 * v_t (e, 16), p_t, dv_t, ds_t, ds (16, 16), a (16, e) */
#define MK_BWD_SCRATCH(r, e) (32 * (r) + 48 * (e) + 4 * 256)

/* Pass 1 over the chunk: dphi (16, r), 1 / D_t into inv_den[t] and b_t
 * into row_b[t] (from the clamp eps[t] per row), then the chunk's keys
 * into (S, z). r % 8 == 0, e % 16 == 0, every input finite (linear.c
 * checks); `ahead` (or NULL) the next chunk's rows, asked for along the
 * way. When `kept` is not NULL, the block's P^T and ds_t (what pass 2
 * would compute again) go into its 16 rows (kept_row apart) of 32
 * numbers: row t holds vector t of p_t, then vector t of ds_t. */
static inline __attribute__((always_inline)) void mk_linear_bwd_rows_body_w16(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows, const float *eps,
    float *S, float *z, float *inv_den, float *row_b, float *dphi, float *kept, ptrdiff_t kept_row,
    float *scratch, mk_ahead *ahead)
{
    float *phi_t = scratch, *grad_t = phi_t + 16 * r, *dout_t = grad_t + 16 * r;
    float *p_t = dout_t + 32 * e, *dv_t = p_t + 256, *ds_t = dv_t + 256;
    __m512i visible = _mm512_loadu_si512(visible_rows);
    mk_to_lanes_w16(phi_t, phi, r, r);
    mk_to_lanes_w16(dout_t, dout, dout_row, e);
    /* U = S dout^T into grad_t, with phi . z and phi . U = dout . (phi S),
     * each sum in 4 parts (r % 8 == 0): one chain of r dependent FMAs
     * would wait 4 r cycles */
    __m512 den_part[4], dot_part[4], block_dot;
    for (int h = 0; h < 4; h++) den_part[h] = dot_part[h] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f += 4)
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
            den_part[h] = _mm512_fmadd_ps(_mm512_set1_ps(z[f + h]), _mm512_loadu_ps(phi_t + (f + h) * 16),
                                          den_part[h]);
#define MK_U(mr)                                                                              \
    do {                                                                                      \
        __m512 acc[16];                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();   \
        mk_lanes_w16(acc, mr, S + f0 * e, e, 1, dout_t, e, ahead);                            \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) {                               \
            _mm512_storeu_ps(grad_t + (f0 + i) * 16, acc[i]);                                 \
            dot_part[i % 4] = _mm512_fmadd_ps(_mm512_loadu_ps(phi_t + (f0 + i) * 16), acc[i], \
                                              dot_part[i % 4]);                               \
        }                                                                                     \
    } while (0)
    MK_LANE_ROWS(r, MK_U)
#undef MK_U
    __m512 den = _mm512_add_ps(_mm512_add_ps(den_part[0], den_part[1]),
                               _mm512_add_ps(den_part[2], den_part[3]));
    __m512 num_dot = _mm512_add_ps(_mm512_add_ps(dot_part[0], dot_part[1]),
                                   _mm512_add_ps(dot_part[2], dot_part[3]));
    den = _mm512_add_ps(den, mk_bwd_block_w16(psi, r, v, v_row, e, visible, phi_t, dout_t, p_t,
                                              dv_t, &block_dot, ahead));
    num_dot = _mm512_add_ps(num_dot, block_dot);
    /* D = max(den, eps); a row with den == 0 has no gradient, nor b one
     * where the clamp binds (as linear.c's bwd_row_factors) */
    __m512 eps_v = _mm512_loadu_ps(eps);
    __mmask16 empty = _mm512_cmp_ps_mask(den, _mm512_setzero_ps(), _CMP_EQ_OQ);
    __mmask16 clamped = _mm512_cmp_ps_mask(den, eps_v, _CMP_LT_OQ);
    __m512 inv = _mm512_maskz_div_ps((__mmask16)~empty, _mm512_set1_ps(1.0f),
                                     _mm512_mask_blend_ps(clamped, den, eps_v));
    __m512 b = _mm512_maskz_div_ps((__mmask16)~(empty | clamped),
                                   _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), num_dot), inv), den);
    _mm512_storeu_ps(inv_den, inv);
    _mm512_storeu_ps(row_b, b);
    mk_bwd_dscores_w16(ds_t, dv_t, visible, inv, b);
    if (kept)
        for (int t = 0; t < 16; t++) {
            _mm512_storeu_ps(kept + t * kept_row, _mm512_loadu_ps(p_t + t * 16));
            _mm512_storeu_ps(kept + t * kept_row + 16, _mm512_loadu_ps(ds_t + t * 16));
        }
    /* dphi = a S^T + b z^T + ds psi, in lanes form over U */
#define MK_DPHI(mr)                                                                           \
    do {                                                                                      \
        __m512 acc[16];                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) acc[i] = _mm512_fmadd_ps(       \
            _mm512_set1_ps(z[f0 + i]), b, _mm512_mul_ps(inv, _mm512_loadu_ps(grad_t + (f0 + i) * 16))); \
        mk_lanes_w16(acc, mr, psi + f0, 1, r, ds_t, 16, ahead);                               \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _mm512_storeu_ps(grad_t + (f0 + i) * 16, acc[i]);                                 \
    } while (0)
    MK_LANE_ROWS(r, MK_DPHI)
#undef MK_DPHI
    mk_from_lanes_w16(dphi, r, grad_t, r);
    mk_add_keys_body_w16(psi, r, v, v_row, 16, S, e, ahead);
    mk_add_rows_w16(z, psi, r, NULL);
}

/* Pass 2 over the chunk, (dS, dz) holding the gradient that the later
 * rows send to these keys: dv (16 rows dv_row apart), dpsi (16, r), then
 * (dS, dz) += what these rows send to the earlier keys. inv_den, row_b
 * from pass 1; the conditions of pass 1. `kept`: pass 1's P^T and ds_t
 * of the block, or NULL to compute them again. */
static inline __attribute__((always_inline)) void mk_linear_bwd_keys_body_w16(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
    const float *inv_den, const float *row_b, float *dS, float *dz, float *dv, ptrdiff_t dv_row,
    float *dpsi, const float *kept, ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
    float *phi_t = scratch, *grad_t = phi_t + 16 * r, *dout_t = grad_t + 16 * r, *v_t = dout_t + 16 * e;
    float *p_t = v_t + 16 * e, *dv_t = p_t + 256, *ds_t = dv_t + 256, *ds = ds_t + 256;
    float *a = ds + 256;
    mk_to_lanes_w16(v_t, v, v_row, e);
    if (kept) {
        for (int t = 0; t < 16; t++)
            _mm512_storeu_ps(p_t + t * 16, _mm512_loadu_ps(kept + t * kept_row));
        mk_transpose16(ds, 16, kept + 16, kept_row);
    } else {
        __m512i visible = _mm512_loadu_si512(visible_rows);
        __m512 unused;
        mk_to_lanes_w16(phi_t, phi, r, r);
        mk_to_lanes_w16(dout_t, dout, dout_row, e);
        mk_bwd_block_w16(psi, r, v, v_row, e, visible, phi_t, dout_t, p_t, dv_t, &unused, ahead);
        mk_bwd_dscores_w16(ds_t, dv_t, visible, _mm512_loadu_ps(inv_den), _mm512_loadu_ps(row_b));
        mk_transpose16(ds, 16, ds_t, 16);
    }
    for (int t = 0; t < 16; t++) {
        __m512 inv_t = _mm512_set1_ps(inv_den[t]);
        for (ptrdiff_t c = 0; c < e; c += 16)
            _mm512_storeu_ps(a + t * e + c, _mm512_mul_ps(inv_t, _mm512_loadu_ps(dout + t * dout_row + c)));
    }
    /* dv = psi dS + P^T a: the forward's output kernel on other operands */
    mk_chunk_rows_w16(psi, r, dS, e, p_t, a, e, dv, dv_row, ahead);
    /* dpsi = v dS^T + dz + ds^T phi, in lanes form (the keys across the lanes) */
#define MK_DPSI(mr)                                                                           \
    do {                                                                                      \
        __m512 acc[16];                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) acc[i] = _mm512_set1_ps(dz[f0 + i]); \
        mk_lanes_w16(acc, mr, dS + f0 * e, e, 1, v_t, e, ahead);                              \
        mk_lanes_w16(acc, mr, phi + f0, 1, r, ds, 16, ahead);                                 \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _mm512_storeu_ps(grad_t + (f0 + i) * 16, acc[i]);                                 \
    } while (0)
    MK_LANE_ROWS(r, MK_DPSI)
#undef MK_DPSI
    mk_from_lanes_w16(dpsi, r, grad_t, r);
    mk_add_keys_body_w16(phi, r, a, e, 16, dS, e, ahead);
    mk_add_rows_w16(dz, phi, r, row_b);
}

/* The two passes, with r = e = 64 and values rows 64 apart (contiguous
 * heads of 64 features) as constants: the lanes loops then address their
 * 16 rows of the state from one register instead of spilling 16 pointers
 * (a tenth faster: docs/performance.md, the C code's choices). */
static inline void mk_linear_bwd_rows_w16(const float *phi, const float *psi, ptrdiff_t r,
                                          const float *v, ptrdiff_t v_row, const float *dout,
                                          ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
                                          const float *eps, float *S, float *z, float *inv_den,
                                          float *row_b, float *dphi, float *kept,
                                          ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64)
        mk_linear_bwd_rows_body_w16(phi, psi, 64, v, 64, dout, dout_row, 64, visible_rows, eps, S,
                                    z, inv_den, row_b, dphi, kept, kept_row, scratch, ahead);
    else
        mk_linear_bwd_rows_body_w16(phi, psi, r, v, v_row, dout, dout_row, e, visible_rows, eps, S,
                                    z, inv_den, row_b, dphi, kept, kept_row, scratch, ahead);
}

static inline void mk_linear_bwd_keys_w16(const float *phi, const float *psi, ptrdiff_t r,
                                          const float *v, ptrdiff_t v_row, const float *dout,
                                          ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
                                          const float *inv_den, const float *row_b, float *dS,
                                          float *dz, float *dv, ptrdiff_t dv_row, float *dpsi,
                                          const float *kept, ptrdiff_t kept_row, float *scratch,
                                          mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64)
        mk_linear_bwd_keys_body_w16(phi, psi, 64, v, 64, dout, dout_row, 64, visible_rows, inv_den,
                                    row_b, dS, dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
    else
        mk_linear_bwd_keys_body_w16(phi, psi, r, v, v_row, dout, dout_row, e, visible_rows, inv_den,
                                    row_b, dS, dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
}
#undef MK_LANE_ROWS
