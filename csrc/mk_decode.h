/* mk_decode.h - the kernels of single-token decoding (linear.c:
 * deferred_step, decode_group, fused_step), float32, at every vector
 * width: included by microkernel.h in each of its bodies (MK_W, MK_REAL,
 * MK_VEC, MK_TYPED defined), after mk_linear.h in the AVX-512 float32 one,
 * so that one source gives the AVX-512, AVX2+FMA and NEON steps. The
 * AVX-512 body also has a head's turn in blocks of 4 rows of S
 * (mk_linear.h's mk_rank_w16), four heads' steps at once
 * (mk_decode_group_w16) and the elu feature rows that it and features.c
 * share. */
#ifndef MK_W
#error "mk_decode.h is included by microkernel.h, in each of its bodies"
#endif

/* ------------------------------------------------------------------------
 * One single-token decoding step of one head (linear.c, deferred_step).
 * The step's key (features psi (r), value v (e)) joins z at once and the
 * head's held keys: keys (capacity, r) and values (capacity, e), whose
 * first `held` rows are the keys since the head's last turn. At its turn
 * (adds) every held key goes into S in the same pass that reads the
 * query's row from S; otherwise S is only read, and the held keys add
 * their terms to the row:
 *   out = phi S + sum_t (phi . keys_t) values_t,  den = phi . z
 * A step is one pass over S, which streams from L2: the row is built in
 * registers, one accumulator per vector of columns, rows in order: the
 * loads set the pace, not the multiply-adds' latency (with two sets of
 * accumulators, even and odd rows, a loop of reads was slower:
 * docs/performance.md, the C code's choices). On AVX-512 four heads can
 * also take their steps together (mk_decode_group_w16, below), with the
 * same numbers. Every entry of S is the general path's (linear.c's
 * add_held, state_pass) bit for bit: the held keys' terms added in key
 * order, one fused multiply-add each.
 * S (r, e) contiguous; r and e whole vectors, held < MK_DECODE_HELD.
 * A number x is put in every lane as x - 0, which is x for every x (x + 0
 * would turn -0 into +0). */
#ifndef MK_DECODE_HELD
#define MK_DECODE_HELD 16
#endif

/* the step's key joins z and the held keys (as key `held`); den = phi . z */
static inline void MK_TYPED(mk_decode_take_w16, mk_decode_take_d8, mk_decode_take_w8,
                            mk_decode_take_d4, mk_decode_take_n4, mk_decode_take_nd2)(
    const MK_REAL *phi, const MK_REAL *psi, ptrdiff_t r, const MK_REAL *v, ptrdiff_t e,
    MK_REAL *z, MK_REAL *keys, MK_REAL *values, ptrdiff_t held, MK_REAL *den)
{
    MK_VEC dot = {0};
    for (ptrdiff_t f0 = 0; f0 < r; f0 += MK_W) {
        MK_VEC psi_f = *(const MK_VEC *)(psi + f0);
        MK_VEC z_f = *(const MK_VEC *)(z + f0) + psi_f;
        *(MK_VEC *)(keys + held * r + f0) = psi_f;
        *(MK_VEC *)(z + f0) = z_f;
        dot += *(const MK_VEC *)(phi + f0) * z_f;
    }
    *den = MK_HSUM(dot);
    for (ptrdiff_t c0 = 0; c0 < e; c0 += MK_W)
        *(MK_VEC *)(values + held * e + c0) = *(const MK_VEC *)(v + c0);
}

/* weights[t] = phi . keys_t over the `held` held keys */
static inline void MK_TYPED(mk_decode_weights_w16, mk_decode_weights_d8, mk_decode_weights_w8,
                            mk_decode_weights_d4, mk_decode_weights_n4, mk_decode_weights_nd2)(
    const MK_REAL *phi, ptrdiff_t r, const MK_REAL *keys, ptrdiff_t held, MK_REAL *weights)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        MK_VEC sum = {0};
        for (ptrdiff_t f0 = 0; f0 < r; f0 += MK_W)
            sum += *(const MK_VEC *)(phi + f0) * *(const MK_VEC *)(keys + t * r + f0);
        weights[t] = MK_HSUM(sum);
    }
}

/* row[0, nv) += sum_t weights[t] values_t (values positioned at the row's
 * first column, rows e apart) */
