/* mk_linear.h - the linear family's float32 kernels, for one vector width:
 * one chunk of the chunk method forward (linear.c, fused_chunk) and its
 * backward (bwd_fused_chunk). Included by microkernel.h in each of its
 * float32 bodies (MK_F32: AVX-512, AVX2+FMA, NEON), after the softmax
 * tiles' kernels and, in the AVX-512 one, before mk_decode.h, which uses
 * MK_CHUNK_COLUMNS and mk_add_keys_w16 from here.
 *
 * The kernels are written once with GNU vector extensions (MK_VEC, MK_W
 * numbers); what differs between the widths is how many registers their
 * blocks take:
 *   - the products in the state's (r, e) layout keep 6 rows by
 *     MK_LIN_NV vectors in registers: 6 x 4 of the 32 of AVX-512 and NEON,
 *     6 x 2 of the 16 of AVX2 (with the vectors of B and a broadcast: 29
 *     and 15);
 *   - those in "lanes" form (below) hold a row of the chunk's 16 rows in
 *     MK_CV = 16 / MK_W vectors, MK_LANES_MR rows at a time: 16 x 1 on
 *     AVX-512, 6 x 2 on AVX2, 6 x 4 on NEON;
 *   - the next chunk's rows are asked for (mk_ahead) once every
 *     MK_AHEAD_EVERY steps of the products' loops, about as often in time
 *     at every width: asked faster, the prefetches wait for the memory and
 *     stall the core (on AVX2 one in 4 steps was fastest: docs/performance.md,
 *     the C code's choices; NEON's one in 2 is a guess from its widths,
 *     unmeasured: no aarch64 machine here, only an emulated one). */
#if !defined(MK_W) || !defined(MK_F32)
#error "mk_linear.h is included by microkernel.h, in its float32 bodies"
#endif

/* the chunk's 16 rows (or keys) in vectors */
#define MK_CV (16 / MK_W)
#if MK_W == 8
#define MK_LIN_NV 2
#define MK_LANES_MR 6
#define MK_AHEAD_EVERY 4
#define MK_TRANSPOSE mk_transpose8
#define MK_LIN(w16, w8, n4) w8
#elif MK_W == 16
#define MK_LIN_NV 4
#define MK_LANES_MR 16
#define MK_AHEAD_EVERY 1
#define MK_TRANSPOSE mk_transpose16
#define MK_LIN(w16, w8, n4) w16
#else
#define MK_LIN_NV 4
#define MK_LANES_MR 6
#define MK_AHEAD_EVERY 2
#define MK_TRANSPOSE mk_transpose4
#define MK_LIN(w16, w8, n4) n4
#endif
/* a vector of int32 lanes, as many as MK_VEC's (its comparisons' type) */
typedef int32_t MK_NAME(mk_ivec) __attribute__((vector_size(MK_W * 4), aligned(4), may_alias));
#define MK_IVEC MK_NAME(mk_ivec)

/* ------------------------------------------------------------------------
 * Kernelised attention, the chunk method (linear.c): one chunk of 16 query
 * rows against the state and the 16 keys of its diagonal block.
 *   phi, psi (16, r)  features of the chunk's queries and keys, rows r apart
 *   P        (16, 16) phi psi^T, the pairs a row cannot see zeroed
 *   S (r, e), z (r,)  the state, S contiguous
 */

/* acc[i][h] += sum_p A[i][p] B[p][MK_W h .. MK_W (h + 1)) over p < k, for
 * mr rows of A (element (i, p) at a[i a_row + p a_col]) and nv vectors of
 * B's rows; mr and nv are constants after inlining. (mk_decode.h calls it
 * too.) */
static inline __attribute__((always_inline)) void MK_LIN(mk_rank_w16, mk_rank_w8, mk_rank_n4)(
    MK_VEC acc[6][MK_LIN_NV], int mr, int nv, const float *a, ptrdiff_t a_row, ptrdiff_t a_col,
    const float *b, ptrdiff_t b_row, ptrdiff_t k, mk_ahead *ahead)
{
    for (ptrdiff_t p = 0; p < k; p++) {
        if (p % MK_AHEAD_EVERY == 0) mk_ahead_step(ahead);
        MK_VEC b_p[MK_LIN_NV];
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) b_p[h] = *(const MK_VEC *)(b + p * b_row + h * MK_W);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            /* x - 0 is x for every x: a broadcast straight from memory */
            MK_VEC a_ip = a[i * a_row + p * a_col] - (MK_VEC){0};
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) acc[i][h] += a_ip * b_p[h];
        }
    }
}

