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

enum { ATTNX_OK = 0, ATTNX_ENOMEM = 1, ATTNX_EINVAL = 2, ATTNX_EINTR = 3 };

/* A call the user may interrupt (Ctrl-C). Kernels ask attnx_interrupted
 * between work items (query tiles, block pairs); the calling thread (the
 * one that passes calling_thread = 1) polls at most every 20 ms, through
 * poll, which the binding gives (it takes the GIL briefly and runs Python's
 * signal handlers); once poll says stop, every thread sees it at its next
 * item and the kernel returns ATTNX_EINTR. A NULL interrupt, or poll NULL
 * (a call from another Python thread, where signals are not handled),
 * never stops. */
typedef struct {
    int (*poll)(void *context);   /* non-zero: stop */
    void *context;
    volatile int stopped;
    double next_poll;             /* seconds on the monotonic clock */
} attnx_interrupt;

int attnx_interrupted(attnx_interrupt *interrupt, int calling_thread);

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
    double dropout_p;                  /* in [0, 1): weights dropped (philox.h) and the
                                          kept ones scaled by 1 / (1 - dropout_p) */
    uint64_t seed;                     /* of the dropout mask */
    attnx_interrupt *interrupt;        /* or NULL */
    /* 1: the caller's tensors are bfloat16 (q, k, v, dout hold bfloat16
     * values) and it asks for bfloat16 arithmetic as PyTorch's CPU flash
     * attention does it: the probabilities (and in the backward,
     * softmax_backward.c, their gradients) rounded to bfloat16 and every
     * product on the bfloat16 dot products, float32 sums (float32 kernels
     * with those products only: dispatch.h's attnx_kernels_bf16_dot; in
     * the forward the AVX-512 micro-kernels, softmax_mk.c, and AMX's
     * one-plane products, softmax_amx.c, where the values are bfloat16
     * values); 0: float32 accuracy */
    int bf16_products;
    /* 0: k and v hold numbers of the call's type; ATTNX_BF16 or ATTNX_F16
     * (convert.h's attnx_half_format): they hold half-precision bits
     * (uint16_t, with k_row, v_row and their offsets counting those),
     * widened as the decoding kernels load them, or, for bfloat16 with
     * bf16_products on the AVX-512 micro-kernels, paired straight from
     * their bits (softmax_mk_reads_half_kv): float32 calls those paths
     * take only; others return ATTNX_EINVAL. The backward
     * (softmax_backward.c) widens them a key block at a time: float32
     * softmax calls; gaussian ones return ATTNX_EINVAL */
    int kv_half;
} attnx_softmax_args;

int attnx_softmax_fwd_f32(const attnx_softmax_args *args);
int attnx_softmax_fwd_f64(const attnx_softmax_args *args);

/* Its gradient (softmax_backward.c): dq, dk, dv (and dbias when not NULL)
 * of sum(dout * out), with the forward's operands, options, out and lse
 * in fwd. Every gradient operand is per head (no broadcast axes): dq (n, d),
 * dk (m, d), dv (m, e) with row strides, dbias (n, m) rows dbias_row apart.
 * The caller reduces a broadcast input's gradient over its heads.
 * fwd.offsets has ATTNX_SMB_NOPS columns: the forward's, then these. */
enum {
    ATTNX_SMB_DOUT = ATTNX_SM_NOPS, ATTNX_SMB_DQ, ATTNX_SMB_DK, ATTNX_SMB_DV, ATTNX_SMB_DBIAS,
    ATTNX_SMB_NOPS
};

typedef struct {
    attnx_softmax_args fwd;            /* out and lse required */
    const void *dout;                  /* (n, e) per head */
    void *dq, *dk, *dv, *dbias;        /* dbias may be NULL */
    ptrdiff_t dout_row, dq_row, dk_row, dv_row, dbias_row;  /* row strides, elements */
} attnx_softmax_bwd_args;

int attnx_softmax_bwd_f32(const attnx_softmax_bwd_args *args);
int attnx_softmax_bwd_f64(const attnx_softmax_bwd_args *args);
/* the side of the backward's square query and key blocks: 128, or 64 where
 * a core's L2 is smaller than 1 MiB (softmax_backward.c); set_block(64 or
 * 128) holds it there, set_block(0) chooses by the cache again (for tests
 * and measurements), and returns what was held before (0: the cache chose) */