static inline __attribute__((always_inline)) void MK_TYPED(
    mk_decode_held_terms_w16, mk_decode_held_terms_d8, mk_decode_held_terms_w8,
    mk_decode_held_terms_d4, mk_decode_held_terms_n4, mk_decode_held_terms_nd2)(
    int nv, MK_VEC row[4], const MK_REAL *weights, const MK_REAL *values, ptrdiff_t e,
    ptrdiff_t held)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        MK_VEC weight = weights[t] - (MK_VEC){0};
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++)
            row[h] += weight * *(const MK_VEC *)(values + t * e + h * MK_W);
    }
}

/* out[0, W nv) = phi S + sum_t weights[t] values_t over S's columns
 * [0, W nv) (S and values positioned there, rows e apart) */
static inline __attribute__((always_inline)) void MK_TYPED(
    mk_decode_read_w16, mk_decode_read_d8, mk_decode_read_w8, mk_decode_read_d4, mk_decode_read_n4,
    mk_decode_read_nd2)(
    int nv, const MK_REAL *phi, ptrdiff_t r, const MK_REAL *S, ptrdiff_t e,
    const MK_REAL *weights, const MK_REAL *values, ptrdiff_t held, MK_REAL *out)
{
    MK_VEC row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = (MK_VEC){0};
    for (ptrdiff_t f = 0; f < r; f++) {
        MK_VEC phi_f = phi[f] - (MK_VEC){0};
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) row[h] += phi_f * *(const MK_VEC *)(S + f * e + h * MK_W);
    }
    MK_NAME(mk_decode_held_terms)(nv, row, weights, values, e, held);
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) *(MK_VEC *)(out + h * MK_W) = row[h];
}

/* A head's turn, one row of S at a time: the row of S[:, 0, W nv) takes
 * the `count` held keys in key order, and out[0, W nv) = phi S from the
 * rows just written, still in registers (AVX-512 takes 4 rows at a time,
 * mk_decode_flush_w16) */
static inline __attribute__((always_inline)) void MK_NAME(mk_decode_turn)(
    int nv, const MK_REAL *phi, const MK_REAL *keys, ptrdiff_t r, const MK_REAL *values,
    ptrdiff_t e, ptrdiff_t count, MK_REAL *S, MK_REAL *out)
{
    MK_VEC row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = (MK_VEC){0};
    for (ptrdiff_t f = 0; f < r; f++) {
        MK_VEC acc[4];
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[h] = *(const MK_VEC *)(S + f * e + h * MK_W);
        for (ptrdiff_t t = 0; t < count; t++) {
            MK_VEC key = keys[t * r + f] - (MK_VEC){0};
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++)
                acc[h] += key * *(const MK_VEC *)(values + t * e + h * MK_W);
        }
        MK_VEC phi_f = phi[f] - (MK_VEC){0};
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) {
            *(MK_VEC *)(S + f * e + h * MK_W) = acc[h];
            row[h] += phi_f * acc[h];
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) *(MK_VEC *)(out + h * MK_W) = row[h];
}

#if MK_W == 16
/* rows [f0, f0 + mr) of S[:, 0, 16 nv) += keys^T values over `count`
 * keys, in key order (what mk_add_keys_w16 computes), and row += phi S
 * over those rows, from the rows just written, still in registers */
static inline __attribute__((always_inline)) void mk_decode_turn_rows_w16(
    int mr, int nv, ptrdiff_t f0, const float *phi, const float *keys, ptrdiff_t r,
    const float *values, ptrdiff_t e, ptrdiff_t count, float *S, MK_VEC row[4])
{
    __m512 acc[6][4];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = _mm512_loadu_ps(S + (f0 + i) * e + h * 16);
    mk_rank_w16(acc, mr, nv, keys + f0, 1, r, values, e, count, NULL);
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        __m512 phi_f = _mm512_set1_ps(phi[f0 + i]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) {
            _mm512_storeu_ps(S + (f0 + i) * e + h * 16, acc[i][h]);
            row[h] = (MK_VEC)_mm512_fmadd_ps(phi_f, acc[i][h], (__m512)row[h]);
        }
    }
}

/* A head's turn: all of S's columns [0, 16 nv) take the held keys, 4 rows
 * at a time, and out[0, 16 nv) = phi S from the new S */