/* rows [0, mr) of the chunk's output, columns [0, MK_W nv): phi S + P V,
 * S still without the chunk's keys */
static inline __attribute__((always_inline)) void MK_NAME(mk_chunk_out)(
    int mr, int nv, const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *p,
    const float *v, ptrdiff_t v_row, float *out, ptrdiff_t out_row, mk_ahead *ahead)
{
    MK_VEC acc[6][MK_LIN_NV];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = (MK_VEC){0};
    MK_NAME(mk_rank)(acc, mr, nv, phi, r, 1, S, e, r, ahead);
    MK_NAME(mk_rank)(acc, mr, nv, p, 16, 1, v, v_row, 16, ahead);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) *(MK_VEC *)(out + i * out_row + h * MK_W) = acc[i][h];
}

/* rows [0, mr) of S, columns [0, MK_W nv): S += psi^T V over `keys` keys */
static inline __attribute__((always_inline)) void MK_NAME(mk_chunk_state)(
    int mr, int nv, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    ptrdiff_t keys, float *S, ptrdiff_t e, mk_ahead *ahead)
{
    MK_VEC acc[6][MK_LIN_NV];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = *(const MK_VEC *)(S + i * e + h * MK_W);
    MK_NAME(mk_rank)(acc, mr, nv, psi, 1, r, v, v_row, keys, ahead);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) *(MK_VEC *)(S + i * e + h * MK_W) = acc[i][h];
}

/* one call per width of the column block, nv a constant in each: blocks
 * of MK_LIN_NV vectors, then what is left (e % 16 == 0) */
#if MK_LIN_NV == 4
#define MK_CHUNK_COLUMNS(e, CALL) MK_COLUMNS_BY4(e, CALL)
#else
#define MK_CHUNK_COLUMNS(e, CALL)                                       \
    for (ptrdiff_t c0 = 0; c0 < (e); c0 += 2 * MK_W) {                  \
        if ((e) - c0 >= 2 * MK_W) CALL(2);                              \
        else CALL(1);                                                   \
    }
#endif

/* S (r, e) += psi^T V over `keys` keys (psi rows r apart), in key order,
 * 6 features at a time: r % 2 == 0 (r % 6 is then 0, 2 or 4), e % 16 == 0 */
static inline __attribute__((always_inline)) void MK_NAME(mk_add_keys_body)(
    const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t keys, float *S,
    ptrdiff_t e, mk_ahead *ahead)
{
#define MK_STATE(nv)                                                                              \
    do {                                                                                          \
        ptrdiff_t f0 = 0;                                                                         \
        for (; f0 + 6 <= r; f0 += 6)                                                              \
            MK_NAME(mk_chunk_state)(6, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e,  \
                                    ahead);                                                       \
        if (r - f0 == 4)                                                                          \
            MK_NAME(mk_chunk_state)(4, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e,  \
                                    ahead);                                                       \
        if (r - f0 == 2)                                                                          \
            MK_NAME(mk_chunk_state)(2, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e,  \
                                    ahead);                                                       \
    } while (0)
    MK_CHUNK_COLUMNS(e, MK_STATE)
#undef MK_STATE
}

/* the same as a call of its own, for linear.c's held keys; the fused
 * kernels inline the body, so that their r = e = 64 variants (below)
 * reach it with constant sizes */
static inline void MK_LIN(mk_add_keys_w16, mk_add_keys_w8, mk_add_keys_n4)(
    const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t keys, float *S,
    ptrdiff_t e, mk_ahead *ahead)
{
    MK_NAME(mk_add_keys_body)(psi, r, v, v_row, keys, S, e, ahead);
}

/* z (r,) += sum_t w[t] x_t over 16 rows x_t (r apart), w NULL: all 1;
 * r % 8 == 0 */
static inline void MK_NAME(mk_add_rows)(float *z, const float *x, ptrdiff_t r, const float *w)
{
    ptrdiff_t f0 = 0;
    for (; f0 + MK_W <= r; f0 += MK_W) {
        MK_VEC sum = *(const MK_VEC *)(z + f0);
        for (int t = 0; t < 16; t++) {
            MK_VEC x_t = *(const MK_VEC *)(x + t * r + f0);
            sum = w ? sum + w[t] * x_t : sum + x_t;
        }
        *(MK_VEC *)(z + f0) = sum;
    }
#if MK_W == 16
    if (f0 < r) { /* a last 8 */
        typedef float half_vec __attribute__((vector_size(32), aligned(4), may_alias));
        half_vec sum = *(const half_vec *)(z + f0);
        for (int t = 0; t < 16; t++) {
            half_vec x_t = *(const half_vec *)(x + t * r + f0);
            sum = w ? sum + w[t] * x_t : sum + x_t;
        }
        *(half_vec *)(z + f0) = sum;
    }
#endif
}

