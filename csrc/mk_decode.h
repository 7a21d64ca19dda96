/* mk_decode.h - the AVX-512 float32 kernels of single-token decoding
 * (linear.c: deferred_step, decode_group, fused_step), and the elu feature
 * rows they and features.c share. Included by microkernel.h in its AVX-512
 * float32 body (MK_W == 16), after mk_linear.h. */
#if !defined(MK_W) || MK_W != 16
#error "mk_decode.h is included by microkernel.h, in its AVX-512 float32 body"
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
 * docs/performance.md, the C code's choices). Four heads can also take their steps together
 * (mk_decode_group_w16, below), with the same numbers.
 * S (r, e) contiguous; r % 16 == 0, e % 16 == 0, held < MK_DECODE_HELD. */
#define MK_DECODE_HELD 16

/* the step's key joins z and the held keys (as key `held`); den = phi . z */
static inline void mk_decode_take_w16(const float *phi, const float *psi, ptrdiff_t r,
                                      const float *v, ptrdiff_t e, float *z, float *keys,
                                      float *values, ptrdiff_t held, float *den)
{
    __m512 dot = _mm512_setzero_ps();
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 16) {
        __m512 psi_f = _mm512_loadu_ps(psi + f0), z_f = _mm512_loadu_ps(z + f0);
        _mm512_storeu_ps(keys + held * r + f0, psi_f);
        z_f = _mm512_add_ps(z_f, psi_f);
        _mm512_storeu_ps(z + f0, z_f);
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(phi + f0), z_f, dot);
    }
    *den = _mm512_reduce_add_ps(dot);
    for (ptrdiff_t c0 = 0; c0 < e; c0 += 16)
        _mm512_storeu_ps(values + held * e + c0, _mm512_loadu_ps(v + c0));
}

/* weights[t] = phi . keys_t over the `held` held keys */
static inline void mk_decode_weights_w16(const float *phi, ptrdiff_t r, const float *keys,
                                         ptrdiff_t held, float *weights)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        __m512 sum = _mm512_setzero_ps();
        for (ptrdiff_t f0 = 0; f0 < r; f0 += 16)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(phi + f0), _mm512_loadu_ps(keys + t * r + f0), sum);
        weights[t] = _mm512_reduce_add_ps(sum);
    }
}

/* row[0, nv) += sum_t weights[t] values_t (values positioned at the row's
 * first column, rows e apart) */
static inline __attribute__((always_inline)) void mk_decode_held_terms_w16(
    int nv, __m512 row[4], const float *weights, const float *values, ptrdiff_t e, ptrdiff_t held)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        __m512 weight = _mm512_set1_ps(weights[t]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++)
            row[h] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(values + t * e + h * 16), row[h]);
    }
}

/* out[0, 16 nv) = phi S + sum_t weights[t] values_t over S's columns
 * [0, 16 nv) (S and values positioned there, rows e apart) */
static inline __attribute__((always_inline)) void mk_decode_read_w16(
    int nv, const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *weights,
    const float *values, ptrdiff_t held, float *out)
{
    __m512 row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f++) {
        __m512 phi_f = _mm512_set1_ps(phi[f]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++)
            row[h] = _mm512_fmadd_ps(phi_f, _mm512_loadu_ps(S + f * e + h * 16), row[h]);
    }
    mk_decode_held_terms_w16(nv, row, weights, values, e, held);
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + h * 16, row[h]);
}

/* rows [f0, f0 + mr) of S[:, 0, 16 nv) += keys^T values over `count`
 * keys, in key order (what mk_add_keys_w16 computes), and row += phi S
 * over those rows, from the rows just written, still in registers */
static inline __attribute__((always_inline)) void mk_decode_turn_rows_w16(
    int mr, int nv, ptrdiff_t f0, const float *phi, const float *keys, ptrdiff_t r,
    const float *values, ptrdiff_t e, ptrdiff_t count, float *S, __m512 row[4])
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
            row[h] = _mm512_fmadd_ps(phi_f, acc[i][h], row[h]);
        }
    }
}

/* A head's turn: all of S's columns [0, 16 nv) take the held keys, 4 rows
 * at a time, and out[0, 16 nv) = phi S from the new S */
static inline __attribute__((always_inline)) void mk_decode_flush_w16(
    int nv, const float *phi, const float *keys, ptrdiff_t r, const float *values, ptrdiff_t e,
    ptrdiff_t count, float *S, float *out)
{
    __m512 row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = _mm512_setzero_ps();
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 4)
        mk_decode_turn_rows_w16(4, nv, f0, phi, keys, r, values, e, count, S, row);
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + h * 16, row[h]);
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