ptrdiff_t attnx_softmax_bwd_block(void);
ptrdiff_t attnx_softmax_bwd_set_block(ptrdiff_t side);

/* ------------------------------------------------------------------------
 * Kernelised (linear) attention over non-negative features (linear.c).
 *   out_i = phi(q_i) S / max(phi(q_i) . z, eps),
 *   S = S0 + sum_j psi(k_j) v_j^T (r, e),  z = z0 + sum_j psi(k_j) (r,)
 * over the keys visible to query i (band, key_mask, mask); a row whose
 * denominator is exactly 0 is zero. S0, z0: a carried (streaming) state.
 */

/* Feature maps (features.c): phi for queries, psi for keys. */
enum {
    ATTNX_FM_ELU,        /* elu(x) + 1 */
    ATTNX_FM_RELU,       /* max(x, 0) */
    ATTNX_FM_SOFTMAX,    /* softmax over the feature axis */
    ATTNX_FM_TAYLOR,     /* [1, x / |x|], r = d + 1 */
    ATTNX_FM_FOCUSED,    /* FLatten f_p(relu(x)) */
    ATTNX_FM_FAVOR,      /* Performer FAVOR+, r = rows of the projection */
    ATTNX_FM_IDENTITY,   /* the inputs are the features */
    ATTNX_FM_COSFORMER,  /* [relu(x) sin(theta_t), relu(x) cos(theta_t)], r = 2 d */
    ATTNX_FM_EFFICIENT,  /* Shen et al.: softmax over features (queries), over keys (keys) */
};

typedef struct {
    int kind;                 /* ATTNX_FM_* */
    ptrdiff_t d, r;           /* input and feature sizes */
    double power;             /* focused: p > 0 */
    const void *projection;   /* favor: W (r, d), C order, compute dtype */
    double period;            /* cosformer: M, theta_t = pi/2 * t / M */
    ptrdiff_t first_position; /* 0-based position of the first query and key (streaming offset) */
} attnx_feature_map;

/* Features of `rows` rows of x (row stride x_row) at 0-based positions
 * first_position + pos0 + t, into feat (rows, r), rows contiguous.
 * Queries (is_key 0): log_scale[t] receives the stabiliser removed from
 * row t (favor: its largest exponent; 0 for every other map), so that
 * phi(x_t) = feat[t] * exp(log_scale[t]). Keys (is_key 1): the favor
 * features are scaled by exp(-key_log_scale); efficient-attention keys are
 * exp(x - col_shift), normalised over the keys later. */
void attnx_features_f32(const attnx_feature_map *fm, int is_key, const float *x, ptrdiff_t x_row,
                        ptrdiff_t rows, ptrdiff_t pos0, double key_log_scale,
                        const float *col_shift, float *feat, float *log_scale);
void attnx_features_f64(const attnx_feature_map *fm, int is_key, const double *x, ptrdiff_t x_row,
                        ptrdiff_t rows, ptrdiff_t pos0, double key_log_scale,
                        const double *col_shift, double *feat, double *log_scale);

/* The derivative of attnx_features: given the rows x, the features feat
 * attnx_features made of them and dfeat, the gradient of a loss with
 * respect to feat, writes dx (rows, d) (row stride dx_row). dfeat is used
 * as scratch. favor: the stabiliser is a constant (it cancels in the
 * attention), and dW (r, d), when not NULL, receives += the gradient of the
 * projection. efficient-attention keys: feat are the normalised features
 * (a softmax of each column over the keys) and col_dot[c] = sum over the
 * visible keys of feat[j][c] dfeat[j][c]. */
void attnx_features_bwd_f32(const attnx_feature_map *fm, int is_key, const float *x,
                            ptrdiff_t x_row, ptrdiff_t rows, ptrdiff_t pos0, const float *feat,
                            float *dfeat, const float *col_dot, float *dx, ptrdiff_t dx_row,
                            float *dW);
void attnx_features_bwd_f64(const attnx_feature_map *fm, int is_key, const double *x,
                            ptrdiff_t x_row, ptrdiff_t rows, ptrdiff_t pos0, const double *feat,
                            double *dfeat, const double *col_dot, double *dx, ptrdiff_t dx_row,
                            double *dW);

/* favor: c = max_f |W_f|^2 / 2, a bound on every key exponent that needs no
 * other key (w.x - |x|^2/2 <= |w|^2/2); 0 for the other maps. */