/* out (16 rows out_row apart, e) = phi S + P V for a chunk's 16 rows:
 * phi (16, r), S (r, e), P (16, 16), V (16 rows v_row apart, e), in row
 * blocks of 6, 6 and 4 (mk_chunk_out's registers) */
static inline __attribute__((always_inline)) void MK_NAME(mk_chunk_rows)(
    const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *p, const float *v,
    ptrdiff_t v_row, float *out, ptrdiff_t out_row, mk_ahead *ahead)
{
#define MK_ROWS(nv)                                                                              \
    do {                                                                                         \
        MK_NAME(mk_chunk_out)(6, nv, phi, r, S + c0, e, p, v + c0, v_row, out + c0, out_row,     \
                              ahead);                                                            \
        MK_NAME(mk_chunk_out)(6, nv, phi + 6 * r, r, S + c0, e, p + 6 * 16, v + c0, v_row,       \
                              out + 6 * out_row + c0, out_row, ahead);                           \
        MK_NAME(mk_chunk_out)(4, nv, phi + 12 * r, r, S + c0, e, p + 12 * 16, v + c0, v_row,     \
                              out + 12 * out_row + c0, out_row, ahead);                          \
    } while (0)
    MK_CHUNK_COLUMNS(e, MK_ROWS)
#undef MK_ROWS
}

/* ------------------------------------------------------------------------
 * "Lanes" form: X^T (cols, 16), column c of the chunk's 16 rows in MK_CV
 * vectors, so that a product over the chunk's rows keeps them across the
 * vector lanes. */

/* acc[i] += sum_p A[i][p] B[p] for mr rows of A (element (i, p) at
 * a[i a_row + p a_col]) and B (k, 16) in lanes form; mr a constant after
 * inlining */
static inline __attribute__((always_inline)) void MK_NAME(mk_lanes)(
    MK_VEC acc[MK_LANES_MR][MK_CV], int mr, const float *a, ptrdiff_t a_row, ptrdiff_t a_col,
    const float *b, ptrdiff_t k, mk_ahead *ahead)
{
    for (ptrdiff_t p = 0; p < k; p++) {
        if (p % MK_AHEAD_EVERY == 0) mk_ahead_step(ahead);
        MK_VEC b_p[MK_CV];
#pragma GCC unroll 4
        for (int x = 0; x < MK_CV; x++) b_p[x] = *(const MK_VEC *)(b + p * 16 + x * MK_W);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++) {
            MK_VEC a_ip = a[i * a_row + p * a_col] - (MK_VEC){0};
#pragma GCC unroll 4
            for (int x = 0; x < MK_CV; x++) acc[i][x] += a_ip * b_p[x];
        }
    }
}

/* one call per block of MK_LANES_MR rows of a lanes-form result, then
 * what is left (rows % 8 == 0; r0 the block's first row) */
#if MK_LANES_MR == 16
#define MK_LANE_ROWS(rows, CALL)                          \
    for (ptrdiff_t r0 = 0; r0 < (rows); r0 += 16) {       \
        if ((rows) - r0 >= 16) CALL(16);                  \
        else CALL(8);                                     \
    }
#else
#define MK_LANE_ROWS(rows, CALL)                          \
    for (ptrdiff_t r0 = 0; r0 < (rows); r0 += 6) {        \
        if ((rows) - r0 >= 6) CALL(6);                    \
        else if ((rows) - r0 == 4) CALL(4);               \
        else CALL(2);                                     \
    }
#endif

/* dst (cols, 16) = the 16 rows of src (rows src_row apart) transposed;
 * cols % 8 == 0 */
static inline void MK_NAME(mk_to_lanes)(float *dst, const float *src, ptrdiff_t src_row,
                                        ptrdiff_t cols)
{
    ptrdiff_t c0 = 0;
    for (; c0 + MK_W <= cols; c0 += MK_W)
        for (int x = 0; x < MK_CV; x++)
            MK_TRANSPOSE(dst + c0 * 16 + x * MK_W, 16, src + x * MK_W * src_row + c0, src_row);
#if MK_W == 16
    if (c0 < cols) {
        mk_transpose8(dst + c0 * 16, 16, src + c0, src_row);
        mk_transpose8(dst + c0 * 16 + 8, 16, src + 8 * src_row + c0, src_row);
    }
#endif
}