/* The step */
static inline void mk_decode_step_w16(const float *phi, const float *psi, ptrdiff_t r,
                                      const float *v, ptrdiff_t e, float *S, float *z,
                                      float *keys, float *values, ptrdiff_t held, int adds,
                                      float *out, float *den)
{
    mk_decode_take_w16(phi, psi, r, v, e, z, keys, values, held, den);
    held++;
    if (adds) {
#define MK_FLUSH(nv) mk_decode_flush_w16(nv, phi, keys, r, values + c0, e, held, S + c0, out + c0)
        MK_CHUNK_COLUMNS(e, MK_FLUSH)
#undef MK_FLUSH
        return;
    }
    float weights[MK_DECODE_HELD];
    mk_decode_weights_w16(phi, r, keys, held, weights);
#define MK_READ(nv) mk_decode_read_w16(nv, phi, r, S + c0, e, weights, values + c0, held, out + c0)
    MK_CHUNK_COLUMNS(e, MK_READ)
#undef MK_READ
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
static inline __attribute__((always_inline)) void mk_decode_store_w16(int nv, const __m512 row[4],
                                                                      float den, float eps,
                                                                      float *out)
{
    __m512 scale = _mm512_set1_ps(1 / (den < eps ? eps : den));
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++)
        _mm512_storeu_ps(out + h * 16,
                         den == 0 ? _mm512_setzero_ps() : _mm512_mul_ps(row[h], scale));
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
    __m512 row_a[4], row_b[4], row_c[4], row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row_a[h] = row_b[h] = row_c[h] = row[h] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f += 2) {
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            __m512 phi_af = _mm512_set1_ps(phi_a[f + i]), phi_bf = _mm512_set1_ps(phi_b[f + i]);
            __m512 phi_cf = _mm512_set1_ps(phi_c[f + i]);
            ptrdiff_t at = (f + i) * e;
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) {
                row_a[h] = _mm512_fmadd_ps(phi_af, _mm512_loadu_ps(S_a + at + h * 16), row_a[h]);
                row_b[h] = _mm512_fmadd_ps(phi_bf, _mm512_loadu_ps(S_b + at + h * 16), row_b[h]);
                row_c[h] = _mm512_fmadd_ps(phi_cf, _mm512_loadu_ps(S_c + at + h * 16), row_c[h]);
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

/* ------------------------------------------------------------------------
 * One RNN step of one head from a given state (linear.c, fused_step: the
 * functional single-token call): S = S0 + psi v^T, z = z0 + psi, and the
 * query's row read from the state just written,
 *   out = phi S,  den = phi . z
 * in one pass over S0 and S: each row of S is written and multiplied into
 * the row in registers, one accumulator chain per vector of columns as in
 * mk_decode_read_w16 (two, even and odd rows, were slower:
 * docs/performance.md, the C code's choices). S's entries are the
 * general path's (state_pass) bit for bit: one fused multiply-add each.
 * S0 rows S0_row apart (0: one zero row serves all), S (r, e) contiguous
 * and may be S0 itself (each entry is read before it is written);
 * r % 16 == 0, e % 16 == 0. */

/* S[:, 0, 16 nv) and out[0, 16 nv) (S0, S, v positioned there) */
static inline __attribute__((always_inline)) void mk_step_rows_w16(
    int nv, const float *phi, const float *psi, ptrdiff_t r, const float *v, const float *S0,
    ptrdiff_t S0_row, ptrdiff_t e, float *S, float *out)
{
    __m512 row[4], value[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) {
        value[h] = _mm512_loadu_ps(v + h * 16);
        row[h] = _mm512_setzero_ps();
    }
    for (ptrdiff_t f = 0; f < r; f++) {
        __m512 key_f = _mm512_set1_ps(psi[f]), phi_f = _mm512_set1_ps(phi[f]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) {
            __m512 s_f = _mm512_fmadd_ps(key_f, value[h], _mm512_loadu_ps(S0 + f * S0_row + h * 16));
            _mm512_storeu_ps(S + f * e + h * 16, s_f);
            row[h] = _mm512_fmadd_ps(phi_f, s_f, row[h]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + h * 16, row[h]);
}

/* The step */
static inline void mk_rnn_step_w16(const float *phi, const float *psi, ptrdiff_t r, const float *v,
                                   const float *S0, ptrdiff_t S0_row, const float *z0, ptrdiff_t e,
                                   float *S, float *z, float *out, float *den)
{
    __m512 dot = _mm512_setzero_ps();
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 16) {
        __m512 z_f = _mm512_add_ps(_mm512_loadu_ps(z0 + f0), _mm512_loadu_ps(psi + f0));
        _mm512_storeu_ps(z + f0, z_f);
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(phi + f0), z_f, dot);
    }
    *den = _mm512_reduce_add_ps(dot);
#define MK_STEP(nv) mk_step_rows_w16(nv, phi, psi, r, v + c0, S0 + c0, S0_row, e, S + c0, out + c0)
    MK_CHUNK_COLUMNS(e, MK_STEP)
#undef MK_STEP
}