static inline __attribute__((always_inline)) void mk_decode_flush_w16(
    int nv, const float *phi, const float *keys, ptrdiff_t r, const float *values, ptrdiff_t e,
    ptrdiff_t count, float *S, float *out)
{
    MK_VEC row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = (MK_VEC){0};
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 4)
        mk_decode_turn_rows_w16(4, nv, f0, phi, keys, r, values, e, count, S, row);
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) *(MK_VEC *)(out + h * 16) = row[h];
}

/* elu(x) + 1 on AVX-512, the algorithm of features.c's elu_row (vec_real.h's
 * exp): x + 1 above 0; below, e^x = 2^n e^r with n = round(x log2 e),
 * r = x - n ln2 (Cody-Waite), e^r by its Taylor series to r^7; 0 below
 * -87; NaN stays NaN. scalef puts 2^n on e^r in one instruction, with no
 * clamp of x and no exponent-bit arithmetic: 20 instructions a vector
 * against the compiled loop's 27. On AVX-512 every float32 elu feature
 * comes from here (attnx_features and the decoding kernel), so the paths
 * agree bit for bit. */
static inline __attribute__((always_inline)) __m512 mk_elu1_w16(__m512 x)
{
    const __m512 magic = _mm512_set1_ps(12582912.0f), one = _mm512_set1_ps(1.0f);
    __m512 nf = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896340736f), magic),
                              magic);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
    __m512 below = _mm512_maskz_scalef_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ),
                                          p, nf);
    return _mm512_mask_add_ps(below, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), x, one);
}

/* f = elu(x) + 1 over a row of d numbers (features.c, attnx_features) */
static inline void mk_elu_row_w16(const float *x, ptrdiff_t d, float *f)
{
    ptrdiff_t c = 0;
    for (; c + 16 <= d; c += 16) _mm512_storeu_ps(f + c, mk_elu1_w16(_mm512_loadu_ps(x + c)));
    if (c < d) {
        __mmask16 tail = (__mmask16)((1u << (d - c)) - 1);
        _mm512_mask_storeu_ps(f + c, tail, mk_elu1_w16(_mm512_maskz_loadu_ps(tail, x + c)));
    }
}

/* phi = elu(q) + 1, psi = elu(k) + 1 for one query and one key row of d
 * features, d % 16 == 0: both rows' vectors interleaved, the exponentials'
 * chains of dependent operations overlapping (faster than two calls of
 * mk_elu_row_w16: docs/performance.md, the C code's choices) */
static inline void mk_elu_rows_w16(const float *q, const float *k, ptrdiff_t d, float *phi,
                                   float *psi)
{
    for (ptrdiff_t c = 0; c < d; c += 16) {
        _mm512_storeu_ps(phi + c, mk_elu1_w16(_mm512_loadu_ps(q + c)));
        _mm512_storeu_ps(psi + c, mk_elu1_w16(_mm512_loadu_ps(k + c)));
    }
}

/* Four heads' steps in one pass over their states, one of them at its
 * turn. Alone, a read streams S from L2 with the multiply-add units half
 * idle, and a turn keeps them busy (a multiply-add per held key and S
 * element) while L2 waits; side by side, the turn's arithmetic runs under
 * the reads' loads. The turn's head goes through S two rows at a time
 * (mk_decode_turn_rows_w16, as mk_decode_flush_w16 four), and the others
 * read as mk_decode_read_w16 does: S, z and the rows are those of
 * four single steps, bit for bit. The rows leave divided by their
 * denominators, as linear.c's finish_rows divides them (1 / max(den, eps),
 * zeros where den == 0), in registers: faster than finish_rows after the
 * group (docs/performance.md, the C code's choices).
 * Each head's key must have joined its held keys (mk_decode_take_w16). */
typedef struct {
    const float *phi;              /* (r) */
    float *S;                      /* (r, e) contiguous */
    const float *keys, *values;    /* the held keys, the step's own among them */
    ptrdiff_t held;
    float den;                     /* phi . z */
    float *out;                    /* (e) */
} mk_decode_head;

/* out[0, 16 nv) = row / max(den, eps), or zeros where den == 0 */
static inline __attribute__((always_inline)) void mk_decode_store_w16(int nv, const MK_VEC row[4],
                                                                      float den, float eps,
                                                                      float *out)
{
    __m512 scale = _mm512_set1_ps(1 / (den < eps ? eps : den));
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++)
        _mm512_storeu_ps(out + h * 16,
                         den == 0 ? _mm512_setzero_ps() : _mm512_mul_ps((__m512)row[h], scale));
}