/* dst (16 rows dst_row apart, cols) = src (cols, 16) in lanes form
 * transposed back; cols % 8 == 0 */
static inline void MK_NAME(mk_from_lanes)(float *dst, ptrdiff_t dst_row, const float *src,
                                          ptrdiff_t cols)
{
    ptrdiff_t c0 = 0;
    for (; c0 + MK_W <= cols; c0 += MK_W)
        for (int x = 0; x < MK_CV; x++)
            MK_TRANSPOSE(dst + x * MK_W * dst_row + c0, dst_row, src + c0 * 16 + x * MK_W, 16);
#if MK_W == 16
    if (c0 < cols) {
        mk_transpose8(dst + c0, dst_row, src + c0 * 16, 16);
        mk_transpose8(dst + 8 * dst_row + c0, dst_row, src + c0 * 16 + 8, 16);
    }
#endif
}

/* lanes [MK_W x, MK_W (x + 1)) of 0, 1, ..., 15 */
static inline MK_IVEC MK_NAME(mk_lane_index)(int x)
{
    static const int32_t index[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return *(const MK_IVEC *)(index + x * MK_W);
}

/* max(0, s) where `seen` is set, 0 elsewhere: negative similarities
 * (rounding in taylor's 1 + cos) clamped to 0 as in linear.c; NaN kept, as
 * x86's max(0, s) keeps its second operand where one is NaN */
static inline __attribute__((always_inline)) MK_VEC MK_NAME(mk_kept)(MK_VEC s, MK_IVEC seen)
{
    return (MK_VEC)((MK_IVEC)s & seen & ~(s < (MK_VEC){0}));
}

/* The lanes of vector x of the chunk's 16 rows that see key j: row t
 * sees the keys j < visible[t]. Read from memory at each use: held in
 * registers, they would take some the products need (AVX2). */
static inline __attribute__((always_inline)) MK_IVEC MK_NAME(mk_seen)(const int *visible, int x,
                                                                      ptrdiff_t j)
{
    return *(const MK_IVEC *)(visible + x * MK_W) > (int)j;
}

/* The chunk: out = phi S + P V and den[t] += sum_j P[t][j], with P =
 * phi psi^T where row t sees the keys j < visible[t] (others 0; negative
 * similarities, rounding in taylor's 1 + cos, clamped to 0 as in linear.c,
 * NaN kept); then S += psi^T V and z += sum_j psi_j. r % 8 == 0, e % 16
 * == 0, V finite (linear.c checks); psi_t (r, 16) and p (16, 16) scratch;
 * `ahead` (or NULL) the next chunk's rows, asked for along the way. */
static inline __attribute__((always_inline)) void MK_NAME(mk_linear_chunk_body)(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t e,
    const ptrdiff_t *visible, float *S, float *z, float *out, ptrdiff_t out_row, float *den,
    float *psi_t, float *p, mk_ahead *ahead)
{
    /* pass 1: P, each row over the 16 keys in lanes, from psi^T */
    MK_NAME(mk_to_lanes)(psi_t, psi, r, r);
#define MK_P(mr)                                                                            \
    do {                                                                                    \
        MK_VEC acc[MK_LANES_MR][MK_CV];                                                     \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                               \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++) acc[i][x] = (MK_VEC){0}; \
        MK_NAME(mk_lanes)(acc, mr, phi + r0 * r, r, 1, psi_t, r, NULL);                     \
        for (int i = 0; i < mr; i++) {                                                      \
            MK_VEC sum = (MK_VEC){0};                                                       \
            for (int x = 0; x < MK_CV; x++) {                                               \
                MK_IVEC seen = MK_NAME(mk_lane_index)(x) < (int)visible[r0 + i];            \
                MK_VEC kept = MK_NAME(mk_kept)(acc[i][x], seen);                            \
                sum += kept;                                                                \
                *(MK_VEC *)(p + (r0 + i) * 16 + x * MK_W) = kept;                           \
            }                                                                               \
            den[r0 + i] += MK_HSUM(sum);                                                    \
        }                                                                                   \
    } while (0)
    MK_LANE_ROWS(16, MK_P)
#undef MK_P
    /* pass 2: the output, from the state before the chunk's keys */
    MK_NAME(mk_chunk_rows)(phi, r, S, e, p, v, v_row, out, out_row, ahead);
    /* pass 3: the chunk's keys into the state */
    MK_NAME(mk_add_keys_body)(psi, r, v, v_row, 16, S, e, ahead);
    MK_NAME(mk_add_rows)(z, psi, r, NULL);
}

