/* py_linear.c - the Python entry of kernelised (linear) attention: parse,
 * validate, allocate, release the GIL, call linear.c.
 *
 * One private function, _C.linear_attention, takes every option by name;
 * the public front ends (attnx/_linear.py) are thin wrappers around it, so
 * that all validation happens here, in C, and a decoding step pays for no
 * numpy work in Python. LinearAttentionState, the state it returns, is a
 * type of this file: its step method is the same call with the options the
 * state remembers, writing the new state into the state's own arrays. */
#include "args.h"
#include <stddef.h>       /* offsetof */
#include <structmember.h> /* T_OBJECT_EX */

#include <limits.h>
#include <math.h>
#include "bindings.h"

typedef int (*linear_kernel)(const attnx_linear_args *);
static const linear_kernel linear_kernels[2] = {attnx_linear_fwd_f32, attnx_linear_fwd_f64};
typedef void (*flush_kernel)(void *, const attnx_pending *, ptrdiff_t, ptrdiff_t, ptrdiff_t, int);
static const flush_kernel flush_kernels[2] = {attnx_linear_flush_f32, attnx_linear_flush_f64};

/* Chunk length of the chunk method (and tile of the quadratic one). The
 * masked C x C block costs 2 C (r + e) flops per token beside the state's
 * 4 r e, so shorter chunks do less arithmetic, until the GEMMs get too
 * small to run at speed: C = 16 was fastest from d = 32 to 128, C = 32
 * for d = 16 (its GEMMs fall under ATTNX_SMALL_GEMM) and for FAVOR+'s
 * many features, whose feature GEMM wants more rows; since then whole
 * float32 chunks of 16 run through a fused AVX-512 kernel (linear.c,
 * fused_chunk), which widens 16's lead (docs/performance.md, the C code's choices). */
static npy_intp default_chunk(int method, npy_intp r)
{
    return method == ATTNX_METHOD_CHUNK && r >= 32 && r <= 128 ? 16 : 32;
}

/* Calls estimated below this many flops are not interrupted: the first
 * poll for Ctrl-C comes 20 ms into a call (runtime.c), which they never
 * reach, and a decoding step would pay a clock read per head for nothing.
 * A decoding step of a state is never interrupted either: stopped between
 * heads, it would leave the state half updated. */
#define INTERRUPTIBLE_FLOPS 1e7

static int interruptible(npy_intp heads, npy_intp n, npy_intp m, npy_intp r, npy_intp e,
                         int quadratic)
{
    double flops = 2.0 * (double)heads * (double)r * (double)(e + 1) *
                   ((double)(n + m) + (quadratic ? (double)n * (double)m : 0));
    return flops >= INTERRUPTIBLE_FLOPS;
}

/* A causal call with at most this many query rows (decoding) defaults to
 * the recurrent method: a few rank-1 updates cost less than the GEMM calls
 * of one chunk. */
#define RECURRENT_MAX_ROWS 8

/* The feature maps by name; feature_map= takes the first
 * FEATURE_MAP_CHOICES, the others only through the variant that fixes them. */
static const char *const feature_map_names[] = {
    [ATTNX_FM_ELU] = "elu", [ATTNX_FM_RELU] = "relu", [ATTNX_FM_SOFTMAX] = "softmax",
    [ATTNX_FM_TAYLOR] = "taylor", [ATTNX_FM_FOCUSED] = "focused", [ATTNX_FM_FAVOR] = "favor",
    [ATTNX_FM_IDENTITY] = "identity", [ATTNX_FM_COSFORMER] = "cosformer",
    [ATTNX_FM_EFFICIENT] = "efficient",
};
#define FEATURE_MAP_CHOICES (ATTNX_FM_IDENTITY + 1)

/* The variants of the kernelised family: the one table of the front ends
 * (attnx/_linear.py, attnx/_linear_grad.py, attnx.torch, attnx.dask read
 * it through _C.linear_variants and _C.linear_resolve). A front end passes
 * its name here; `kind` is the feature map it fixes, or -1 where its
 * feature_map= chooses. The options each takes are its front end's
 * keywords (attnx/_linear.py). */
typedef struct {
    const char *front, *function;
    int kind;
} linear_variant;
static const linear_variant linear_variants[] = {
    {"linear", "linear_attention", -1},
    {"cosformer", "cosformer_attention", ATTNX_FM_COSFORMER},
    {"focused", "focused_linear_attention", ATTNX_FM_FOCUSED},
    {"taylor", "taylor_attention", ATTNX_FM_TAYLOR},
    {"performer", "performer_attention", ATTNX_FM_FAVOR},
    {"efficient", "efficient_attention", ATTNX_FM_EFFICIENT},
};
static const char *const method_names[] = {
    [ATTNX_METHOD_CHUNK] = "chunk", [ATTNX_METHOD_RECURRENT] = "recurrent",
    [ATTNX_METHOD_CUMSUM] = "cumsum", [ATTNX_METHOD_QUADRATIC] = "quadratic",
};
#define COUNT(array) ((int)(sizeof(array) / sizeof((array)[0])))

/* The options of one call, parsed. */
typedef struct {
    int kind;                   /* ATTNX_FM_* */
    int method;                 /* ATTNX_METHOD_*, or -1 for the default */
    int causal, has_left, has_right;
    npy_intp left, right;
    npy_intp chunk;             /* 0: the default */
    double eps, power, period;  /* period 0: M not given */
    int streaming;              /* a state comes in or goes out */
    int backward;               /* the gradients' call: its state is initial_state, grad_state */
} linear_options;

/* obj must be one of names[0..count); `what` names the argument, `allowed`
 * says what else it may be. */
static int parse_choice(PyObject *obj, const char *const *names, int count, const char *what,
                        const char *allowed, int *index)
{
    if (PyUnicode_Check(obj))
        for (int i = 0; i < count; i++)
            if (PyUnicode_CompareWithASCIIString(obj, names[i]) == 0) {
                *index = i;
                return 0;
            }
    char choices[256] = "";
    for (int i = 0; i < count; i++) {
        size_t used = strlen(choices);
        PyOS_snprintf(choices + used, sizeof choices - used, "'%s', ", names[i]);
    }
    PyErr_Format(PyUnicode_Check(obj) ? PyExc_ValueError : PyExc_TypeError,
                 "unknown %s %R: expected one of %s%s", what, obj, choices, allowed);
    return -1;
}

static int parse_eps(PyObject *obj, double *eps)
{
    if (PyBool_Check(obj) || !PyNumber_Check(obj) || PyComplex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "eps must be a number >= 0, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *eps = PyFloat_AsDouble(obj);
    if (*eps == -1.0 && PyErr_Occurred()) return -1;
    if (!isfinite(*eps) || *eps < 0) {
        PyErr_Format(PyExc_ValueError, "eps must be a finite number >= 0, got %R", obj);
        return -1;
    }
    return 0;
}

static int parse_chunk(PyObject *obj, npy_intp *chunk)
{
    *chunk = 0;
    if (obj == Py_None) return 0;
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "chunk_size must be an int >= 1, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t value = PyNumber_AsSsize_t(obj, NULL);  /* clipped: beyond n acts as n */
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < 1) {
        PyErr_Format(PyExc_ValueError, "chunk_size must be an int >= 1, got %R", obj);
        return -1;
    }
    *chunk = value;
    return 0;
}

/* The variant named `front`, NULL (with ValueError) for an unknown name */
static const linear_variant *find_variant(const char *front)
{
    for (int i = 0; i < COUNT(linear_variants); i++)
        if (strcmp(linear_variants[i].front, front) == 0) return &linear_variants[i];
    PyErr_Format(PyExc_ValueError, "unknown linear-family variant '%s'", front);
    return NULL;
}

/* The feature map of variant `front` (feature_map_obj where it chooses) */
static int resolve_kind(const char *front, PyObject *feature_map_obj, int *kind)
{
    const linear_variant *variant = find_variant(front);
    if (!variant) return -1;
    *kind = variant->kind;
    return *kind >= 0 ? 0
                      : parse_choice(feature_map_obj, feature_map_names, FEATURE_MAP_CHOICES,
                                     "feature_map", "or a callable", kind);
}

/* The options every path (forward, backward, decoding step) parses alike;
 * `streaming`: the call starts from or returns a state. */
static int parse_options(const char *front, PyObject *feature_map_obj, PyObject *causal_obj,
                         PyObject *window_obj, PyObject *method_obj, PyObject *chunk_obj,
                         PyObject *eps_obj, PyObject *p_obj, PyObject *M_obj, int streaming,
                         linear_options *o)
{
    o->method = -1;
    o->power = 3;
    o->period = 0;
    o->streaming = streaming;
    o->backward = 0;
    if (resolve_kind(front, feature_map_obj, &o->kind) < 0) return -1;
    if (method_obj != Py_None &&
        parse_choice(method_obj, method_names, COUNT(method_names), "method", "or None",
                     &o->method) < 0)
        return -1;
    if (attnx_parse_causal(causal_obj, &o->causal) < 0 ||
        attnx_parse_window(window_obj, &o->has_left, &o->left, &o->has_right, &o->right) < 0 ||
        parse_chunk(chunk_obj, &o->chunk) < 0 || parse_eps(eps_obj, &o->eps) < 0)
        return -1;
    if (o->kind == ATTNX_FM_FOCUSED && attnx_parse_positive(p_obj, "p", &o->power) < 0) return -1;
    if (M_obj != Py_None && attnx_parse_positive(M_obj, "M", &o->period) < 0) return -1;
    if (o->kind == ATTNX_FM_EFFICIENT) {
        if (o->causal) {
            PyErr_SetString(PyExc_ValueError,
                            "efficient_attention is non-causal only (causal must be False): its "
                            "key softmax runs over the whole sequence");
            return -1;
        }
        o->eps = 0;  /* its weights sum to 1 exactly */
    }
    return 0;
}

/* identity features must be non-negative: checked on the input itself */
static int check_nonnegative(const attnx_operand *op)
{
    if (PyArray_SIZE(op->array) == 0) return 0;
    PyObject *least = PyObject_CallMethod((PyObject *)op->array, "min", NULL);
    PyObject *zero = PyLong_FromLong(0);
    int negative = least && zero ? PyObject_RichCompareBool(least, zero, Py_LT) : -1;
    Py_XDECREF(least);
    Py_XDECREF(zero);
    if (negative > 0)
        PyErr_Format(PyExc_ValueError,
                     "feature_map='identity' takes %s as features, which must be non-negative; "
                     "its smallest entry is negative", op->name);
    return negative ? -1 : 0;
}

/* The feature count r = mul d + add of every map but favor (whose r is
 * its projection's rows): the one statement of the rule r(d). */
static void feature_rule(int kind, npy_intp *mul, npy_intp *add)
{
    *mul = kind == ATTNX_FM_COSFORMER ? 2 : 1;
    *add = kind == ATTNX_FM_TAYLOR;
}