/* columns [c0, c0 + 16 nv) of the four heads' rows: turn the head at its
 * turn, readers the other three, weights their held keys' weights */
static inline __attribute__((always_inline)) void mk_decode_group_cols_w16(
    int nv, const mk_decode_head *turn, const mk_decode_head *const readers[3],
    const float (*weights)[MK_DECODE_HELD], ptrdiff_t r, ptrdiff_t e, float eps, ptrdiff_t c0)
{
    /* what the loop reads, in locals: its stores (may_alias) would make it
     * load the structs' fields again at every row */
    const float *S_a = readers[0]->S + c0, *S_b = readers[1]->S + c0, *S_c = readers[2]->S + c0;
    const float *phi_a = readers[0]->phi, *phi_b = readers[1]->phi, *phi_c = readers[2]->phi;
    const float *phi = turn->phi, *keys = turn->keys, *values = turn->values + c0;
    float *S = turn->S + c0;
    const ptrdiff_t held = turn->held;
    MK_VEC row_a[4], row_b[4], row_c[4], row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row_a[h] = row_b[h] = row_c[h] = row[h] = (MK_VEC){0};
    for (ptrdiff_t f = 0; f < r; f += 2) {
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            MK_VEC phi_af = phi_a[f + i] - (MK_VEC){0}, phi_bf = phi_b[f + i] - (MK_VEC){0};
            MK_VEC phi_cf = phi_c[f + i] - (MK_VEC){0};
            ptrdiff_t at = (f + i) * e;
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) {
                row_a[h] += phi_af * *(const MK_VEC *)(S_a + at + h * 16);
                row_b[h] += phi_bf * *(const MK_VEC *)(S_b + at + h * 16);
                row_c[h] += phi_cf * *(const MK_VEC *)(S_c + at + h * 16);
            }
        }
        mk_decode_turn_rows_w16(2, nv, f, phi, keys, r, values, e, held, S, row);
    }
    mk_decode_store_w16(nv, row, turn->den, eps, turn->out + c0);
    mk_decode_held_terms_w16(nv, row_a, weights[0], readers[0]->values + c0, e, readers[0]->held);
    mk_decode_store_w16(nv, row_a, readers[0]->den, eps, readers[0]->out + c0);
    mk_decode_held_terms_w16(nv, row_b, weights[1], readers[1]->values + c0, e, readers[1]->held);
    mk_decode_store_w16(nv, row_b, readers[1]->den, eps, readers[1]->out + c0);
    mk_decode_held_terms_w16(nv, row_c, weights[2], readers[2]->values + c0, e, readers[2]->held);
    mk_decode_store_w16(nv, row_c, readers[2]->den, eps, readers[2]->out + c0);
}

/* heads[turn] takes its turn; r % 2 == 0 */
static inline __attribute__((always_inline)) void mk_decode_group_body_w16(
    const mk_decode_head heads[4], int turn, ptrdiff_t r, ptrdiff_t e, float eps)
{
    const mk_decode_head *readers[3];
    float weights[3][MK_DECODE_HELD];
    for (int j = 0, i = 0; j < 4; j++) {
        if (j == turn) continue;
        readers[i] = &heads[j];
        mk_decode_weights_w16(heads[j].phi, r, heads[j].keys, heads[j].held, weights[i]);
        i++;
    }
#define MK_GROUP(nv) mk_decode_group_cols_w16(nv, &heads[turn], readers, weights, r, e, eps, c0)
    MK_CHUNK_COLUMNS(e, MK_GROUP)
#undef MK_GROUP
}

/* with r = e = 64 (the common head size) the loops take constant bounds
 * and strides, which leaves them their pointers in registers (a tenth
 * faster: docs/performance.md, the C code's choices) */
static inline void mk_decode_group_w16(const mk_decode_head heads[4], int turn, ptrdiff_t r,
                                       ptrdiff_t e, float eps)
{
    if (r == 64 && e == 64) mk_decode_group_body_w16(heads, turn, 64, 64, eps);
    else mk_decode_group_body_w16(heads, turn, r, e, eps);
}

#endif