/* with r = e = 64 and packed rows (the common head size) the body's
 * loops take constant bounds and strides */
static inline void MK_LIN(mk_linear_chunk_w16, mk_linear_chunk_w8, mk_linear_chunk_n4)(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t e,
    const ptrdiff_t *visible, float *S, float *z, float *out, ptrdiff_t out_row, float *den,
    float *psi_t, float *p, mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64 && out_row == 64)
        MK_NAME(mk_linear_chunk_body)(phi, psi, 64, v, 64, 64, visible, S, z, out, 64, den, psi_t,
                                      p, ahead);
    else
        MK_NAME(mk_linear_chunk_body)(phi, psi, r, v, v_row, e, visible, S, z, out, out_row, den,
                                      psi_t, p, ahead);
}

/* ------------------------------------------------------------------------
 * The backward of one chunk (linear.c, bwd_scan_head), 16 query rows
 * against the 16 keys of their diagonal block. Most of its products read
 * the state with the chunk's rows across the vector lanes (lanes form), so
 * that both products with a transposed state, dout S^T and v dS^T, keep
 * the state in the (r, e) layout that the state updates (mk_add_keys) and
 * linear.c's other paths use. Per row t, with a_t = dout_t / D_t (see
 * linear.c):
 *   pass 1 (rows in order):  U = S dout^T,  b_t = -(dout_t . num_t) / (D_t den_t),
 *                            dphi = a S^T + b z^T + ds psi,  S += psi^T v
 *   pass 2 (reverse):        dv = psi dS + P^T a,  dpsi = v dS^T + dz + ds^T phi,
 *                            dS += phi^T a
 * with P = phi psi^T and ds_tj = a_t . v_j + b_t on the visible pairs. */

/* Where both passes meet: with the rows' features phi_t (r, 16) and the
 * keys' psi, v and the rows' dout_t (e, 16) in lanes form, p_t (16, 16)
 * = P^T (invisible pairs 0, negative similarities kept at 0 as in the
 * forward) and dv_t (16, 16) = (dout v^T)^T; den gets sum_j P_tj in lane t
 * and num_dot sum_j P_tj (dout_t . v_j). */
static inline void MK_NAME(mk_bwd_block)(const float *psi, ptrdiff_t r, const float *v,
                                         ptrdiff_t v_row, ptrdiff_t e, const int *visible,
                                         const float *phi_t,
                                         const float *dout_t, float *p_t, float *dv_t,
                                         MK_VEC den[MK_CV], MK_VEC num_dot[MK_CV],
                                         mk_ahead *ahead)
{
#define MK_BLOCK(mr)                                                                          \
    do {                                                                                      \
        MK_VEC acc[MK_LANES_MR][MK_CV];                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++) acc[i][x] = (MK_VEC){0};   \
        MK_NAME(mk_lanes)(acc, mr, psi + r0 * r, r, 1, phi_t, r, ahead);                      \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++) {                         \
                *(MK_VEC *)(p_t + (r0 + i) * 16 + x * MK_W) =                                 \
                    MK_NAME(mk_kept)(acc[i][x], MK_NAME(mk_seen)(visible, x, r0 + i));         \
                acc[i][x] = (MK_VEC){0};                                                      \
            }                                                                                 \
        MK_NAME(mk_lanes)(acc, mr, v + r0 * v_row, v_row, 1, dout_t, e, ahead);               \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++)                           \
                *(MK_VEC *)(dv_t + (r0 + i) * 16 + x * MK_W) = acc[i][x];                     \
    } while (0)
    MK_LANE_ROWS(16, MK_BLOCK)
#undef MK_BLOCK
    /* the sums after the products, from L1: live across them, they would
     * take registers the blocks need (AVX2) */
    for (int x = 0; x < MK_CV; x++) den[x] = num_dot[x] = (MK_VEC){0};
    for (int j = 0; j < 16; j++)
        for (int x = 0; x < MK_CV; x++) {
            MK_VEC p_j = *(const MK_VEC *)(p_t + j * 16 + x * MK_W);
            den[x] += p_j;
            num_dot[x] += p_j * *(const MK_VEC *)(dv_t + j * 16 + x * MK_W);
        }
}