static npy_intp fixed_feature_size(int kind, npy_intp d)
{
    npy_intp mul, add;
    feature_rule(kind, &mul, &add);
    return mul * d + add;
}

/* The features r: bound before the arrays are, so that the state's
 * shape is checked against them; fixed_feature_size(d) of every map but
 * favor, whose r is the rows of its projection W (r, d). */
static int feature_size(const linear_options *o, PyObject *projection_obj, attnx_call *call)
{
    if (o->kind != ATTNX_FM_FAVOR) {
        if (projection_obj != Py_None) {
            PyErr_SetString(PyExc_ValueError, "projection= is only used by feature_map='favor'");
            return -1;
        }
        npy_intp mul, add;
        feature_rule(o->kind, &mul, &add);
        attnx_call_derive(call, 'r', 'd', mul, add);
        return 0;
    }
    if (projection_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "feature_map='favor' needs projection=, an (r, d) array; draw one with "
                        "attnx.random_features(r, d, seed=...)");
        return -1;
    }
    const char *const name[] = {"projection"};
    attnx_dtypes real;  /* only to refuse complex and object projections */
    if (attnx_resolve_dtypes(&projection_obj, name, 1, &real) < 0) return -1;
    PyArrayObject *projection = (PyArrayObject *)PyArray_FROM_O(projection_obj);  /* no copy */
    if (!projection) return -1;
    int status = 0;
    if (PyArray_NDIM(projection) != 2) {
        PyObject *shape = PyObject_GetAttrString((PyObject *)projection, "shape");
        if (shape) PyErr_Format(PyExc_ValueError, "projection must have shape (r, d), got %R", shape);
        Py_XDECREF(shape);
        status = -1;
    } else {
        attnx_call_set(call, 'r', PyArray_DIM(projection, 0));
    }
    Py_DECREF(projection);
    return status;
}

/* The feature map and the band of a call with options o, for the forward
 * and the backward kernels alike: a window is honoured by the quadratic
 * method only (the others take causal alone). */
static attnx_feature_map options_features(const linear_options *o, npy_intp d, npy_intp r,
                                          PyArrayObject *projection, npy_intp offset)
{
    return (attnx_feature_map){.kind = o->kind, .d = d, .r = r, .power = o->power,
                               .projection = projection ? PyArray_DATA(projection) : NULL,
                               .period = o->period, .first_position = offset};
}

static attnx_band options_band(const linear_options *o, npy_intp n, npy_intp m)
{
    return o->method == ATTNX_METHOD_QUADRATIC
               ? attnx_make_band(n, m, o->causal, o->has_left, o->left, o->has_right, o->right)
               : attnx_make_band(n, m, o->causal, 0, 0, 0, 0);
}

/* favor's projection W (r, d) in the compute dtype, C order */
static int projection_convert(PyObject *projection_obj, const attnx_call *call,
                              PyArrayObject **projection)
{
    npy_intp r = attnx_size(call, 'r'), d = attnx_size(call, 'd');
    *projection = (PyArrayObject *)PyArray_FROM_OTF(projection_obj, call->dtypes.compute,
                                                    NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED |
                                                    NPY_ARRAY_FORCECAST);
    if (!*projection) return -1;
    if (PyArray_DIM(*projection, 1) == d) return 0;
    PyObject *shape = PyObject_GetAttrString((PyObject *)*projection, "shape");
    if (shape)
        PyErr_Format(PyExc_ValueError,
                     "projection has shape %R, expected (r, d) = (%ld, %ld) (d from q)", shape,
                     (long)r, (long)d);
    Py_XDECREF(shape);
    Py_CLEAR(*projection);
    return -1;
}

/* Single-token steps hold their keys back from S (linear.c,
 * deferred_step) in the state's pending pair of arrays (..., HELD_KEYS, r)
 * and (..., HELD_KEYS, e), for `tick` steps (attnx.h, attnx_pending).
 * A step of several tokens, or reading state.S, first adds them in.
 * Holding keys beat the RNN step that writes S each time, and with the
 * AVX-512 decoding kernel 4 held keys were as fast as any count tried
 * (docs/performance.md, the C code's choices). */
#define HELD_KEYS 4

/* LinearAttentionState: the state of a call with return_state=True, a C
 * type so that a decoding step reads and writes its fields directly. The
 * attributes users see are S (a property: the held keys added in first),
 * z and offset; the others, with a leading underscore, are the step's.
 * offset stays a Python object, checked where it is used (an int >= 0),
 * as any initial_state's is. */
typedef struct {
    PyObject_HEAD
    PyObject *S;            /* _S: the array behind the property S */
    PyObject *z;
    PyObject *offset;
    PyObject *pending;      /* _pending: None or the held keys' pair of arrays */
    Py_ssize_t tick;        /* _tick: single-token steps since S held every key */
    PyObject *last_out;     /* the output of the last single-token step, whose
                               memory the next takes when nothing else holds it */
    /* what a step repeats of the call that made the state (NULL options:
     * it cannot step): (variant, feature_map, causal, eps, projection, p,
     * M) as that call passed them, the projection in the state's dtype,
     * and those parsed for a causal step of any length */
    PyObject *options;
    PyObject *features;     /* a callable feature map's (q, k, v) -> (phi_q, phi_k), or NULL */
    linear_options step;
    int made_causal;
} linear_state;

static PyTypeObject state_type;

/* The attributes read of any other initial_state, and the defaults of the
 * options linear_attention may leave out, made once. */
static PyObject *name_S, *name_z, *name_offset, *default_feature_map, *default_eps, *default_p;

/* initial_state: its S (new references; NULL for None), z and offset; a
 * LinearAttentionState's S with the held keys added in (state.S), or, for
 * a step (own), as it is */
static int state_flush(linear_state *state);

static int state_get(PyObject *state, int own, PyObject **S, PyObject **z, npy_intp *offset)
{
    *S = *z = NULL;
    *offset = 0;
    if (state == Py_None) return 0;
    PyObject *offset_obj = NULL;
    if (PyObject_TypeCheck(state, &state_type)) {
        linear_state *self = (linear_state *)state;
        if (!own && self->tick && state_flush(self) < 0) return -1;
        if (self->S && self->z && self->offset) {
            Py_INCREF(self->S);
            Py_INCREF(self->z);
            Py_INCREF(self->offset);
            *S = self->S;
            *z = self->z;
            offset_obj = self->offset;
        }
    } else {
        *S = PyObject_GetAttr(state, name_S);
        *z = *S ? PyObject_GetAttr(state, name_z) : NULL;
        offset_obj = *z ? PyObject_GetAttr(state, name_offset) : NULL;
    }
    if (!offset_obj) {
        PyErr_Format(PyExc_TypeError,
                     "initial_state must be the state a call with return_state=True returned "
                     "(with S, z and offset), got %s", Py_TYPE(state)->tp_name);
        return -1;
    }
    *offset = PyLong_Check(offset_obj) ? PyLong_AsSsize_t(offset_obj) : -1;
    int status = 0;
    if (*offset < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "initial_state.offset must be an int >= 0, got %R", offset_obj);
        status = -1;
    }
    Py_DECREF(offset_obj);
    return status;
}

/* The held keys of a stepping state whose S is (..., r, e): its pending
 * arrays when they fit S (pending->psi NULL when there are none yet, or S
 * was replaced), and its tick. The arrays are the state's private ones,
 * made by hold_keys; held keys that do not fit S were set by hand. */
static int held_keys_of(const linear_state *state, PyArrayObject *S, attnx_pending *pending)
{
    PyObject *pair = state->pending;
    pending->psi = pending->v = NULL;
    pending->capacity = HELD_KEYS;
    pending->tick = state->tick;
    int nd = PyArray_NDIM(S), fits = pair && PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
    for (int i = 0; fits && i < 2; i++) {
        PyArrayObject *held = (PyArrayObject *)PyTuple_GET_ITEM(pair, i);
        fits = PyArray_Check(held) && PyArray_TYPE(held) == PyArray_TYPE(S) &&
               PyArray_NDIM(held) == nd && PyArray_IS_C_CONTIGUOUS(held) &&
               PyArray_ISWRITEABLE(held) && PyArray_DIM(held, nd - 2) == HELD_KEYS &&
               PyArray_DIM(held, nd - 1) == PyArray_DIM(S, nd - 2 + i);
        for (int ax = 0; fits && ax < nd - 2; ax++) fits = PyArray_DIM(held, ax) == PyArray_DIM(S, ax);
    }
    if (fits) {
        pending->psi = PyArray_DATA((PyArrayObject *)PyTuple_GET_ITEM(pair, 0));
        pending->v = PyArray_DATA((PyArrayObject *)PyTuple_GET_ITEM(pair, 1));
    }
    /* steps store ticks below 2 HELD_KEYS (attnx_pending_next) */
    if (pending->tick == 0 || (fits && pending->tick > 0 && pending->tick < 2 * HELD_KEYS)) return 0;
    PyErr_SetString(PyExc_ValueError,
                    "this state's held decoding keys (_pending, _tick) do not fit its S: they "
                    "were changed by hand; assign state.S to start again from a given S");
    return -1;
}

/* the held keys into S, with the GIL released (S and the held keys'
 * arrays held meanwhile: another thread may replace the state's); the
 * state then holds none */
static void held_keys_flush(linear_state *state, PyArrayObject *S, const attnx_pending *pending)
{
    npy_intp nd = PyArray_NDIM(S), r = PyArray_DIM(S, nd - 2), e = PyArray_DIM(S, nd - 1);
    npy_intp heads = PyArray_SIZE(S) / (r * e > 0 ? r * e : 1);
    int threads = attnx_get_num_threads();
    PyObject *pair = state->pending;
    if (pending->tick == 0) return;
    Py_INCREF(S);
    Py_XINCREF(pair);
    Py_BEGIN_ALLOW_THREADS
    flush_kernels[PyArray_TYPE(S) == NPY_DOUBLE](PyArray_DATA(S), pending, heads, r, e, threads);
    Py_END_ALLOW_THREADS
    Py_DECREF(S);
    Py_XDECREF(pair);
    state->tick = 0;
}

/* A single-token step's keys go into the state's pending pair, made when
 * there are no arrays that fit S. */
static int hold_keys(linear_state *state, const attnx_batch *batch, npy_intp r, npy_intp e,
                     int typenum, attnx_pending *pending)
{
    if (pending->psi) return 0;
    npy_intp keys_shape[2] = {HELD_KEYS, r}, values_shape[2] = {HELD_KEYS, e};
    PyArrayObject *keys = attnx_new_aligned_array(batch, keys_shape, 2, typenum);
    PyArrayObject *values = keys ? attnx_new_aligned_array(batch, values_shape, 2, typenum) : NULL;
    PyObject *pair = values ? PyTuple_Pack(2, keys, values) : NULL;
    if (pair) {
        Py_XSETREF(state->pending, pair);
        pending->psi = PyArray_DATA(keys);
        pending->v = PyArray_DATA(values);
    }
    Py_XDECREF(keys);
    Py_XDECREF(values);
    return pair ? 0 : -1;
}