/* The step */
static inline void MK_TYPED(mk_decode_step_w16, mk_decode_step_d8, mk_decode_step_w8,
                            mk_decode_step_d4, mk_decode_step_n4, mk_decode_step_nd2)(
    const MK_REAL *phi, const MK_REAL *psi, ptrdiff_t r, const MK_REAL *v, ptrdiff_t e,
    MK_REAL *S, MK_REAL *z, MK_REAL *keys, MK_REAL *values, ptrdiff_t held, int adds,
    MK_REAL *out, MK_REAL *den)
{
    MK_NAME(mk_decode_take)(phi, psi, r, v, e, z, keys, values, held, den);
    held++;
    if (adds) {
#if MK_W == 16
#define MK_FLUSH(nv) mk_decode_flush_w16(nv, phi, keys, r, values + c0, e, held, S + c0, out + c0)
#else
#define MK_FLUSH(nv) \
    MK_NAME(mk_decode_turn)(nv, phi, keys, r, values + c0, e, held, S + c0, out + c0)
#endif
        MK_COLUMNS_BY4(e, MK_FLUSH)
#undef MK_FLUSH
        return;
    }
    MK_REAL weights[MK_DECODE_HELD];
    MK_NAME(mk_decode_weights)(phi, r, keys, held, weights);
#define MK_READ(nv) \
    MK_NAME(mk_decode_read)(nv, phi, r, S + c0, e, weights, values + c0, held, out + c0)
    MK_COLUMNS_BY4(e, MK_READ)
#undef MK_READ
}

/* ------------------------------------------------------------------------
 * One RNN step of one head from a given state (linear.c, fused_step: the
 * functional single-token call): S = S0 + psi v^T, z = z0 + psi, and the
 * query's row read from the state just written,
 *   out = phi S,  den = phi . z
 * in one pass over S0 and S: each row of S is written and multiplied into
 * the row in registers, one accumulator chain per vector of columns as in
 * mk_decode_read (two, even and odd rows, were slower:
 * docs/performance.md, the C code's choices). S's entries are the
 * general path's (state_pass) bit for bit: one fused multiply-add each.
 * S0 rows S0_row apart (0: one zero row serves all), S (r, e) contiguous
 * and may be S0 itself (each entry is read before it is written);
 * r and e whole vectors. */

/* S[:, 0, W nv) and out[0, W nv) (S0, S, v positioned there) */
static inline __attribute__((always_inline)) void MK_NAME(mk_step_rows)(
    int nv, const MK_REAL *phi, const MK_REAL *psi, ptrdiff_t r, const MK_REAL *v,
    const MK_REAL *S0, ptrdiff_t S0_row, ptrdiff_t e, MK_REAL *S, MK_REAL *out)
{
    MK_VEC row[4], value[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) {
        value[h] = *(const MK_VEC *)(v + h * MK_W);
        row[h] = (MK_VEC){0};
    }
    for (ptrdiff_t f = 0; f < r; f++) {
        MK_VEC key_f = psi[f] - (MK_VEC){0}, phi_f = phi[f] - (MK_VEC){0};
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) {
            MK_VEC s_f = key_f * value[h] + *(const MK_VEC *)(S0 + f * S0_row + h * MK_W);
            *(MK_VEC *)(S + f * e + h * MK_W) = s_f;
            row[h] += phi_f * s_f;
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) *(MK_VEC *)(out + h * MK_W) = row[h];
}

/* The step */
static inline void MK_TYPED(mk_rnn_step_w16, mk_rnn_step_d8, mk_rnn_step_w8, mk_rnn_step_d4,
                            mk_rnn_step_n4, mk_rnn_step_nd2)(
    const MK_REAL *phi, const MK_REAL *psi, ptrdiff_t r, const MK_REAL *v, const MK_REAL *S0,
    ptrdiff_t S0_row, const MK_REAL *z0, ptrdiff_t e, MK_REAL *S, MK_REAL *z, MK_REAL *out,
    MK_REAL *den)
{
    MK_VEC dot = {0};
    for (ptrdiff_t f0 = 0; f0 < r; f0 += MK_W) {
        MK_VEC z_f = *(const MK_VEC *)(z0 + f0) + *(const MK_VEC *)(psi + f0);
        *(MK_VEC *)(z + f0) = z_f;
        dot += *(const MK_VEC *)(phi + f0) * z_f;
    }
    *den = MK_HSUM(dot);
#define MK_STEP(nv) \
    MK_NAME(mk_step_rows)(nv, phi, psi, r, v + c0, S0 + c0, S0_row, e, S + c0, out + c0)
    MK_COLUMNS_BY4(e, MK_STEP)
#undef MK_STEP
}