/* ds_t[j] = a_t . v_j + b_t on the visible pairs, 0 elsewhere, from dv_t */
static inline void MK_NAME(mk_bwd_dscores)(float *ds_t, const float *dv_t, const int *visible,
                                           const MK_VEC inv_den[MK_CV], const MK_VEC b[MK_CV])
{
    for (int j = 0; j < 16; j++)
        for (int x = 0; x < MK_CV; x++) {
            MK_VEC ds = inv_den[x] * *(const MK_VEC *)(dv_t + j * 16 + x * MK_W) + b[x];
            *(MK_VEC *)(ds_t + j * 16 + x * MK_W) =
                (MK_VEC)((MK_IVEC)ds & MK_NAME(mk_seen)(visible, x, j));
        }
}

/* Scratch of the two passes, in floats: phi_t, grad_t (r, 16), dout_t,
 * v_t (e, 16), p_t, dv_t, ds_t, ds (16, 16), a (16, e) */
#ifndef MK_BWD_SCRATCH
#define MK_BWD_SCRATCH(r, e) (32 * (r) + 48 * (e) + 4 * 256)
#endif

/* Pass 1 over the chunk: dphi (16, r), 1 / D_t into inv_den[t] and b_t
 * into row_b[t] (from the clamp eps[t] per row), then the chunk's keys
 * into (S, z). r % 8 == 0, e % 16 == 0, every input finite (linear.c
 * checks); `ahead` (or NULL) the next chunk's rows, asked for along the
 * way. When `kept` is not NULL, the block's P^T and ds_t (what pass 2
 * would compute again) go into its 16 rows (kept_row apart) of 32
 * numbers: row t holds row t of p_t, then row t of ds_t. */
static inline __attribute__((always_inline)) void MK_NAME(mk_linear_bwd_rows_body)(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows, const float *eps,
    float *S, float *z, float *inv_den, float *row_b, float *dphi, float *kept, ptrdiff_t kept_row,
    float *scratch, mk_ahead *ahead)
{
    float *phi_t = scratch, *grad_t = phi_t + 16 * r, *dout_t = grad_t + 16 * r;
    float *p_t = dout_t + 32 * e, *dv_t = p_t + 256, *ds_t = dv_t + 256;
    MK_NAME(mk_to_lanes)(phi_t, phi, r, r);
    MK_NAME(mk_to_lanes)(dout_t, dout, dout_row, e);
    /* U = S dout^T into grad_t; then phi . z and phi . U = dout . (phi S),
     * each sum in 4 parts (r % 8 == 0): one chain of r dependent FMAs
     * would wait 4 r cycles */
#define MK_U(mr)                                                                              \
    do {                                                                                      \
        MK_VEC acc[MK_LANES_MR][MK_CV];                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++) acc[i][x] = (MK_VEC){0};   \
        MK_NAME(mk_lanes)(acc, mr, S + r0 * e, e, 1, dout_t, e, ahead);                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++)                           \
                *(MK_VEC *)(grad_t + (r0 + i) * 16 + x * MK_W) = acc[i][x];                   \
    } while (0)
    MK_LANE_ROWS(r, MK_U)