/* The method, from the options: mask and window need the quadratic form. */
static int resolve_method(linear_options *o, int has_mask, npy_intp n)
{
    int general = has_mask || o->has_left || o->has_right;
    if (general && o->streaming) {
        PyErr_Format(PyExc_ValueError,
                     "mask= and window= cannot be combined with initial_state or %s: "
                     "a state keeps no key positions", o->backward ? "grad_state" : "return_state");
        return -1;
    }
    /* the backward has no recurrent form: its default is the chunked one */
    if (o->method < 0)
        o->method = general ? ATTNX_METHOD_QUADRATIC
                    : o->causal && n <= RECURRENT_MAX_ROWS && !o->backward ? ATTNX_METHOD_RECURRENT
                                                                           : ATTNX_METHOD_CHUNK;
    if (general && o->method != ATTNX_METHOD_QUADRATIC) {
        PyErr_Format(PyExc_ValueError,
                     "mask= and window= need method='quadratic' (or None), got method='%s'",
                     method_names[o->method]);
        return -1;
    }
    if (o->kind == ATTNX_FM_EFFICIENT && (general || o->streaming)) {
        PyErr_SetString(PyExc_ValueError,
                        "efficient_attention takes no mask=, window= or streaming state");
        return -1;
    }
    return 0;
}

/* cosFormer's M: at least the largest position; fixed when streaming */
static int check_period(linear_options *o, npy_intp n, npy_intp m, npy_intp offset)
{
    if (o->kind != ATTNX_FM_COSFORMER) return 0;
    if (o->causal && n != m) {
        PyErr_Format(PyExc_ValueError,
                     "causal cosformer_attention needs as many queries as keys, got n = %ld, m = %ld",
                     (long)n, (long)m);
        return -1;
    }
    npy_intp largest = offset + (n > m ? n : m);
    if (o->period == 0) {
        if (o->streaming) {
            PyErr_Format(PyExc_ValueError,
                         "cosformer_attention needs a fixed M= when streaming (initial_state= or "
                         "%s): the default max(n, m) changes between calls",
                         o->backward ? "grad_state=" : "return_state=True");
            return -1;
        }
        o->period = largest > 0 ? (double)largest : 1;
    }
    if (o->period < (double)largest) {
        char message[200];  /* PyErr_Format has no %g */
        PyOS_snprintf(message, sizeof message,
                      "M=%g is smaller than the largest position %ld (offset + max(n, m)); "
                      "cos(pi/2 (i - j) / M) must stay positive", o->period, (long)largest);
        PyErr_SetString(PyExc_ValueError, message);
        return -1;
    }
    return 0;
}

/* the last two axes of an array-like, 0 where it has fewer */
static int trailing_shape(PyObject *obj, npy_intp *rows, npy_intp *cols)
{
    PyArrayObject *array = (PyArrayObject *)PyArray_FROM_O(obj);  /* no copy of an array */
    if (!array) return -1;
    int nd = PyArray_NDIM(array);
    *rows = nd >= 2 ? PyArray_DIM(array, nd - 2) : 0;
    *cols = nd >= 1 ? PyArray_DIM(array, nd - 1) : 0;
    Py_DECREF(array);
    return 0;
}

/* method='cumsum' (never a default) holds m + 1 prefix states of
 * r x (e + 1) numbers per head: refused on the shapes alone, before an
 * input is converted (a broadcast view of a huge n would be copied). */
static int check_cumsum_size(const linear_options *o, PyObject *q_obj, PyObject *k_obj,
                             PyObject *v_obj, PyObject *projection_obj)
{
    if (o->method != ATTNX_METHOD_CUMSUM) return 0;
    PyObject *const objs[] = {q_obj, k_obj, v_obj};
    const char *const names[] = {"q", "k", "v"};
    attnx_dtypes dtypes;
    if (attnx_resolve_dtypes(objs, names, 3, &dtypes) < 0) return -1;
    int typenum = dtypes.compute;
    npy_intp m, d, e, r = 0, unused;
    if (trailing_shape(k_obj, &unused, &d) < 0 || trailing_shape(v_obj, &m, &e) < 0) return -1;
    if (o->kind != ATTNX_FM_FAVOR) r = fixed_feature_size(o->kind, d);
    else if (projection_obj != Py_None && trailing_shape(projection_obj, &r, &unused) < 0) return -1;
    double bytes = ((double)m + 1) * (double)r * ((double)e + 1) * (typenum == NPY_FLOAT ? 4 : 8);
    if (bytes <= (double)ATTNX_CUMSUM_LIMIT) return 0;
    char message[240];  /* PyErr_Format has no %f */
    PyOS_snprintf(message, sizeof message,
                  "method='cumsum' materialises m + 1 = %ld prefix states of r x (e + 1) = %ld x %ld "
                  "numbers: %.2f GiB per head, above its %.0f GiB limit; use method='chunk'",
                  (long)(m + 1), (long)r, (long)(e + 1), bytes / (1 << 30),
                  (double)ATTNX_CUMSUM_LIMIT / (1 << 30));
    PyErr_SetString(PyExc_ValueError, message);
    return -1;
}

/* The array arguments. A decoding step (state.step) writes the new state
 * over the old: S_OUT, Z_OUT are S0, Z0 themselves, which attnx_bind
 * checks (ATTNX_IN_PLACE): the very arrays the kernel uses (no converted
 * copy), writeable, C-ordered (the kernel writes S_out rows e apart), of
 * the call's batch shape (a broadcast state would receive several heads'
 * updates), disjoint from every input. The kernel reads each entry of S0,
 * z0 before it writes that entry of S_out, z_out (attnx.h). A carried
 * state is never cast (ATTNX_EXACT_DTYPE): it comes from a call of the
 * same dtype. */
enum { Q, K, V, KEY_MASK, MASK, S0, Z0, OUT, S_OUT, Z_OUT, NPARAMS };
#define LINEAR_PARAMS(state, state_out) {                                              \
    [Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_LIN_Q},                                      \
    [K] = {"k", "m d", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_LIN_K},               \
    [V] = {"v", "m e", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_LIN_V},               \
    [KEY_MASK] = {"key_mask", "m|1", ATTNX_BOOL, ATTNX_LIN_KEY_MASK},                    \
    [MASK] = {"mask", "n|1 m|1", ATTNX_BOOL, ATTNX_LIN_MASK},                            \
    [S0] = {state ".S", "r e", ATTNX_EXACT_DTYPE, ATTNX_LIN_S0},                          \
    [Z0] = {state ".z", "r", ATTNX_EXACT_DTYPE, ATTNX_LIN_Z0},                            \
    [OUT] = {"out", "n e", ATTNX_OUTPUT | ATTNX_RESULT_DTYPE, ATTNX_LIN_OUT},            \
    [S_OUT] = {state ".S", "r e", ATTNX_OUTPUT | (state_out), ATTNX_LIN_S_OUT},           \
    [Z_OUT] = {state ".z", "r", ATTNX_OUTPUT | (state_out), ATTNX_LIN_Z_OUT},             \
}
static const attnx_param linear_params[NPARAMS] = LINEAR_PARAMS("initial_state", ATTNX_ALIGNED);
static const attnx_param step_params[NPARAMS] = LINEAR_PARAMS("state", ATTNX_IN_PLACE);

/* One call's arguments, as Python passed them. */
typedef struct {
    PyObject *q, *k, *v, *variant, *feature_map, *causal, *key_mask, *mask, *window, *method,
        *chunk_size, *eps, *projection, *p, *M, *initial_state, *out;
    PyObject *features;  /* a callable feature map's (q, k, v) -> (phi_q, phi_k), or None */
    int return_state, normalise;
    /* a decoding step: initial_state's own S, z receive the new state, and
     * its parsed options are the call's */
    const linear_options *step;
} linear_call;

static PyObject *state_make(PyObject *S, PyObject *z, npy_intp offset, const linear_call *c,
                            PyArrayObject *projection);