double attnx_key_log_scale_f32(const attnx_feature_map *fm);
double attnx_key_log_scale_f64(const attnx_feature_map *fm);

/* efficient attention: col_max[c] = max over the visible keys of x[j][c]
 * (0 for a column without a visible key); key_mask NULL = all visible. */
void attnx_key_column_max_f32(const float *x, ptrdiff_t x_row, ptrdiff_t rows, ptrdiff_t d,
                              const unsigned char *key_mask, ptrdiff_t key_mask_col, float *col_max);
void attnx_key_column_max_f64(const double *x, ptrdiff_t x_row, ptrdiff_t rows, ptrdiff_t d,
                              const unsigned char *key_mask, ptrdiff_t key_mask_col,
                              double *col_max);

enum {
    ATTNX_LIN_Q, ATTNX_LIN_K, ATTNX_LIN_V, ATTNX_LIN_OUT, ATTNX_LIN_KEY_MASK, ATTNX_LIN_MASK,
    ATTNX_LIN_S0, ATTNX_LIN_Z0, ATTNX_LIN_S_OUT, ATTNX_LIN_Z_OUT, ATTNX_LIN_NOPS
};

enum { ATTNX_METHOD_CHUNK, ATTNX_METHOD_RECURRENT, ATTNX_METHOD_CUMSUM, ATTNX_METHOD_QUADRATIC };

/* method cumsum materialises (m + 1) prefix states of r * (e + 1) numbers
 * per head; it refuses above this many bytes, and runs only as many heads
 * at once as fit under it. */
#define ATTNX_CUMSUM_LIMIT ((size_t)2 << 30)

/* Keys of single-token decoding steps not yet added into S (linear.c,
 * deferred_step): head h holds attnx_pending_rows(tick, h, capacity) of
 * them, their features psi (capacity, r) and values (capacity, e) at
 * head h of psi and v. z already holds them. */
typedef struct {
    void *psi, *v;        /* (heads, capacity, r), (heads, capacity, e), C order */
    ptrdiff_t capacity;   /* keys a head holds at most */
    ptrdiff_t tick;       /* deferred steps since S last held every key */
} attnx_pending;

/* Head h adds its held keys into S at the steps where
 * (step + h) % capacity == capacity - 1 (0-based steps since S held every
 * key), so that heads take turns: a step reads every head's S but writes
 * one head in `capacity`, and no step pays for all of them. */
static inline int attnx_pending_adds(ptrdiff_t tick, ptrdiff_t h, ptrdiff_t capacity)
{
    return (tick + h) % capacity == capacity - 1;
}

/* what head h holds after `tick` steps: the steps since its last turn */
static inline ptrdiff_t attnx_pending_rows(ptrdiff_t tick, ptrdiff_t h, ptrdiff_t capacity)
{
    ptrdiff_t first_turn = capacity - 1 - h % capacity;
    return tick <= first_turn ? tick : (tick + h) % capacity;
}

/* the tick after a step, kept below 2 capacity (what a state may hold):
 * from capacity on, turns and held rows depend only on tick % capacity */
static inline ptrdiff_t attnx_pending_next(ptrdiff_t tick, ptrdiff_t capacity)
{
    return tick + 1 < 2 * capacity ? tick + 1 : tick + 1 - capacity;
}

typedef struct {
    ptrdiff_t n, m, d, e;
    ptrdiff_t heads;
    const ptrdiff_t *offsets;          /* (heads, ATTNX_LIN_NOPS) byte offsets */
    const void *q, *k, *v;             /* (n, d), (m, d), (m, e) per head */
    void *out;                         /* (n, e) per head */
    const unsigned char *key_mask;     /* broadcast (m,) bool view, or NULL */
    const unsigned char *mask;         /* broadcast (n, m) bool view, or NULL (quadratic only) */
    const void *S0, *z0;               /* initial state (r, e), (r,) per head, or NULL */
    void *S_out, *z_out;               /* final state, C order, or NULL; may be S0, z0
                                          themselves (a decoding step in place) when S0 is
                                          C order with the same per-head offsets: every
                                          method reads an entry of S0, z0 before it writes
                                          that entry of S_out, z_out (linear.c, states) */
    ptrdiff_t q_row, k_row, v_row, out_row, S0_row;  /* row strides, elements */
    ptrdiff_t key_mask_col;            /* byte stride, 0 when broadcast */
    ptrdiff_t mask_row, mask_col;      /* byte strides, 0 when broadcast */
    attnx_feature_map features;
    attnx_band band;                   /* causal (and, for quadratic, window) */
    int method;                        /* ATTNX_METHOD_*; window and mask need quadratic */
    ptrdiff_t chunk;                   /* chunk / tile length C >= 1 */
    double eps;                        /* clamp of the denominator, >= 0 */
    int normalise;                     /* 0: out_i = phi(q_i) S unnormalised (similarities) */
    int num_threads;
    attnx_pending pending;             /* psi NULL, or a deferred step: n = m = 1, S_out and
                                          z_out are S0 and z0, C order, no key_mask */
    attnx_interrupt *interrupt;        /* or NULL */
} attnx_linear_args;