#undef MK_U
    MK_VEC den_part[4][MK_CV], dot_part[4][MK_CV], den[MK_CV], num_dot[MK_CV];
    MK_VEC block_den[MK_CV], block_dot[MK_CV];
    MK_NAME(mk_bwd_block)(psi, r, v, v_row, e, visible_rows, phi_t, dout_t, p_t, dv_t, block_den,
                          block_dot, ahead);
    /* the sums after the products, from L1 (as mk_bwd_block's) */
    for (int h = 0; h < 4; h++)
        for (int x = 0; x < MK_CV; x++) den_part[h][x] = dot_part[h][x] = (MK_VEC){0};
    for (ptrdiff_t f = 0; f < r; f += 4)
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
#pragma GCC unroll 4
            for (int x = 0; x < MK_CV; x++) {
                MK_VEC phi_f = *(const MK_VEC *)(phi_t + (f + h) * 16 + x * MK_W);
                den_part[h][x] += z[f + h] * phi_f;
                dot_part[h][x] += phi_f * *(const MK_VEC *)(grad_t + (f + h) * 16 + x * MK_W);
            }
    /* D = max(den, eps); a row with den == 0 has no gradient, nor b one
     * where the clamp binds (as linear.c's bwd_row_factors) */
    MK_VEC inv[MK_CV], b[MK_CV];
    for (int x = 0; x < MK_CV; x++) {
        den[x] = (den_part[0][x] + den_part[1][x]) + (den_part[2][x] + den_part[3][x]);
        num_dot[x] = (dot_part[0][x] + dot_part[1][x]) + (dot_part[2][x] + dot_part[3][x]);
        den[x] += block_den[x];
        num_dot[x] += block_dot[x];
        MK_VEC eps_x = *(const MK_VEC *)(eps + x * MK_W);
        MK_IVEC empty = den[x] == (MK_VEC){0}, clamped = den[x] < eps_x;
        MK_VEC clamp = (MK_VEC)(((MK_IVEC)eps_x & clamped) | ((MK_IVEC)den[x] & ~clamped));
        inv[x] = (MK_VEC)((MK_IVEC)(1.0f / clamp) & ~empty);
        b[x] = (MK_VEC)((MK_IVEC)(((MK_VEC){0} - num_dot[x]) * inv[x] / den[x]) &
                        ~(empty | clamped));
        *(MK_VEC *)(inv_den + x * MK_W) = inv[x];
        *(MK_VEC *)(row_b + x * MK_W) = b[x];
    }
    MK_NAME(mk_bwd_dscores)(ds_t, dv_t, visible_rows, inv, b);
    if (kept)
        for (int t = 0; t < 16; t++)
            for (int x = 0; x < MK_CV; x++) {
                *(MK_VEC *)(kept + t * kept_row + x * MK_W) = *(const MK_VEC *)(p_t + t * 16 + x * MK_W);
                *(MK_VEC *)(kept + t * kept_row + 16 + x * MK_W) =
                    *(const MK_VEC *)(ds_t + t * 16 + x * MK_W);
            }
    /* dphi = a S^T + b z^T + ds psi, in lanes form over U */
#define MK_DPHI(mr)                                                                           \
    do {                                                                                      \
        MK_VEC acc[MK_LANES_MR][MK_CV];                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++) acc[i][x] =               \
                z[r0 + i] * b[x] + inv[x] * *(const MK_VEC *)(grad_t + (r0 + i) * 16 + x * MK_W); \
        MK_NAME(mk_lanes)(acc, mr, psi + r0, 1, r, ds_t, 16, ahead);                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++)                           \
                *(MK_VEC *)(grad_t + (r0 + i) * 16 + x * MK_W) = acc[i][x];                   \
    } while (0)
    MK_LANE_ROWS(r, MK_DPHI)
#undef MK_DPHI
    MK_NAME(mk_from_lanes)(dphi, r, grad_t, r);
    MK_NAME(mk_add_keys_body)(psi, r, v, v_row, 16, S, e, ahead);
    MK_NAME(mk_add_rows)(z, psi, r, NULL);
}

/* Pass 2 over the chunk, (dS, dz) holding the gradient that the later
 * rows send to these keys: dv (16 rows dv_row apart), dpsi (16, r), then
 * (dS, dz) += what these rows send to the earlier keys. inv_den, row_b
 * from pass 1; the conditions of pass 1. `kept`: pass 1's P^T and ds_t
 * of the block, or NULL to compute them again. */