static PyObject *run_linear(const linear_call *c)
{
    PyObject *initial_state = c->initial_state, *S_obj = NULL, *z_obj = NULL, *ret = NULL;
    PyObject *held = NULL;  /* the held keys' arrays a step writes, held while it runs */
    PyArrayObject *projection = NULL;
    const char *variant = c->step ? NULL : PyUnicode_AsUTF8(c->variant);
    int in_place = c->step != NULL;
    linear_options o;
    attnx_call call;
    npy_intp offset;
    attnx_call_init(&call, in_place ? step_params : linear_params, NPARAMS, ATTNX_LIN_NOPS,
                    "demr");
    call.legend = "r: the features of this feature map";
    if (in_place) o = *c->step;
    else if (!variant ||
             parse_options(variant, c->feature_map, c->causal, c->window, c->method, c->chunk_size,
                           c->eps, c->p, c->M, initial_state != Py_None || c->return_state, &o) < 0)
        goto done;
    if (check_cumsum_size(&o, c->q, c->k, c->v, c->projection) < 0 ||
        feature_size(&o, c->projection, &call) < 0 ||
        state_get(initial_state, in_place, &S_obj, &z_obj, &offset) < 0)
        goto done;
    PyObject *const objs[NPARAMS] = {
        [Q] = c->q, [K] = c->k, [V] = c->v, [KEY_MASK] = c->key_mask, [MASK] = c->mask,
        [S0] = S_obj, [Z0] = z_obj, [OUT] = c->out,
        [S_OUT] = in_place ? S_obj : c->return_state ? Py_None : NULL,
        [Z_OUT] = in_place ? z_obj : c->return_state ? Py_None : NULL,
    };
    if (attnx_bind(&call, objs) < 0) goto done;

    npy_intp n = attnx_size(&call, 'n'), m = attnx_size(&call, 'm'), d = attnx_size(&call, 'd'),
             e = attnx_size(&call, 'e'), r = attnx_size(&call, 'r');
    if (o.kind == ATTNX_FM_FAVOR && projection_convert(c->projection, &call, &projection) < 0)
        goto done;
    if (o.kind == ATTNX_FM_IDENTITY &&
        (check_nonnegative(&call.ops[Q]) < 0 || check_nonnegative(&call.ops[K]) < 0))
        goto done;
    if (resolve_method(&o, call.ops[MASK].array != NULL, n) < 0 || check_period(&o, n, m, offset) < 0)
        goto done;
    attnx_pending pending = {NULL};
    int deferred = in_place && n == 1 && m == 1 && o.method == ATTNX_METHOD_RECURRENT;
    PyArrayObject *S0_array = call.ops[S0].array;
    linear_state *stepped = in_place ? (linear_state *)initial_state : NULL;
    if (stepped) {
        if (held_keys_of(stepped, S0_array, &pending) < 0 ||
            (deferred && hold_keys(stepped, &call.batch, r, e, call.dtypes.compute, &pending) < 0))
            goto done;
        if (!deferred) held_keys_flush(stepped, S0_array, &pending);
        held = stepped->pending;
        Py_XINCREF(held);
    }
    if (!deferred) pending.psi = NULL;

    attnx_interrupt interrupt = attnx_interrupt_for_call();
    int stoppable = !in_place &&
                    interruptible(call.batch.heads, n, m, r, e, o.method == ATTNX_METHOD_QUADRATIC);
    /* a chunk longer than the sequence is the sequence */
    npy_intp longest = n > m ? n : m, chunk = o.chunk ? o.chunk : default_chunk(o.method, r);
    if (chunk > longest) chunk = longest > 0 ? longest : 1;
    attnx_linear_args kargs = {
        .n = n, .m = m, .d = d, .e = e, .heads = call.batch.heads, .offsets = call.offsets,
        .q = attnx_data(&call, Q), .k = attnx_data(&call, K), .v = attnx_data(&call, V),
        .out = attnx_data(&call, OUT),
        .key_mask = attnx_data(&call, KEY_MASK), .mask = attnx_data(&call, MASK),
        .S0 = attnx_data(&call, S0), .z0 = attnx_data(&call, Z0),
        .S_out = attnx_data(&call, S_OUT), .z_out = attnx_data(&call, Z_OUT),
        .q_row = attnx_row_stride(call.ops[Q].array), .k_row = attnx_row_stride(call.ops[K].array),
        .v_row = attnx_row_stride(call.ops[V].array),
        .out_row = attnx_row_stride(call.ops[OUT].array),
        .S0_row = S0_array ? attnx_row_stride(S0_array) : e,
        .key_mask_col = attnx_core_stride(&call, KEY_MASK, -1),
        .mask_row = attnx_core_stride(&call, MASK, -2),
        .mask_col = attnx_core_stride(&call, MASK, -1),
        .features = options_features(&o, d, r, projection, offset),
        .band = options_band(&o, n, m),
        .method = o.method,
        .chunk = chunk,
        .eps = o.eps,
        .normalise = c->normalise,
        .num_threads = attnx_get_num_threads(),
        .pending = pending,
        .interrupt = stoppable ? &interrupt : NULL,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = linear_kernels[call.dtypes.compute == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    PyObject *result = (PyObject *)call.results[OUT];
    if (stepped) {
        PyObject *next_offset = PyLong_FromSsize_t((Py_ssize_t)(offset + m));
        if (!next_offset) goto done;
        Py_XSETREF(stepped->offset, next_offset);
        if (deferred) stepped->tick = attnx_pending_next(pending.tick, HELD_KEYS);
        ret = result;
        Py_INCREF(ret);
    } else if (c->return_state) {
        PyObject *state = state_make((PyObject *)call.results[S_OUT],
                                     (PyObject *)call.results[Z_OUT], offset + m, c, projection);
        ret = state ? PyTuple_Pack(2, result, state) : NULL;
        Py_XDECREF(state);
    } else {
        ret = result;
        Py_INCREF(ret);
    }
done:
    attnx_call_release(&call);
    Py_XDECREF(projection);
    Py_XDECREF(S_obj);
    Py_XDECREF(z_obj);
    Py_XDECREF(held);
    return ret;
}

/* the arguments of _C.linear_attention, by name (attnx_parse_keywords) */
enum { A_Q, A_K, A_V, A_VARIANT, A_FEATURE_MAP, A_CAUSAL, A_KEY_MASK, A_MASK, A_WINDOW,
       A_METHOD, A_CHUNK_SIZE, A_EPS, A_PROJECTION, A_P, A_M, A_INITIAL_STATE, A_RETURN_STATE,
       A_OUT, A_NORMALISE, A_FEATURES, A_COUNT };
static const char *const linear_argument_names[A_COUNT] = {
    "q", "k", "v", "variant", "feature_map", "causal", "key_mask", "mask", "window", "method",
    "chunk_size", "eps", "projection", "p", "M", "initial_state", "return_state", "out",
    "normalise", "features"};
static PyObject *linear_argument_interned[A_COUNT];
static attnx_keywords linear_arguments = {"linear_attention", linear_argument_names, A_COUNT, 3,
                                          4, linear_argument_interned};

/* METH_FASTCALL | METH_KEYWORDS: the arguments come as an array and a
 * tuple of names, not a tuple and a dict parsed by a format string (which
 * took a tenth of a decoding call's binding) */
PyObject *attnx_py_linear_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    PyObject *a[A_COUNT];
    if (attnx_parse_keywords(&linear_arguments, args, PyVectorcall_NARGS(nargs), kwnames, a) < 0)
        return NULL;
    /* the options left out take their defaults */
    if (!a[A_FEATURE_MAP]) a[A_FEATURE_MAP] = default_feature_map;
    if (!a[A_EPS]) a[A_EPS] = default_eps;
    if (!a[A_P]) a[A_P] = default_p;
    for (int i = A_CAUSAL; i < A_COUNT; i++)
        if (!a[i]) a[i] = i == A_CAUSAL || i == A_RETURN_STATE ? Py_False
                          : i == A_NORMALISE ? Py_True : Py_None;
    linear_call c = {.q = a[A_Q], .k = a[A_K], .v = a[A_V], .variant = a[A_VARIANT],
                     .feature_map = a[A_FEATURE_MAP],
                     .causal = a[A_CAUSAL], .key_mask = a[A_KEY_MASK], .mask = a[A_MASK],
                     .window = a[A_WINDOW], .method = a[A_METHOD], .chunk_size = a[A_CHUNK_SIZE],
                     .eps = a[A_EPS], .projection = a[A_PROJECTION], .p = a[A_P],
                     .M = a[A_M], .initial_state = a[A_INITIAL_STATE], .out = a[A_OUT],
                     .features = a[A_FEATURES]};
    if (!PyUnicode_Check(c.variant)) {
        PyErr_SetString(PyExc_TypeError, "linear_attention: variant must be a str");
        return NULL;
    }
    if ((c.return_state = PyObject_IsTrue(a[A_RETURN_STATE])) < 0 ||
        (c.normalise = PyObject_IsTrue(a[A_NORMALISE])) < 0)
        return NULL;
    return run_linear(&c);
}

/* ------------------------------------------------------------------------
 * The lean decoding step. From its second single-token step on, a
 * decoding loop calls state.step with arrays that need none of
 * attnx_bind's work: q, k, v in the state's dtype and batch shape, each
 * head one C-ordered row, and the state's own C-ordered S, z and held
 * keys. For that call alone the binding checks just what the kernel
 * relies on and builds the offset table directly (attnx_bind's
 * broadcasting, promotion and overlap checks took a quarter of a
 * one-head step). Any other call, and every call with something wrong,
 * goes the general way, which says what is wrong. */

/* array a: an ndarray of dtype typenum, C-ordered and aligned, with
 * the batch shape (lead axes) and the trailing axes `rows` x `cols`
 * (rows < 0: no row axis) */
static int lean_fits(PyObject *obj, int typenum, const npy_intp *batch, int lead, npy_intp rows,
                     npy_intp cols)
{
    if (!PyArray_Check(obj)) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    int nd = lead + 1 + (rows >= 0);
    if (PyArray_TYPE(a) != typenum || PyArray_NDIM(a) != nd ||
        !PyArray_CHKFLAGS(a, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED) ||
        PyArray_DIM(a, nd - 1) != cols || (rows >= 0 && PyArray_DIM(a, nd - 2) != rows))
        return 0;
    for (int ax = 0; ax < lead; ax++)
        if (PyArray_DIM(a, ax) != batch[ax]) return 0;
    return 1;
}

/* do the byte ranges of two C-ordered arrays meet? */
static int lean_meet(const void *a, npy_intp a_bytes, const void *b, npy_intp b_bytes)
{
    const char *a_lo = a, *b_lo = b;
    return a_bytes > 0 && b_bytes > 0 && a_lo < b_lo + b_bytes && b_lo < a_lo + a_bytes;
}

#define LEAN_HEADS 64

/* the offset table of `heads` C-ordered heads */
static void lean_offsets(ptrdiff_t *offsets, npy_intp heads, npy_intp d, npy_intp e, npy_intp r,
                         npy_intp item)
{
    for (npy_intp h = 0; h < heads; h++) {
        ptrdiff_t *row = offsets + h * ATTNX_LIN_NOPS;
        row[ATTNX_LIN_Q] = row[ATTNX_LIN_K] = h * d * item;
        row[ATTNX_LIN_V] = row[ATTNX_LIN_OUT] = h * e * item;
        row[ATTNX_LIN_KEY_MASK] = row[ATTNX_LIN_MASK] = 0;
        row[ATTNX_LIN_S0] = row[ATTNX_LIN_S_OUT] = h * r * e * item;
        row[ATTNX_LIN_Z0] = row[ATTNX_LIN_Z_OUT] = h * r * item;
    }
}

/* The offset table of the last lean steps' shape, kept from step to step:
 * the helper threads that take some of a step's heads (team.c) read it,
 * and a table written anew at each step, the same numbers in lines the
 * caller had just written, reached them as cache misses (a slower step:
 * docs/performance.md, the C code's choices). It changes only
 * under the GIL, for another shape, and only while no step uses it: a
 * step counts itself in `users` from before it releases the GIL to after
 * it takes it back. Meanwhile a step of another shape builds a table of
 * its own. */
static struct {
    npy_intp heads, d, e, r, item;
    int users;
    ptrdiff_t rows[LEAN_HEADS * ATTNX_LIN_NOPS];
} kept_table;

/* kept_table's rows, made for this shape if need be, with the caller
 * counted among their users; NULL when another shape's step uses them */
static const ptrdiff_t *lean_kept_table(npy_intp heads, npy_intp d, npy_intp e, npy_intp r,
                                        npy_intp item)
{
    if (kept_table.heads != heads || kept_table.d != d || kept_table.e != e || kept_table.r != r ||
        kept_table.item != item) {
        if (kept_table.users > 0) return NULL;
        lean_offsets(kept_table.rows, heads, d, e, r, item);
        kept_table.heads = heads;
        kept_table.d = d;
        kept_table.e = e;
        kept_table.r = r;
        kept_table.item = item;
    }
    kept_table.users++;
    return kept_table.rows;
}

/* 1: the step ran (*ret the output), 0: not a lean call, -1: error */
static int lean_step(linear_state *state, const linear_call *c, PyObject **ret)
{
    linear_options o = state->step;
    PyArrayObject *out = NULL;
    /* the offset table: kept_table's, else one on the stack for up to
     * LEAN_HEADS heads, so that a step allocates nothing but its output,
     * and not that when the output of the last step is free (below) */
    ptrdiff_t table[LEAN_HEADS * ATTNX_LIN_NOPS];
    const ptrdiff_t *offsets = NULL, *kept = NULL;
    PyObject *S_obj = state->S, *z_obj = state->z, *offset_obj = state->offset;
    PyObject *last = state->last_out;
    if (o.kind == ATTNX_FM_FAVOR || o.kind == ATTNX_FM_IDENTITY || o.kind == ATTNX_FM_COSFORMER ||
        o.kind == ATTNX_FM_EFFICIENT || resolve_method(&o, 0, 1) < 0 ||
        o.method != ATTNX_METHOD_RECURRENT) {
        PyErr_Clear();
        return 0;
    }
    if (!S_obj || !z_obj || !offset_obj || !state->pending || !PyLong_CheckExact(offset_obj) ||
        !PyArray_Check(S_obj) || PyArray_NDIM((PyArrayObject *)S_obj) < 2)
        return 0;
    npy_intp offset = PyLong_AsSsize_t(offset_obj);
    if (offset < 0) {
        PyErr_Clear();
        return 0;
    }
    PyArrayObject *S = (PyArrayObject *)S_obj, *z = (PyArrayObject *)z_obj;
    if (PyArray_TYPE(S) != NPY_FLOAT && PyArray_TYPE(S) != NPY_DOUBLE) return 0;
    int typenum = PyArray_TYPE(S), lead = PyArray_NDIM(S) - 2;
    const npy_intp *batch = PyArray_DIMS(S);
    npy_intp r = batch[lead], e = batch[lead + 1];
    npy_intp d = PyArray_Check(c->q) && PyArray_NDIM((PyArrayObject *)c->q) == lead + 2
                     ? PyArray_DIM((PyArrayObject *)c->q, lead + 1) : -1;
    if (d < 1 || fixed_feature_size(o.kind, d) != r || !PyArray_ISWRITEABLE(S) ||
        !lean_fits(S_obj, typenum, batch, lead, r, e) || !lean_fits(z_obj, typenum, batch, lead, -1, r) ||
        !PyArray_ISWRITEABLE(z) || !lean_fits(c->q, typenum, batch, lead, 1, d) ||
        !lean_fits(c->k, typenum, batch, lead, 1, d) || !lean_fits(c->v, typenum, batch, lead, 1, e) ||
        (c->out != Py_None && (!lean_fits(c->out, typenum, batch, lead, 1, e) ||
                               !PyArray_ISWRITEABLE((PyArrayObject *)c->out))))
        return 0;
    attnx_pending pending;
    if (held_keys_of(state, S, &pending) < 0) return -1;
    if (!pending.psi) return 0;  /* the first step makes the held keys' arrays */
    npy_intp heads = 1, item = PyArray_ITEMSIZE(S);
    for (int ax = 0; ax < lead; ax++) heads *= batch[ax];
    if (heads == 0 || e == 0) return 0;  /* nothing to run: the general path's defined results */
    int status = -1;
    if (c->out != Py_None) {
        out = (PyArrayObject *)c->out;
        Py_INCREF(out);
    } else if (last && Py_REFCNT(last) == 1 && lean_fits(last, typenum, batch, lead, 1, e) &&
               PyArray_ISWRITEABLE((PyArrayObject *)last)) {
        /* the last step's output, which nothing but this state holds any
         * more (no name, view or buffer of it is left): the new one takes
         * its memory (spares an allocation and a free a step) */
        out = (PyArrayObject *)last;
        Py_INCREF(out);
    } else {
        npy_intp shape[NPY_MAXDIMS];
        memcpy(shape, batch, (size_t)lead * sizeof(npy_intp));
        shape[lead] = 1;
        shape[lead + 1] = e;
        if (!(out = (PyArrayObject *)PyArray_SimpleNew(lead + 2, shape, typenum))) goto done;
    }
    status = 0;
    /* the arrays the step writes against every other it touches (all
     * C-ordered, of the batch shape: their sizes follow from it) */
    const void *read[] = {PyArray_DATA((PyArrayObject *)c->q), PyArray_DATA((PyArrayObject *)c->k),
                          PyArray_DATA((PyArrayObject *)c->v)};
    npy_intp read_bytes[] = {heads * d * item, heads * d * item, heads * e * item};
    const void *written[] = {PyArray_DATA(S), PyArray_DATA(z), pending.psi, pending.v,
                             PyArray_DATA(out)};
    npy_intp written_bytes[] = {heads * r * e * item, heads * r * item, heads * HELD_KEYS * r * item,
                                heads * HELD_KEYS * e * item, heads * e * item};
    for (int w = 0; w < 5; w++) {
        for (int i = 0; i < 3; i++)
            if (lean_meet(written[w], written_bytes[w], read[i], read_bytes[i])) goto done;
        for (int u = w + 1; u < 5; u++)
            if (lean_meet(written[w], written_bytes[w], written[u], written_bytes[u])) goto done;
    }
    status = -1;
    if (heads <= LEAN_HEADS && (kept = lean_kept_table(heads, d, e, r, item))) {
        offsets = kept;
    } else {
        ptrdiff_t *made = heads <= LEAN_HEADS
                              ? table
                              : PyMem_RawMalloc((size_t)heads * ATTNX_LIN_NOPS * sizeof(ptrdiff_t));
        if (!made) {
            PyErr_NoMemory();
            goto done;
        }
        lean_offsets(made, heads, d, e, r, item);
        offsets = made;
    }
    attnx_linear_args kargs = {
        .n = 1, .m = 1, .d = d, .e = e, .heads = heads, .offsets = offsets,
        .q = PyArray_DATA((PyArrayObject *)c->q), .k = PyArray_DATA((PyArrayObject *)c->k),
        .v = PyArray_DATA((PyArrayObject *)c->v), .out = PyArray_DATA(out),
        .S0 = PyArray_DATA(S), .z0 = PyArray_DATA(z), .S_out = PyArray_DATA(S),
        .z_out = PyArray_DATA(z),
        .q_row = d, .k_row = d, .v_row = e, .out_row = e, .S0_row = e,
        .features = options_features(&o, d, r, NULL, offset),
        .band = options_band(&o, 1, 1),
        .method = o.method,
        .chunk = 1,
        .eps = o.eps,
        .normalise = 1,
        .num_threads = attnx_get_num_threads(),
        .pending = pending,
    };
    /* the state's arrays held while the GIL is released: another thread
     * may replace the state's own */
    PyObject *held[] = {S_obj, z_obj, state->pending};
    for (int i = 0; i < 3; i++) Py_INCREF(held[i]);
    int kernel_status;
    Py_BEGIN_ALLOW_THREADS
    kernel_status = linear_kernels[typenum == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 3; i++) Py_DECREF(held[i]);
    PyObject *next_offset = PyLong_FromSsize_t((Py_ssize_t)(offset + 1));
    if (attnx_check_status(kernel_status) < 0 || !next_offset) {
        Py_XDECREF(next_offset);
        goto done;
    }
    Py_SETREF(state->offset, next_offset);
    state->tick = attnx_pending_next(pending.tick, HELD_KEYS);
    if (c->out == Py_None && (PyObject *)out != last) {
        Py_INCREF(out);
        Py_XSETREF(state->last_out, (PyObject *)out);
    }
    *ret = (PyObject *)out;
    out = NULL;
    status = 1;
done:
    if (kept) kept_table.users--;
    else if (offsets != table) PyMem_RawFree((void *)offsets);
    Py_XDECREF(out);
    return status;
}

/* the arguments of state.step(q, k, v, out=None), by name */
static const char *const step_argument_names[4] = {"q", "k", "v", "out"};
static PyObject *step_argument_interned[4];
static attnx_keywords step_arguments = {"step", step_argument_names, 4, 4, 3,
                                        step_argument_interned};

/* state.step(q, k, v, out=None): the causal call that continues `state`,
 * with the options of the call that made it (state->step), writing the
 * new state into the state's own arrays and advancing its offset. */
static PyObject *state_step(linear_state *state, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    linear_call c = {.key_mask = Py_None, .mask = Py_None, .normalise = 1,
                     .initial_state = (PyObject *)state, .step = &state->step};
    PyObject *found[4], *mapped = NULL, *ret = NULL;
    nargs = PyVectorcall_NARGS(nargs);
    if (nargs > 4) {
        PyErr_Format(PyExc_TypeError, "step() takes q, k, v and optionally out (%zd given)", nargs);
        return NULL;
    }
    if (attnx_parse_keywords(&step_arguments, args, nargs, kwnames, found) < 0) return NULL;
    c.q = found[0];
    c.k = found[1];
    c.v = found[2];
    c.out = found[3] ? found[3] : Py_None;
    /* a callable feature map runs in Python (attnx/_linear.py), and its
     * features enter the kernel as q and k */
    if (state->features) {
        mapped = PyObject_CallFunctionObjArgs(state->features, c.q, c.k, c.v, NULL);
        if (!mapped) return NULL;
        if (!PyTuple_Check(mapped) || PyTuple_GET_SIZE(mapped) != 2) {
            PyErr_SetString(PyExc_SystemError, "features must return (phi_q, phi_k)");
            goto done;
        }
        c.q = PyTuple_GET_ITEM(mapped, 0);
        c.k = PyTuple_GET_ITEM(mapped, 1);
    }
    if (!state->options) {
        PyErr_SetString(PyExc_ValueError,
                        "step() needs a state returned by an attnx call with return_state=True "
                        "(it remembers that call's feature map and options); this state was "
                        "built by hand");
        goto done;
    }
    if (!state->made_causal) {
        PyErr_SetString(PyExc_ValueError,
                        "step() continues causal decoding only: this state comes from a "
                        "non-causal call (causal=False)");
        goto done;
    }
    c.projection = PyTuple_GET_ITEM(state->options, 4);
    int lean = lean_step(state, &c, &ret);
    if (lean == 0) ret = run_linear(&c);
done:
    Py_XDECREF(mapped);
    return ret;
}

/* state.S: the held keys of single-token steps added in first */
static int state_flush(linear_state *state)
{
    PyArrayObject *S = (PyArrayObject *)state->S;
    attnx_pending pending;
    if (!S || !PyArray_Check(S) || PyArray_NDIM(S) < 2 || !PyArray_IS_C_CONTIGUOUS(S) ||
        !PyArray_ISWRITEABLE(S) || (PyArray_TYPE(S) != NPY_FLOAT && PyArray_TYPE(S) != NPY_DOUBLE)) {
        PyErr_SetString(PyExc_ValueError,
                        "this state holds decoding keys back from S, but its S was changed by "
                        "hand (no longer a writeable, C-contiguous float array)");
        return -1;
    }
    if (held_keys_of(state, S, &pending) < 0) return -1;
    held_keys_flush(state, S, &pending);
    return 0;
}

/* the options of the call that made a state, as it passed them (variant,
 * feature_map, causal, eps, projection, p, M), parsed for its steps: a
 * causal call of any length from the state */
static int state_set_options(linear_state *state, PyObject *options)
{
    if (!PyTuple_Check(options) || PyTuple_GET_SIZE(options) != 7 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(options, 0))) {
        PyErr_SetString(PyExc_ValueError,
                        "a LinearAttentionState's options are (variant, feature_map, causal, eps, "
                        "projection, p, M)");
        return -1;
    }
    const char *variant = PyUnicode_AsUTF8(PyTuple_GET_ITEM(options, 0));
    PyObject *const *item = &PyTuple_GET_ITEM(options, 0);
    linear_options step;
    int causal;
    if (!variant || attnx_parse_causal(item[2], &causal) < 0 ||
        parse_options(variant, item[1], Py_True, Py_None, Py_None, Py_None, item[3], item[5],
                      item[6], 1, &step) < 0)
        return -1;
    Py_INCREF(options);
    Py_XSETREF(state->options, options);
    state->step = step;
    state->made_causal = causal != 0;
    return 0;
}