int attnx_linear_fwd_f32(const attnx_linear_args *args);
int attnx_linear_fwd_f64(const attnx_linear_args *args);

/* The backward of attnx_linear_fwd (linear.c): the gradients of
 * sum(dout * out) with respect to q, k, v, the initial state and the favor
 * projection, plus what arrives at the returned state (dS_in, dz_in).
 * With den_i = phi_i . z_i, D_i = max(den_i, eps_i), o_i = num_i / D_i:
 *   a_i = dout_i / D_i,  b_i = -(dout_i . o_i) / den_i (0 where the clamp
 *   binds; a_i = b_i = 0 where den_i == 0),
 *   dphi_i = S_i a_i + b_i z_i,
 *   dpsi_j = sum_{i sees j} (v_j . a_i + b_i) phi_i,  dv_j = sum_{i sees j} (phi_i . psi_j) a_i,
 * then each feature map's own derivative (attnx_features_bwd). */
enum {
    ATTNX_LINB_Q, ATTNX_LINB_K, ATTNX_LINB_V, ATTNX_LINB_DOUT, ATTNX_LINB_KEY_MASK,
    ATTNX_LINB_MASK, ATTNX_LINB_S0, ATTNX_LINB_Z0, ATTNX_LINB_DS_IN, ATTNX_LINB_DZ_IN,
    ATTNX_LINB_DQ, ATTNX_LINB_DK, ATTNX_LINB_DV, ATTNX_LINB_DS0, ATTNX_LINB_DZ0, ATTNX_LINB_NOPS
};

typedef struct {
    ptrdiff_t n, m, d, e;
    ptrdiff_t heads;
    const ptrdiff_t *offsets;          /* (heads, ATTNX_LINB_NOPS) byte offsets */
    const void *q, *k, *v, *dout;      /* (n, d), (m, d), (m, e), (n, e) per head */
    const unsigned char *key_mask;     /* broadcast (m,) bool view, or NULL */
    const unsigned char *mask;         /* broadcast (n, m) bool view, or NULL (quadratic only) */
    const void *S0, *z0;               /* initial state (r, e), (r,), or NULL */
    const void *dS_in, *dz_in;         /* gradient at the returned state, or NULL */
    void *dq, *dk, *dv;                /* per head (n, d), (m, d), (m, e), rows dq_row... apart */
    void *dS0, *dz0;                   /* C order per head (r, e), (r,); NULL without S0 */
    void *dW;                          /* (r, d) C order, or NULL: favor projection_grad */
    ptrdiff_t q_row, k_row, v_row, dout_row, S0_row, dS_in_row;  /* row strides, elements */
    ptrdiff_t dq_row, dk_row, dv_row;
    ptrdiff_t key_mask_col;            /* byte stride, 0 when broadcast */
    ptrdiff_t mask_row, mask_col;      /* byte strides, 0 when broadcast */
    attnx_feature_map features;
    attnx_band band;                   /* causal (and, for quadratic, window) */
    int method;                        /* ATTNX_METHOD_*; window and mask need quadratic */
    ptrdiff_t chunk;                   /* chunk / tile length C >= 1 */
    double eps;
    int num_threads;
    attnx_interrupt *interrupt;        /* or NULL */
} attnx_linear_bwd_args;

int attnx_linear_bwd_f32(const attnx_linear_bwd_args *args);
int attnx_linear_bwd_f64(const attnx_linear_bwd_args *args);

/* S (heads, r, e) C order, of the kernel's type, += every key `pending`
 * holds (the caller then records tick = 0) */
void attnx_linear_flush_f32(void *S, const attnx_pending *pending, ptrdiff_t heads, ptrdiff_t r,
                            ptrdiff_t e, int num_threads);