static inline __attribute__((always_inline)) void MK_NAME(mk_linear_bwd_keys_body)(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
    const float *inv_den, const float *row_b, float *dS, float *dz, float *dv, ptrdiff_t dv_row,
    float *dpsi, const float *kept, ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
    float *phi_t = scratch, *grad_t = phi_t + 16 * r, *dout_t = grad_t + 16 * r, *v_t = dout_t + 16 * e;
    float *p_t = v_t + 16 * e, *dv_t = p_t + 256, *ds_t = dv_t + 256, *ds = ds_t + 256;
    float *a = ds + 256;
    MK_NAME(mk_to_lanes)(v_t, v, v_row, e);
    if (kept) {
        for (int t = 0; t < 16; t++)
            for (int x = 0; x < MK_CV; x++)
                *(MK_VEC *)(p_t + t * 16 + x * MK_W) = *(const MK_VEC *)(kept + t * kept_row + x * MK_W);
        MK_NAME(mk_to_lanes)(ds, kept + 16, kept_row, 16);
    } else {
        MK_VEC inv[MK_CV], b[MK_CV], unused_den[MK_CV], unused_dot[MK_CV];
        for (int x = 0; x < MK_CV; x++) {
            inv[x] = *(const MK_VEC *)(inv_den + x * MK_W);
            b[x] = *(const MK_VEC *)(row_b + x * MK_W);
        }
        MK_NAME(mk_to_lanes)(phi_t, phi, r, r);
        MK_NAME(mk_to_lanes)(dout_t, dout, dout_row, e);
        MK_NAME(mk_bwd_block)(psi, r, v, v_row, e, visible_rows, phi_t, dout_t, p_t, dv_t,
                              unused_den, unused_dot, ahead);
        MK_NAME(mk_bwd_dscores)(ds_t, dv_t, visible_rows, inv, b);
        MK_NAME(mk_to_lanes)(ds, ds_t, 16, 16);
    }
    for (int t = 0; t < 16; t++) {
        float inv_t = inv_den[t];
        for (ptrdiff_t c = 0; c < e; c += MK_W)
            *(MK_VEC *)(a + t * e + c) = inv_t * *(const MK_VEC *)(dout + t * dout_row + c);
    }
    /* dv = psi dS + P^T a: the forward's output kernel on other operands */
    MK_NAME(mk_chunk_rows)(psi, r, dS, e, p_t, a, e, dv, dv_row, ahead);
    /* dpsi = v dS^T + dz + ds^T phi, in lanes form (the keys across the lanes) */
#define MK_DPSI(mr)                                                                           \
    do {                                                                                      \
        MK_VEC acc[MK_LANES_MR][MK_CV];                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++) acc[i][x] =               \
                dz[r0 + i] - (MK_VEC){0};                                                     \
        MK_NAME(mk_lanes)(acc, mr, dS + r0 * e, e, 1, v_t, e, ahead);                         \
        MK_NAME(mk_lanes)(acc, mr, phi + r0, 1, r, ds, 16, ahead);                            \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _Pragma("GCC unroll 4") for (int x = 0; x < MK_CV; x++)                           \
                *(MK_VEC *)(grad_t + (r0 + i) * 16 + x * MK_W) = acc[i][x];                   \
    } while (0)
    MK_LANE_ROWS(r, MK_DPSI)
#undef MK_DPSI
    MK_NAME(mk_from_lanes)(dpsi, r, grad_t, r);
    MK_NAME(mk_add_keys_body)(phi, r, a, e, 16, dS, e, ahead);
    MK_NAME(mk_add_rows)(dz, phi, r, row_b);
}

/* The two passes, with r = e = 64 and values rows 64 apart (contiguous
 * heads of 64 features) as constants: the lanes loops then address their
 * rows of the state from one register instead of spilling a pointer per
 * row (on AVX-512 a tenth faster: docs/performance.md, the C code's
 * choices). */
static inline void MK_LIN(mk_linear_bwd_rows_w16, mk_linear_bwd_rows_w8, mk_linear_bwd_rows_n4)(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows, const float *eps,
    float *S, float *z, float *inv_den, float *row_b, float *dphi, float *kept, ptrdiff_t kept_row,
    float *scratch, mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64)
        MK_NAME(mk_linear_bwd_rows_body)(phi, psi, 64, v, 64, dout, dout_row, 64, visible_rows,
                                         eps, S, z, inv_den, row_b, dphi, kept, kept_row, scratch,
                                         ahead);
    else
        MK_NAME(mk_linear_bwd_rows_body)(phi, psi, r, v, v_row, dout, dout_row, e, visible_rows,
                                         eps, S, z, inv_den, row_b, dphi, kept, kept_row, scratch,
                                         ahead);
}

static inline void MK_LIN(mk_linear_bwd_keys_w16, mk_linear_bwd_keys_w8, mk_linear_bwd_keys_n4)(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
    const float *inv_den, const float *row_b, float *dS, float *dz, float *dv, ptrdiff_t dv_row,
    float *dpsi, const float *kept, ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64)
        MK_NAME(mk_linear_bwd_keys_body)(phi, psi, 64, v, 64, dout, dout_row, 64, visible_rows,
                                         inv_den, row_b, dS, dz, dv, dv_row, dpsi, kept, kept_row,
                                         scratch, ahead);
    else
        MK_NAME(mk_linear_bwd_keys_body)(phi, psi, r, v, v_row, dout, dout_row, e, visible_rows,
                                         inv_den, row_b, dS, dz, dv, dv_row, dpsi, kept, kept_row,
                                         scratch, ahead);
}

/* the width's parameters (MK_CHUNK_COLUMNS and MK_LIN_NV stay for
 * mk_decode.h: microkernel.h undefines them) */
#undef MK_CV
#undef MK_LANES_MR
#undef MK_AHEAD_EVERY
#undef MK_TRANSPOSE
#undef MK_LIN
#undef MK_IVEC
#undef MK_LANE_ROWS