/* the state a call with return_state=True returns: S, z and offset, and
 * with them, unless the call returned similarities (normalise=False), its
 * options for step() */
static PyObject *state_make(PyObject *S, PyObject *z, npy_intp offset, const linear_call *c,
                            PyArrayObject *projection)
{
    linear_state *state = (linear_state *)state_type.tp_alloc(&state_type, 0);
    if (!state) return NULL;
    Py_INCREF(S);
    Py_INCREF(z);
    Py_INCREF(Py_None);
    state->S = S;
    state->z = z;
    state->pending = Py_None;
    if (!(state->offset = PyLong_FromSsize_t((Py_ssize_t)offset))) goto fail;
    if (c->normalise) {
        PyObject *options = PyTuple_Pack(7, c->variant, c->feature_map, c->causal, c->eps,
                                         projection ? (PyObject *)projection : Py_None, c->p,
                                         c->M);
        int status = options ? state_set_options(state, options) : -1;
        Py_XDECREF(options);
        if (status < 0) goto fail;
        if (c->features != Py_None) {
            Py_INCREF(c->features);
            state->features = c->features;
        }
    }
    return (PyObject *)state;
fail:
    Py_DECREF(state);
    return NULL;
}

static PyObject *state_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    linear_state *state = (linear_state *)type->tp_alloc(type, 0);
    if (state) {
        Py_INCREF(Py_None);
        state->pending = Py_None;
    }
    return (PyObject *)state;
}