void attnx_linear_flush_f64(void *S, const attnx_pending *pending, ptrdiff_t heads, ptrdiff_t r,
                            ptrdiff_t e, int num_threads);

/* ------------------------------------------------------------------------
 * Reformer's LSH attention with shared query-keys (lsh.c): per head the
 * tokens q (n, d) are hashed by H random rotations, sorted by (bucket,
 * position) per round, and attend within their chunk of the sorted order
 * and the one before, to keys in their bucket (lsh.c has the exact rules).
 * out_i = sum_j p_ij v_j, lse_i = log sum_j exp(s_ij) over the union of the
 * rounds' keys, s_ij = scale q_i . q_j / |q_j|.
 */
enum {
    ATTNX_LSH_Q, ATTNX_LSH_V, ATTNX_LSH_OUT, ATTNX_LSH_LSE, ATTNX_LSH_DOUT, ATTNX_LSH_DQ,
    ATTNX_LSH_DV, ATTNX_LSH_NOPS
};

typedef struct {
    ptrdiff_t n, d, e;
    ptrdiff_t heads;
    const ptrdiff_t *offsets;          /* (heads, ATTNX_LSH_NOPS) byte offsets */
    const void *q, *v;                 /* (n, d), (n, e) per head */
    const void *rotations;             /* (n_hashes, d, half), shared by every head */
    ptrdiff_t rot_hash, rot_row;       /* its strides in elements (hash, row) */
    ptrdiff_t n_hashes, half;          /* rounds H >= 1; buckets / 2 >= 1 */
    ptrdiff_t chunk;                   /* 1 <= chunk <= n */
    int causal;                        /* keys only before the query */
    double scale;                      /* 1 / sqrt(d) */
    void *out, *lse;                   /* forward: (n, e), (n,) contiguous per head */
    const void *dout, *out_in, *lse_in;  /* backward: (n, e), the forward's out and lse */
    void *dq, *dv;                     /* backward: (n, d), (n, e) per head */
    ptrdiff_t q_row, v_row, out_row, dout_row, dq_row, dv_row;  /* row strides, elements */
    int num_threads;
    attnx_interrupt *interrupt;        /* or NULL */
} attnx_lsh_args;

int attnx_lsh_fwd_f32(const attnx_lsh_args *args);
int attnx_lsh_fwd_f64(const attnx_lsh_args *args);
/* dq, dv of sum(dout * out) from the forward's out and lse (out_in, lse_in) */
int attnx_lsh_bwd_f32(const attnx_lsh_args *args);
int attnx_lsh_bwd_f64(const attnx_lsh_args *args);
/* the buckets alone: (heads, n_hashes, n) int32, C order (out, lse, dout unused) */
int attnx_lsh_buckets_f32(const attnx_lsh_args *args, int32_t *buckets);
int attnx_lsh_buckets_f64(const attnx_lsh_args *args, int32_t *buckets);

/* ------------------------------------------------------------------------
 * The delta rule (delta.c): DeltaNet, Gated DeltaNet, Kimi Delta Attention.
 * Per head, state S (dk, dv), per token t with q_t, k_t optionally L2
 * normalised and q_t times scale:
 *   S <- diag(exp(g_t)) S      (g_t a scalar, a vector over dk, or 0)
 *   S <- S + k_t (beta_t (v_t - S^T k_t))^T
 *   o_t = S^T q_t
 * One offset table serves forward and backward: the backward's operands
 * take the slots the forward does not use. */
enum {
    ATTNX_DR_Q, ATTNX_DR_K, ATTNX_DR_V, ATTNX_DR_BETA, ATTNX_DR_G, ATTNX_DR_S0, ATTNX_DR_OUT,
    ATTNX_DR_S1, ATTNX_DR_DOUT, ATTNX_DR_DS1, ATTNX_DR_DQ, ATTNX_DR_DK, ATTNX_DR_DV,
    ATTNX_DR_DBETA, ATTNX_DR_DG, ATTNX_DR_DS0, ATTNX_DR_NOPS
};
enum { ATTNX_GATE_NONE, ATTNX_GATE_SCALAR, ATTNX_GATE_CHANNEL };