static int state_init(linear_state *state, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"S", "z", "offset", NULL};
    PyObject *S, *z, *offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:LinearAttentionState", keywords, &S, &z,
                                     &offset))
        return -1;
    Py_INCREF(S);
    Py_INCREF(z);
    Py_INCREF(offset);
    Py_INCREF(Py_None);
    Py_XSETREF(state->S, S);
    Py_XSETREF(state->z, z);
    Py_XSETREF(state->offset, offset);
    Py_XSETREF(state->pending, Py_None);
    Py_CLEAR(state->last_out);
    Py_CLEAR(state->options);
    Py_CLEAR(state->features);
    state->tick = 0;
    return 0;
}

static int state_traverse(linear_state *state, visitproc visit, void *arg)
{
    Py_VISIT(state->S);
    Py_VISIT(state->z);
    Py_VISIT(state->offset);
    Py_VISIT(state->pending);
    Py_VISIT(state->last_out);
    Py_VISIT(state->options);
    Py_VISIT(state->features);
    return 0;
}

static int state_clear(linear_state *state)
{
    Py_CLEAR(state->S);
    Py_CLEAR(state->z);
    Py_CLEAR(state->offset);
    Py_CLEAR(state->pending);
    Py_CLEAR(state->last_out);
    Py_CLEAR(state->options);
    Py_CLEAR(state->features);
    return 0;
}

static void state_dealloc(linear_state *state)
{
    PyObject_GC_UnTrack(state);
    state_clear(state);
    Py_TYPE(state)->tp_free((PyObject *)state);
}

static PyObject *state_get_S(linear_state *state, void *unused)
{
    if (state->tick && state_flush(state) < 0) return NULL;
    if (!state->S) {
        PyErr_SetString(PyExc_AttributeError, "'LinearAttentionState' object has no attribute 'S'");
        return NULL;
    }
    Py_INCREF(state->S);
    return state->S;
}

static int state_set_S(linear_state *state, PyObject *value, void *unused)
{
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "can't delete attribute 'S'");
        return -1;
    }
    Py_INCREF(value);
    Py_XSETREF(state->S, value);
    state->tick = 0;
    return 0;
}

static PyObject *state_get_options(linear_state *state, void *unused)
{
    PyObject *options = state->options ? state->options : Py_None;
    Py_INCREF(options);
    return options;
}

static int state_put_options(linear_state *state, PyObject *options, void *unused)
{
    if (options && options != Py_None) return state_set_options(state, options);
    Py_CLEAR(state->options);
    return 0;
}

static PyObject *state_repr(linear_state *state)
{
    PyObject *S = state_get_S(state, NULL), *ret = NULL;
    PyObject *S_dtype = S ? PyObject_GetAttrString(S, "dtype") : NULL;
    PyObject *S_shape = S_dtype ? PyObject_GetAttrString(S, "shape") : NULL;
    PyObject *z = S_shape ? PyObject_GetAttr((PyObject *)state, name_z) : NULL;
    PyObject *z_dtype = z ? PyObject_GetAttrString(z, "dtype") : NULL;
    PyObject *z_shape = z_dtype ? PyObject_GetAttrString(z, "shape") : NULL;
    PyObject *offset = z_shape ? PyObject_GetAttr((PyObject *)state, name_offset) : NULL;
    if (offset)
        ret = PyUnicode_FromFormat("LinearAttentionState(S: %S%S, z: %S%S, offset=%S)", S_dtype,
                                   S_shape, z_dtype, z_shape, offset);
    Py_XDECREF(S);
    Py_XDECREF(S_dtype);
    Py_XDECREF(S_shape);
    Py_XDECREF(z);
    Py_XDECREF(z_dtype);
    Py_XDECREF(z_shape);
    Py_XDECREF(offset);
    return ret;
}

/* pickle and copy: the constructor's arguments (S as it lies, held keys
 * apart), then the step's fields */
static PyObject *state_reduce(linear_state *state, PyObject *unused)
{
    if (!state->S || !state->z || !state->offset) {
        PyErr_SetString(PyExc_TypeError,
                        "cannot pickle a LinearAttentionState without its S, z or offset");
        return NULL;
    }
    return Py_BuildValue("O(OOO)(OOOn)", (PyObject *)Py_TYPE(state), state->S, state->z,
                         state->offset, state->options ? state->options : Py_None,
                         state->features ? state->features : Py_None,
                         state->pending ? state->pending : Py_None, state->tick);
}

static PyObject *state_setstate(linear_state *state, PyObject *fields)
{
    PyObject *options, *features, *pending;
    Py_ssize_t tick;
    if (!PyArg_ParseTuple(fields, "OOOn:__setstate__", &options, &features, &pending, &tick) ||
        (options != Py_None && state_set_options(state, options) < 0))
        return NULL;
    Py_INCREF(pending);
    Py_XSETREF(state->pending, pending);
    Py_CLEAR(state->features);
    if (features != Py_None) {
        Py_INCREF(features);
        state->features = features;
    }
    state->tick = tick;
    Py_RETURN_NONE;
}

static PyMethodDef state_methods[] = {
    {"step", (PyCFunction)(void (*)(void))state_step, METH_FASTCALL | METH_KEYWORDS,
    "step($self, q, k, v, out=None)\n"
    "--\n"
    "\n"
    "Decode in place: attend the new queries to every key so far.\n"
    "\n"
    "Returns what ``linear_attention(q, k, v, causal=True,\n"
    "initial_state=state, return_state=True)`` (or the front end that made the\n"
    "state, with that call's options) returns as output, but absorbs the new\n"
    "keys and values into this state's own ``S`` and ``z`` and advances\n"
    "``offset``, so a step allocates nothing but its output.\n"
    "\n"
    "Parameters\n"
    "----------\n"
    "q : array_like, shape (..., t, d)\n"
    "    The new queries (any number t of new tokens).\n"
    "k : array_like, shape (..., t, d)\n"
    "    The new keys.\n"
    "v : array_like, shape (..., t, e)\n"
    "    The new values. The batch shape must be the state's.\n"
    "out : ndarray, optional\n"
    "    Receives the output, shape (..., t, e) in the state's dtype.\n"
    "\n"
    "Returns\n"
    "-------\n"
    "ndarray, shape (..., t, e)\n"
    "    The outputs of the new queries, causal over every key so far.\n"
    "\n"
    "Raises\n"
    "------\n"
    "ValueError\n"
    "    A state that was not returned by a causal call with\n"
    "    ``return_state=True``, arrays S and z no longer writeable and\n"
    "    C-contiguous, or shapes that do not match the state.\n"
    "TypeError\n"
    "    Inputs or an ``out`` of another dtype than the state's.\n"
    "\n"
    "See Also\n"
    "--------\n"
    "linear_attention : The call whose ``return_state=True`` makes a state.\n"
    "\n"
    "Notes\n"
    "-----\n"
    "With S and z the state's sums over the keys so far, each new token t\n"
    "updates ``S += psi(k_t) v_t^T`` and ``z += psi(k_t)`` and outputs\n"
    "``phi(q_t) S / max(phi(q_t) . z, eps)``. A one-token step holds its key\n"
    "back from S and adds held keys 4 at a time; reading ``state.S`` adds them\n"
    "in first, so S is always exact when read. A step finishes even on Ctrl-C\n"
    "(stopped half-way it would leave the state half updated).\n"
    "\n"
    "Examples\n"
    "--------\n"
    ">>> import numpy as np, attnx\n"
    ">>> rng = np.random.default_rng(0)\n"
    ">>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))\n"
    ">>> o, state = attnx.linear_attention(q[:4], k[:4], v[:4], causal=True, return_state=True)\n"
    ">>> o5 = state.step(q[4:5], k[4:5], v[4:5])\n"
    ">>> o6 = state.step(q[5:], k[5:], v[5:])\n"
    ">>> state.offset\n"
    "6\n"
    ">>> whole = attnx.linear_attention(q, k, v, causal=True)\n"
    ">>> np.allclose(np.concatenate([o, o5, o6]), whole)\n"
    "True"},
    {"__reduce__", (PyCFunction)state_reduce, METH_NOARGS, NULL},
    {"__setstate__", (PyCFunction)state_setstate, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef state_getset[] = {
    {"S", (getter)state_get_S, (setter)state_set_S,
     "``sum_j psi(k_j) v_j^T`` over every key so far (held keys added in).", NULL},
    {"_options", (getter)state_get_options, (setter)state_put_options,
     "The options of the call that made the state (variant, feature_map, causal, eps, "
     "projection, p, M), None when it cannot step.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef state_members[] = {
    {"z", T_OBJECT_EX, offsetof(linear_state, z), 0, "``sum_j psi(k_j)``."},
    {"offset", T_OBJECT_EX, offsetof(linear_state, offset), 0,
     "How many key positions were consumed."},
    {"_S", T_OBJECT_EX, offsetof(linear_state, S), 0, "S as it lies, held keys apart."},
    {"_pending", T_OBJECT_EX, offsetof(linear_state, pending), 0,
     "The keys single-token steps hold back from S."},
    {"_tick", T_PYSSIZET, offsetof(linear_state, tick), 0,
     "The single-token steps since S last held every key."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject state_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "attnx._linear.LinearAttentionState",
    .tp_basicsize = sizeof(linear_state),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc =
"LinearAttentionState(S, z, offset)\n"
"--\n"
"\n"
"The state kernelised attention carries between calls.\n"
"\n"
"Returned by ``return_state=True`` and taken back by ``initial_state=``\n"
"(streaming a long sequence in pieces, decoding), or advanced in place by\n"
"`step`.\n"
"\n"
"Parameters\n"
"----------\n"
"S : ndarray, shape (..., r, e)\n"
"    ``sum_j psi(k_j) v_j^T`` over the keys seen.\n"
"z : ndarray, shape (..., r)\n"
"    ``sum_j psi(k_j)``.\n"
"offset : int\n"
"    How many key positions were consumed (cosFormer numbers the next\n"
"    call's positions after it).\n"
"\n"
"Methods\n"
"-------\n"
"step(q, k, v, out=None)\n"
"    Decode in place: the outputs of new tokens, their keys and values\n"
"    absorbed into this state.\n"
"\n"
"Raises\n"
"------\n"
"ValueError\n"
"    From `step`, for a state that cannot step (see there).\n"
"\n"
"See Also\n"
"--------\n"
"linear_attention : Returns a state with ``return_state=True``.\n"
"\n"
"Notes\n"
"-----\n"
"The arrays have the dtype the calls compute in (float32 for float16\n"
"inputs) and the broadcast batch shape of the calls. FAVOR+ key features\n"
"are stored divided by the constant ``exp(c)``, ``c = max_f |W_f|^2 /\n"
"2``, so a state only continues calls with the same feature map and\n"
"projection.\n"
"\n"
"Passing a state as ``initial_state=`` never writes it; `step` is the\n"
"in-place alternative, which allocates nothing but its output (none with\n"
"``out=``, nor when the output of the state's last step is no longer\n"
"held anywhere: the new one takes its memory).\n"
"\n"
"A step of one token holds its key back from ``S`` (``z`` takes it at\n"
"once) and adds the keys a head holds into ``S`` 4 at a time, the heads\n"
"taking turns; its output counts them all. Most steps then only read\n"
"``S`` instead of reading and writing it, which halves a step's memory\n"
"traffic. Reading ``state.S`` (or passing the state as\n"
"``initial_state=``, or a step of several tokens) first adds every held\n"
"key in, in order. The state owns its arrays: an array taken from it\n"
"earlier changes with it (copy it to keep a snapshot), but between reads\n"
"of ``state.S`` it lags by the held keys. Assigning ``state.S`` replaces\n"
"the sum of every key so far, held ones included. Only a state returned\n"
"by a causal call with ``return_state=True`` can step, while ``S`` and\n"
"``z`` stay writeable, C-contiguous arrays of the computing dtype with\n"
"the batch shape of the step's q, k, v.\n"
"\n"
"Examples\n"
"--------\n"
">>> import numpy as np, attnx\n"
">>> rng = np.random.default_rng(0)\n"
">>> q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))\n"
">>> o1, state = attnx.linear_attention(q[:, :6], k[:, :6], v[:, :6], causal=True,\n"
"...                                    return_state=True)\n"
">>> state\n"
"LinearAttentionState(S: float64(2, 4, 4), z: float64(2, 4), offset=6)\n"
">>> o2, state = attnx.linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], causal=True,\n"
"...                                    initial_state=state, return_state=True)\n"
">>> whole = attnx.linear_attention(q, k, v, causal=True)\n"
">>> np.allclose(np.concatenate([o1, o2], axis=1), whole)\n"
"True",
    .tp_new = state_new,
    .tp_init = (initproc)state_init,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_traverse = (traverseproc)state_traverse,
    .tp_clear = (inquiry)state_clear,
    .tp_repr = (reprfunc)state_repr,
    .tp_methods = state_methods,
    .tp_getset = state_getset,
    .tp_members = state_members,
};

int attnx_linear_init(PyObject *module)
{
    name_S = PyUnicode_InternFromString("S");
    name_z = PyUnicode_InternFromString("z");
    name_offset = PyUnicode_InternFromString("offset");
    default_feature_map = PyUnicode_InternFromString("elu");
    default_eps = PyFloat_FromDouble(1e-6);
    default_p = PyLong_FromLong(3);
    if (!name_S || !name_z || !name_offset || !default_feature_map || !default_eps ||
        !default_p || PyType_Ready(&state_type) < 0)
        return -1;
    Py_INCREF(&state_type);
    if (PyModule_AddObject(module, "LinearAttentionState", (PyObject *)&state_type) < 0) {
        Py_DECREF(&state_type);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * The backward (linear.c, attnx_linear_bwd): _C.linear_attention_backward
 * takes every option by name from attnx/_linear_grad.py (the variant by
 * its front end's name, checked as the forward checks it, the streaming
 * offset as a number), and returns the gradients on the broadcast batch
 * shape, which the Python side reduces to each input's shape. */

/* Chunk length of the backward's chunk method. Causal, chunks of 16 run
 * through fused AVX-512 kernels in float32 (linear.c, bwd_fused_chunk) and
 * the general steps are no slower there than at 32. Non-causal there is
 * no C x C block, and longer blocks run the GEMMs faster
 * (docs/performance.md, the C code's choices). */
#define DEFAULT_BACKWARD_CHUNK 16
#define DEFAULT_NONCAUSAL_BACKWARD_CHUNK 128

typedef int (*linear_bwd_kernel)(const attnx_linear_bwd_args *);
static const linear_bwd_kernel linear_bwd_kernels[2] = {attnx_linear_bwd_f32,
                                                        attnx_linear_bwd_f64};

enum { B_DOUT, B_Q, B_K, B_V, B_KEY_MASK, B_MASK, B_S0, B_Z0, B_DS_IN, B_DZ_IN, B_DQ, B_DK,
       B_DV, B_DS0, B_DZ0, B_NPARAMS };
static const attnx_param backward_params[B_NPARAMS] = {
    [B_DOUT] = {"dout", "n e", ATTNX_REQUIRED, ATTNX_LINB_DOUT},
    [B_Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_LINB_Q},
    [B_K] = {"k", "m d", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_LINB_K},
    [B_V] = {"v", "m e", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_LINB_V},
    [B_KEY_MASK] = {"key_mask", "m|1", ATTNX_BOOL, ATTNX_LINB_KEY_MASK},
    [B_MASK] = {"mask", "n|1 m|1", ATTNX_BOOL, ATTNX_LINB_MASK},
    [B_S0] = {"initial_state.S", "r e", 0, ATTNX_LINB_S0},
    [B_Z0] = {"initial_state.z", "r", 0, ATTNX_LINB_Z0},
    [B_DS_IN] = {"grad_state S", "r e", 0, ATTNX_LINB_DS_IN},
    [B_DZ_IN] = {"grad_state z", "r", 0, ATTNX_LINB_DZ_IN},
    [B_DQ] = {"dq", "n d", ATTNX_OUTPUT, ATTNX_LINB_DQ},
    [B_DK] = {"dk", "m d", ATTNX_OUTPUT, ATTNX_LINB_DK},
    [B_DV] = {"dv", "m e", ATTNX_OUTPUT, ATTNX_LINB_DV},
    [B_DS0] = {"dS", "r e", ATTNX_OUTPUT, ATTNX_LINB_DS0},
    [B_DZ0] = {"dz", "r", ATTNX_OUTPUT, ATTNX_LINB_DZ0},
};

PyObject *attnx_py_linear_attention_backward(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "dout", "q", "k", "v", "front", "feature_map", "causal", "key_mask", "mask", "window",
        "method", "chunk_size", "eps", "p", "M", "projection", "S0", "z0", "dS", "dz", "offset",
        "projection_grad", "dq", "dk", "dv", NULL};
    PyObject *objs[B_NPARAMS] = {NULL}, *feature_map_obj, *causal_obj, *window_obj, *method_obj,
             *chunk_obj, *eps_obj, *p_obj, *M_obj, *projection_obj, *ret = NULL;
    const char *front;
    int projection_grad;
    Py_ssize_t offset;
    linear_options o = {0};
    objs[B_DQ] = objs[B_DK] = objs[B_DV] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOOsOOOOOOOOOOOOOOOnp|OOO:linear_attention_backward", keywords,
            &objs[B_DOUT], &objs[B_Q], &objs[B_K], &objs[B_V], &front, &feature_map_obj,
            &causal_obj, &objs[B_KEY_MASK], &objs[B_MASK], &window_obj, &method_obj, &chunk_obj,
            &eps_obj, &p_obj, &M_obj, &projection_obj, &objs[B_S0], &objs[B_Z0], &objs[B_DS_IN],
            &objs[B_DZ_IN], &offset, &projection_grad, &objs[B_DQ], &objs[B_DK], &objs[B_DV]))
        return NULL;
    if (offset < 0) {
        PyErr_SetString(PyExc_ValueError, "linear_attention_backward: offset must be >= 0");
        return NULL;
    }
    if ((objs[B_S0] == Py_None) != (objs[B_Z0] == Py_None) ||
        (objs[B_DS_IN] == Py_None) != (objs[B_DZ_IN] == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a state needs both S and z");
        return NULL;
    }
    if (parse_options(front, feature_map_obj, causal_obj, window_obj, method_obj, chunk_obj,
                      eps_obj, p_obj, M_obj,
                      objs[B_S0] != Py_None || objs[B_DS_IN] != Py_None, &o) < 0)
        return NULL;
    o.backward = 1;
    if (projection_grad && o.kind != ATTNX_FM_FAVOR) {
        PyErr_SetString(PyExc_ValueError,
                        "projection_grad=True needs feature_map='favor' (performer_attention)");
        return NULL;
    }

    PyArrayObject *projection = NULL, *dW = NULL;
    attnx_call call;
    attnx_call_init(&call, backward_params, B_NPARAMS, ATTNX_LINB_NOPS, "demr");
    call.legend = "r: the features of this feature map";
    if (check_cumsum_size(&o, objs[B_Q], objs[B_K], objs[B_V], projection_obj) < 0 ||
        feature_size(&o, projection_obj, &call) < 0)
        goto done;
    objs[B_DS0] = objs[B_S0] != Py_None ? Py_None : NULL;
    objs[B_DZ0] = objs[B_S0] != Py_None ? Py_None : NULL;
    if (attnx_bind(&call, objs) < 0) goto done;

    npy_intp n = attnx_size(&call, 'n'), m = attnx_size(&call, 'm'), d = attnx_size(&call, 'd'),
             e = attnx_size(&call, 'e'), r = attnx_size(&call, 'r');
    int typenum = call.dtypes.compute;
    if (o.kind == ATTNX_FM_FAVOR && projection_convert(projection_obj, &call, &projection) < 0)
        goto done;
    if (o.kind == ATTNX_FM_IDENTITY &&
        (check_nonnegative(&call.ops[B_Q]) < 0 || check_nonnegative(&call.ops[B_K]) < 0))
        goto done;
    if (resolve_method(&o, call.ops[B_MASK].array != NULL, n) < 0 ||
        check_period(&o, n, m, offset) < 0)
        goto done;
    npy_intp chunk = o.chunk;
    if (projection_grad) {
        npy_intp W_shape[2] = {r, d};
        if (!(dW = (PyArrayObject *)PyArray_ZEROS(2, W_shape, typenum, 0))) goto done;
    }
    npy_intp longest = n > m ? n : m;
    if (chunk == 0)
        chunk = o.method == ATTNX_METHOD_CHUNK && !o.causal ? DEFAULT_NONCAUSAL_BACKWARD_CHUNK
                                                            : DEFAULT_BACKWARD_CHUNK;
    if (chunk > longest) chunk = longest > 0 ? longest : 1;
    PyArrayObject *S0_array = call.ops[B_S0].array, *dS_array = call.ops[B_DS_IN].array;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    attnx_linear_bwd_args kargs = {
        .n = n, .m = m, .d = d, .e = e, .heads = call.batch.heads, .offsets = call.offsets,
        .q = attnx_data(&call, B_Q), .k = attnx_data(&call, B_K), .v = attnx_data(&call, B_V),
        .dout = attnx_data(&call, B_DOUT),
        .key_mask = attnx_data(&call, B_KEY_MASK), .mask = attnx_data(&call, B_MASK),
        .S0 = attnx_data(&call, B_S0), .z0 = attnx_data(&call, B_Z0),
        .dS_in = attnx_data(&call, B_DS_IN), .dz_in = attnx_data(&call, B_DZ_IN),
        .dq = attnx_data(&call, B_DQ), .dk = attnx_data(&call, B_DK), .dv = attnx_data(&call, B_DV),
        .dS0 = attnx_data(&call, B_DS0), .dz0 = attnx_data(&call, B_DZ0),
        .dW = dW ? PyArray_DATA(dW) : NULL,
        .q_row = attnx_row_stride(call.ops[B_Q].array),
        .k_row = attnx_row_stride(call.ops[B_K].array),
        .v_row = attnx_row_stride(call.ops[B_V].array),
        .dout_row = attnx_row_stride(call.ops[B_DOUT].array),
        .dq_row = attnx_row_stride(call.ops[B_DQ].array),
        .dk_row = attnx_row_stride(call.ops[B_DK].array),
        .dv_row = attnx_row_stride(call.ops[B_DV].array),
        .S0_row = S0_array ? attnx_row_stride(S0_array) : e,
        .dS_in_row = dS_array ? attnx_row_stride(dS_array) : e,
        .key_mask_col = attnx_core_stride(&call, B_KEY_MASK, -1),
        .mask_row = attnx_core_stride(&call, B_MASK, -2),
        .mask_col = attnx_core_stride(&call, B_MASK, -1),
        .features = options_features(&o, d, r, projection, offset),
        .band = options_band(&o, n, m),
        .method = o.method,
        .chunk = chunk,
        .eps = o.eps,
        .num_threads = attnx_get_num_threads(),
        .interrupt = interruptible(call.batch.heads, n, m, r, e, o.method == ATTNX_METHOD_QUADRATIC)
                         ? &interrupt : NULL,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = linear_bwd_kernels[typenum == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0) goto done;
    ret = Py_BuildValue("OOOOOO", call.results[B_DQ], call.results[B_DK], call.results[B_DV],
                        dW ? (PyObject *)dW : Py_None,
                        S0_array ? (PyObject *)call.results[B_DS0] : Py_None,
                        S0_array ? (PyObject *)call.results[B_DZ0] : Py_None);
done:
    Py_XDECREF(projection);
    Py_XDECREF(dW);
    attnx_call_release(&call);
    return ret;
}

/* _C.linear_variants(): {front: (function, the feature map it fixes or
 * None)} from the variant table */
PyObject *attnx_py_linear_variants(PyObject *self, PyObject *unused)
{
    PyObject *table = PyDict_New();
    for (int i = 0; table && i < COUNT(linear_variants); i++) {
        const linear_variant *variant = &linear_variants[i];
        PyObject *row = variant->kind < 0
                            ? Py_BuildValue("(sO)", variant->function, Py_None)
                            : Py_BuildValue("(ss)", variant->function,
                                            feature_map_names[variant->kind]);
        if (!row || PyDict_SetItemString(table, variant->front, row) < 0) Py_CLEAR(table);
        Py_XDECREF(row);
    }
    return table;
}

/* the first axis of `obj`'s shape (an array or a tensor, a fake one too) */
static int leading_size(PyObject *obj, npy_intp *size)
{
    PyObject *shape = PyObject_GetAttrString(obj, "shape");
    PyObject *first = shape && PySequence_Check(shape) && PySequence_Size(shape) == 2
                          ? PySequence_GetItem(shape, 0) : NULL;
    if (!first && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "projection must have shape (r, d)");
    Py_XDECREF(shape);
    if (!first) return -1;
    *size = PyNumber_AsSsize_t(first, PyExc_OverflowError);
    Py_DECREF(first);
    return *size == -1 && PyErr_Occurred() ? -1 : 0;
}

/* _C.linear_resolve: the checks of a call's options that need no arrays,
 * for the front ends that build the call elsewhere (attnx.torch,
 * attnx.dask) */
PyObject *attnx_py_linear_resolve(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"front", "feature_map", "causal", "window", "method",
                               "chunk_size", "eps", "p", "M", "projection", "mask", "d", "n", "m",
                               "streaming", NULL};
    const char *front;
    PyObject *feature_map = Py_None, *causal = Py_False, *window = Py_None, *method = Py_None,
             *chunk = Py_None, *eps = NULL, *p = NULL, *M = Py_None, *projection = Py_None,
             *n_obj = Py_None, *m_obj = Py_None;
    int has_mask = 0, streaming = 0;
    Py_ssize_t d = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|$OOOOOOOOOpnOOp:linear_resolve", keywords,
                                     &front, &feature_map, &causal, &window, &method, &chunk, &eps,
                                     &p, &M, &projection, &has_mask, &d, &n_obj, &m_obj,
                                     &streaming))
        return NULL;
    PyObject *default_eps = eps ? NULL : PyFloat_FromDouble(1e-6);
    PyObject *default_p = p ? NULL : PyLong_FromLong(3);
    linear_options o;
    int status = (eps || default_eps) && (p || default_p)
                     ? parse_options(front, feature_map, causal, window, method, chunk,
                                     eps ? eps : default_eps, p ? p : default_p, M, streaming, &o)
                     : -1;
    Py_XDECREF(default_eps);
    Py_XDECREF(default_p);
    if (status < 0) return NULL;
    npy_intp features = 0, n = 0, m = 0;
    if (o.kind == ATTNX_FM_FAVOR ? projection != Py_None && leading_size(projection, &features) < 0
                                 : (features = fixed_feature_size(o.kind, d), 0))
        return NULL;
    if ((n_obj != Py_None && (n = PyNumber_AsSsize_t(n_obj, PyExc_OverflowError)) == -1 &&
         PyErr_Occurred()) ||
        (m_obj != Py_None && (m = PyNumber_AsSsize_t(m_obj, PyExc_OverflowError)) == -1 &&
         PyErr_Occurred()))
        return NULL;
    if (resolve_method(&o, has_mask, n_obj == Py_None ? RECURRENT_MAX_ROWS + 1 : n) < 0 ||
        (n_obj != Py_None && m_obj != Py_None && check_period(&o, n, m, 0) < 0))
        return NULL;
    PyObject *period = o.kind == ATTNX_FM_COSFORMER && o.period > 0 ? PyFloat_FromDouble(o.period)
                                                                    : (Py_INCREF(Py_None), Py_None);
    PyObject *result = period ? Py_BuildValue("{s:s,s:n,s:s,s:O}", "feature_map",
                                              feature_map_names[o.kind], "features",
                                              (Py_ssize_t)features, "method",
                                              method_names[o.method], "M", period)
                              : NULL;
    Py_XDECREF(period);
    return result;
}

const char attnx_linear_attention_doc[] = (
"linear_attention(q, k, v, *, variant, feature_map='elu', causal=False, key_mask=None, mask=None, window=None, method=None, chunk_size=None, eps=1e-06, projection=None, p=3, M=None, initial_state=None, return_state=False, out=None, normalise=True, features=None)\n"
"--\n\n"
"The kernel behind attnx.linear_attention and the other kernelised front ends\n"
"(use those). Returns out, or (out, state) with return_state: a\n"
"LinearAttentionState that remembers this call's options for its steps, and\n"
"`features`, a callable feature map's (q, k, v) -> (phi_q, phi_k) that they\n"
"apply (q and k here are already its features).");

const char attnx_linear_attention_backward_doc[] = (
"linear_attention_backward(dout, q, k, v, front, feature_map, causal, key_mask, mask, window, method, chunk_size, eps, p, M, projection, S0, z0, dS, dz, offset, projection_grad, dq=None, dk=None, dv=None)\n"
"--\n\n"
"The kernel behind attnx.linear_attention_backward and the other kernelised\n"
"backward functions (options checked as the forward checks them; use those).\n"
"Returns (dq, dk, dv, dW, dS0, dz0) on the broadcast batch shape.");

const char attnx_linear_variants_doc[] = (
"linear_variants()\n"
"--\n\n"
"The kernelised family's variants: {front end name: (function name, the\n"
"feature map it fixes, or None where feature_map= chooses)}.");

const char attnx_linear_resolve_doc[] = (
"linear_resolve(front, *, feature_map=None, causal=False, window=None, method=None, chunk_size=None, eps=1e-6, p=3, M=None, projection=None, mask=False, d=0, n=None, m=None, streaming=False)\n"
"--\n\n"
"Checks the options of variant `front` as its kernel call would, without\n"
"arrays: {'feature_map': its name, 'features': r for d inputs (favor: the\n"
"projection's rows), 'method': the method it runs (n unknown: as for many\n"
"rows), 'M': cosFormer's period (checked against n and m when both are\n"
"given), else None}.");