typedef struct {
    ptrdiff_t n, dk, dv, heads;
    const ptrdiff_t *offsets;          /* (heads, ATTNX_DR_NOPS) byte offsets */
    const void *q, *k, *v;             /* (n, dk), (n, dk), (n, dv) per head */
    const void *beta;                  /* (n,) per head, beta_step bytes apart */
    const void *g;                     /* (n,) scalar gate (g_step bytes apart), (n, dk)
                                          per channel (g_row elements), or NULL */
    const void *S0;                    /* (dk, dv) or NULL (zeros) */
    void *out;                         /* (n, dv); NULL in the backward */
    void *S1;                          /* (dk, dv) C order or NULL; may be S0 itself (a
                                          decoding step in place, same offsets) */
    /* backward only */
    const void *dout;                  /* (n, dv) */
    const void *dS1;                   /* (dk, dv) or NULL: the gradient at the final state */
    void *dq, *dk_, *dv_, *dbeta, *dg, *dS0;  /* C order, the batch shape; dg, dS0 may be NULL */
    ptrdiff_t q_row, k_row, v_row, out_row, g_row, S0_row, dout_row, dS1_row;  /* elements */
    ptrdiff_t beta_step, g_step;       /* bytes, 0 when broadcast */
    int gate;                          /* ATTNX_GATE_* */
    int l2norm;                        /* q, k divided by sqrt(|x|^2 + 1e-6) first */
    double scale;
    int recurrent;                     /* forward: the token loop instead of chunks */
    ptrdiff_t chunk;
    int num_threads;
    attnx_interrupt *interrupt;        /* or NULL */
} attnx_delta_args;

int attnx_delta_fwd_f32(const attnx_delta_args *args);
int attnx_delta_fwd_f64(const attnx_delta_args *args);
/* gradients of sum(dout * out) + sum(dS1 * S1): chunked, whatever args->recurrent */
int attnx_delta_bwd_f32(const attnx_delta_args *args);
int attnx_delta_bwd_f64(const attnx_delta_args *args);
/* The depthwise causal conv1d step of the delta-rule layers (transformers'
 * causal_conv1d_update): per batch entry b and channel c, for each of the L
 * new tokens in turn, the window state[b, c, :] (W values, C order) shifts
 * left by one and takes x[b, c, t] (element strides x_stride), and
 * out[b, c, t] = act(sum_j weight[c, j] window[j] + bias[c]) (out C order
 * (B, D, L); bias may be NULL; act: identity, or silu when silu is set). */
void attnx_conv1d_update_f32(ptrdiff_t B, ptrdiff_t D, ptrdiff_t L, ptrdiff_t W, const float *x,
                             const ptrdiff_t x_stride[3], float *state, const float *weight,
                             const float *bias, int silu, float *out);
void attnx_conv1d_update_f64(ptrdiff_t B, ptrdiff_t D, ptrdiff_t L, ptrdiff_t W, const double *x,
                             const ptrdiff_t x_stride[3], double *state, const double *weight,
                             const double *bias, int silu, double *out);

/* Threads: one pool size for every kernel (set from Python). */
int attnx_get_num_threads(void);
void attnx_set_num_threads(int num_threads);
/* Work too short for an OpenMP parallel region (a decoding step) split
 * over helper threads of attnx's own (team.c): task(context, member, range,
 * ranges) runs once for each range 0 .. ranges - 1 (ranges = members), on
 * the member that took it (member 0 is the caller; member m takes range m
 * first, and the members that finish take the ranges nobody has started);
 * `member` names the member's own scratch. Returns when every range is
 * done. 0 without running the task where no team is available (another
 * caller holds it, members < 2, no threads on this platform); the caller
 * then runs the work its usual way. */
typedef void (*attnx_team_task)(void *context, int member, int range, int ranges);
int attnx_team_run(int members, attnx_team_task task, void *context);
/* The team's helpers stop spinning, and the next decoding step goes to
 * OpenMP: the call of every OpenMP region of more than one thread, as
 * num_threads(attnx_omp_threads(n)), so that the two pools never spin on
 * the cores at once. */
void attnx_team_rest(void);
static inline int attnx_omp_threads(int threads)
{
    if (threads > 1) attnx_team_rest();
    return threads;
}
/* at import: the thread count, the BLAS kept to one thread */
void attnx_runtime_init(void);
const char *attnx_blas_name(void);
/* the kernels OpenBLAS chose for this CPU at load (its core name) */
const char *attnx_blas_core(void);
const char *attnx_simd_level(void);

#endif
