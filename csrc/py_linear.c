/* py_linear.c - the Python entry of kernelised (linear) attention: parse,
 * validate, allocate, release the GIL, call linear.c.
 *
 * One private function, _C.linear_attention, takes every option in a fixed
 * order; the public front ends (attnx/_linear.py) are thin wrappers around
 * it, so that all validation happens here, in C, and a decoding step pays
 * for no numpy work in Python. _C.linear_step, behind
 * LinearAttentionState.step, is the same call with the options the state
 * remembers, writing the new state into the state's own arrays. */
#include "args.h"
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

/* The attributes of a LinearAttentionState, interned once: a decoding
 * step reads six of them and writes two, and a name made from a C string
 * on every call costs about as much as the lookup. `S` is a property that
 * first adds the held keys (below); a step reads the array behind it. */
static PyObject *name_S, *name_own_S, *name_z, *name_offset, *name_options, *name_pending,
    *name_tick, *name_features;

int attnx_linear_names_init(void)
{
    name_S = PyUnicode_InternFromString("S");
    name_own_S = PyUnicode_InternFromString("_S");
    name_z = PyUnicode_InternFromString("z");
    name_offset = PyUnicode_InternFromString("offset");
    name_options = PyUnicode_InternFromString("_options");
    name_pending = PyUnicode_InternFromString("_pending");
    name_tick = PyUnicode_InternFromString("_tick");
    name_features = PyUnicode_InternFromString("_features");
    return name_S && name_own_S && name_z && name_offset && name_options && name_pending &&
                   name_tick && name_features
               ? 0
               : -1;
}

/* Single-token steps hold their keys back from S (linear.c,
 * deferred_step) in state._pending, a pair of arrays (..., HELD_KEYS, r)
 * and (..., HELD_KEYS, e), for state._tick steps (attnx.h, attnx_pending).
 * A step of several tokens, or reading state.S, first adds them in.
 * Holding keys beat the RNN step that writes S each time, and with the
 * AVX-512 decoding kernel 4 held keys were as fast as any count tried
 * (docs/performance.md, the C code's choices). */
#define HELD_KEYS 4

/* initial_state: its S (new references; NULL for None), z and offset;
 * S through the property, or, for a step (own), the array behind it */
static int state_get(PyObject *state, int own, PyObject **S, PyObject **z, npy_intp *offset)
{
    *S = *z = NULL;
    *offset = 0;
    if (state == Py_None) return 0;
    PyObject *S_name = own ? name_own_S : name_S;
    if (!own) {
        /* a LinearAttentionState's S without its property's Python call:
         * the held keys added in when there are any (what the property
         * does), then the array behind it; other objects through S */
        PyObject *tick = PyObject_GetAttr(state, name_tick);
        if (tick) {
            int held = PyObject_IsTrue(tick);
            Py_DECREF(tick);
            PyObject *flushed = held > 0 ? attnx_py_linear_flush(NULL, state) : NULL;
            if (held < 0 || (held > 0 && !flushed)) return -1;
            Py_XDECREF(flushed);
            S_name = name_own_S;
        } else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
        } else {
            return -1;
        }
    }
    *S = PyObject_GetAttr(state, S_name);
    *z = *S ? PyObject_GetAttr(state, name_z) : NULL;
    PyObject *offset_obj = *z ? PyObject_GetAttr(state, name_offset) : NULL;
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

/* The held keys of a stepping state whose S is (..., r, e): the arrays
 * of state._pending when they fit S (pending->psi NULL when there are
 * none yet, or S was replaced), and state._tick. The arrays are the
 * state's private ones, made by hold_keys; held keys that do not fit S
 * were set by hand. */
static int held_keys_of(PyObject *tick_obj, PyObject *pair, PyArrayObject *S,
                        attnx_pending *pending)
{
    pending->psi = pending->v = NULL;
    pending->capacity = HELD_KEYS;
    pending->tick = PyLong_Check(tick_obj) ? PyLong_AsSsize_t(tick_obj) : -1;
    int nd = PyArray_NDIM(S), fits = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
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
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError,
                    "this state's held decoding keys (_pending, _tick) do not fit its S: they "
                    "were changed by hand; assign state.S to start again from a given S");
    return -1;
}

/* held_keys_of the state's _tick and _pending */
static int held_keys_get(PyObject *state, PyArrayObject *S, attnx_pending *pending)
{
    PyObject *tick_obj = PyObject_GetAttr(state, name_tick);
    PyObject *pair = tick_obj ? PyObject_GetAttr(state, name_pending) : NULL;
    int status = pair ? held_keys_of(tick_obj, pair, S, pending) : -1;
    Py_XDECREF(tick_obj);
    Py_XDECREF(pair);
    return status;
}

/* obj.name = value */
static int set_int_attr(PyObject *obj, PyObject *name, Py_ssize_t value)
{
    PyObject *number = PyLong_FromSsize_t(value);
    int status = number ? PyObject_SetAttr(obj, name, number) : -1;
    Py_XDECREF(number);
    return status;
}

/* the held keys into S, with the GIL released; the state then holds none */
static int held_keys_flush(PyObject *state, PyArrayObject *S, const attnx_pending *pending)
{
    npy_intp nd = PyArray_NDIM(S), r = PyArray_DIM(S, nd - 2), e = PyArray_DIM(S, nd - 1);
    npy_intp heads = PyArray_SIZE(S) / (r * e > 0 ? r * e : 1);
    int threads = attnx_get_num_threads();
    if (pending->tick == 0) return 0;
    Py_BEGIN_ALLOW_THREADS
    flush_kernels[PyArray_TYPE(S) == NPY_DOUBLE](PyArray_DATA(S), pending, heads, r, e, threads);
    Py_END_ALLOW_THREADS
    return set_int_attr(state, name_tick, 0);
}

/* A single-token step's keys go into state._pending, made when there are
 * no arrays that fit S. */
static int hold_keys(PyObject *state, const attnx_batch *batch, npy_intp r, npy_intp e,
                     int typenum, attnx_pending *pending)
{
    if (pending->psi) return 0;
    npy_intp keys_shape[2] = {HELD_KEYS, r}, values_shape[2] = {HELD_KEYS, e};
    PyArrayObject *keys = attnx_new_aligned_array(batch, keys_shape, 2, typenum);
    PyArrayObject *values = keys ? attnx_new_aligned_array(batch, values_shape, 2, typenum) : NULL;
    PyObject *pair = values ? PyTuple_Pack(2, keys, values) : NULL;
    int status = pair ? PyObject_SetAttr(state, name_pending, pair) : -1;
    if (status == 0) {
        pending->psi = PyArray_DATA(keys);
        pending->v = PyArray_DATA(values);
    }
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(pair);
    return status;
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
    PyObject *q, *k, *v, *feature_map, *causal, *key_mask, *mask, *window, *method, *chunk_size,
        *eps, *projection, *p, *M, *initial_state, *out;
    const char *variant;
    int return_state, normalise;
    int in_place;  /* a decoding step: initial_state's own S, z receive the new state */
} linear_call;

static PyObject *run_linear(const linear_call *c)
{
    PyObject *initial_state = c->initial_state, *S_obj = NULL, *z_obj = NULL, *ret = NULL;
    PyArrayObject *projection = NULL;
    linear_options o;
    attnx_call call;
    npy_intp offset;
    attnx_call_init(&call, c->in_place ? step_params : linear_params, NPARAMS, ATTNX_LIN_NOPS,
                    "demr");
    call.legend = "r: the features of this feature map";
    if (parse_options(c->variant, c->feature_map, c->causal, c->window, c->method, c->chunk_size,
                      c->eps, c->p, c->M, initial_state != Py_None || c->return_state, &o) < 0 ||
        check_cumsum_size(&o, c->q, c->k, c->v, c->projection) < 0 ||
        feature_size(&o, c->projection, &call) < 0 ||
        state_get(initial_state, c->in_place, &S_obj, &z_obj, &offset) < 0)
        goto done;
    PyObject *const objs[NPARAMS] = {
        [Q] = c->q, [K] = c->k, [V] = c->v, [KEY_MASK] = c->key_mask, [MASK] = c->mask,
        [S0] = S_obj, [Z0] = z_obj, [OUT] = c->out,
        [S_OUT] = c->in_place ? S_obj : c->return_state ? Py_None : NULL,
        [Z_OUT] = c->in_place ? z_obj : c->return_state ? Py_None : NULL,
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
    int deferred = c->in_place && n == 1 && m == 1 && o.method == ATTNX_METHOD_RECURRENT;
    PyArrayObject *S0_array = call.ops[S0].array;
    if (c->in_place &&
        (held_keys_get(initial_state, S0_array, &pending) < 0 ||
         (deferred ? hold_keys(initial_state, &call.batch, r, e, call.dtypes.compute, &pending)
                   : held_keys_flush(initial_state, S0_array, &pending)) < 0))
        goto done;
    if (!deferred) pending.psi = NULL;

    attnx_interrupt interrupt = attnx_interrupt_for_call();
    int stoppable = !c->in_place &&
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
    if (c->in_place) {
        if (set_int_attr(initial_state, name_offset, (Py_ssize_t)(offset + m)) == 0 &&
            (!deferred || set_int_attr(initial_state, name_tick,
                                       attnx_pending_next(pending.tick, HELD_KEYS)) == 0)) {
            ret = result;
            Py_INCREF(ret);
        }
    } else if (c->return_state) {
        PyObject *next_offset = PyLong_FromSsize_t((Py_ssize_t)(offset + m));
        ret = next_offset ? PyTuple_Pack(4, result, call.results[S_OUT], call.results[Z_OUT],
                                         next_offset) : NULL;
        Py_XDECREF(next_offset);
    } else {
        ret = result;
        Py_INCREF(ret);
    }
done:
    attnx_call_release(&call);
    Py_XDECREF(projection);
    Py_XDECREF(S_obj);
    Py_XDECREF(z_obj);
    return ret;
}

/* A flag passed as any object, by its truth (what "p" of PyArg_ParseTuple does) */
static int flag_of(PyObject *obj, int *flag)
{
    *flag = PyObject_IsTrue(obj);
    return *flag < 0 ? -1 : 0;
}

/* METH_FASTCALL: the arguments come as an array, not a tuple parsed by a
 * format string (which took a tenth of a decoding call's binding) */
PyObject *attnx_py_linear_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 19) {
        PyErr_Format(PyExc_TypeError, "linear_attention takes 19 positional arguments (%zd given)",
                     nargs);
        return NULL;
    }
    linear_call c = {.q = args[0], .k = args[1], .v = args[2], .feature_map = args[4],
                     .causal = args[5], .key_mask = args[6], .mask = args[7], .window = args[8],
                     .method = args[9], .chunk_size = args[10], .eps = args[11],
                     .projection = args[12], .p = args[13], .M = args[14],
                     .initial_state = args[15], .out = args[17], .in_place = 0};
    if (!PyUnicode_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "linear_attention: variant must be a str");
        return NULL;
    }
    if (!(c.variant = PyUnicode_AsUTF8(args[3])) || flag_of(args[16], &c.return_state) < 0 ||
        flag_of(args[18], &c.normalise) < 0)
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

/* LinearAttentionState (attnx/_linear.py) as the binding knows it,
 * registered once by _C.state_class: the offsets of its slots, which the
 * lean step of that exact class reads and writes in place (getattr and
 * setattr of eight of them took a seventh of a one-head step), and the
 * function that applies a callable feature map. Another class, a subclass
 * included, goes the general way, through getattr. */
enum { SLOT_S, SLOT_Z, SLOT_OFFSET, SLOT_OPTIONS, SLOT_FEATURES, SLOT_PENDING, SLOT_TICK, SLOT_OUT,
       NSLOTS };
static const char *const slot_names[NSLOTS] = {"_S", "z", "offset", "_options", "_features",
                                               "_pending", "_tick", "_out"};
static PyTypeObject *state_type;
static Py_ssize_t slot_offsets[NSLOTS];
static PyObject *callable_features;

/* slot i of a state of exactly state_type (borrowed; NULL when unset) */
static PyObject *slot_get(PyObject *state, int i)
{
    return *(PyObject **)((char *)state + slot_offsets[i]);
}

/* slot i = value (a new reference, which the slot takes) */
static void slot_put(PyObject *state, int i, PyObject *value)
{
    PyObject **slot = (PyObject **)((char *)state + slot_offsets[i]);
    Py_XSETREF(*slot, value);
}

#define LEAN_HEADS 64

/* The options of the last lean step, parsed: state._options is made once
 * per state, so while it is the same tuple of the same immutable values
 * (the tuple is held here, so its address is not reused) its parse is the
 * same (parsing took a tenth of a one-head step). */
static PyObject *lean_options_of;
static linear_options lean_options;

/* are the options tuple's items values that cannot change? */
static int options_immutable(PyObject *options)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(options); i++) {
        PyObject *item = PyTuple_GET_ITEM(options, i);
        if (item != Py_None && !PyBool_Check(item) && !PyUnicode_CheckExact(item) &&
            !PyLong_CheckExact(item) && !PyFloat_CheckExact(item))
            return 0;
    }
    return 1;
}

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
static int lean_step(const linear_call *c, PyObject *options, PyObject **ret)
{
    PyObject *state = c->initial_state;
    linear_options o;
    PyArrayObject *out = NULL;
    /* the offset table: kept_table's, else one on the stack for up to
     * LEAN_HEADS heads, so that a step allocates nothing but its output,
     * and not that when the output of the last step is free (below) */
    ptrdiff_t table[LEAN_HEADS * ATTNX_LIN_NOPS];
    const ptrdiff_t *offsets = NULL, *kept = NULL;
    if (Py_TYPE(state) != state_type || c->projection != Py_None)
        return 0;
    PyObject *S_obj = slot_get(state, SLOT_S), *z_obj = slot_get(state, SLOT_Z);
    PyObject *offset_obj = slot_get(state, SLOT_OFFSET), *tick_obj = slot_get(state, SLOT_TICK);
    PyObject *pair = slot_get(state, SLOT_PENDING), *last = slot_get(state, SLOT_OUT);
    if (!S_obj || !z_obj || !offset_obj || !tick_obj || !pair || !PyLong_CheckExact(offset_obj) ||
        !PyArray_Check(S_obj) || PyArray_NDIM((PyArrayObject *)S_obj) < 2)
        return 0;
    npy_intp offset = PyLong_AsSsize_t(offset_obj);
    if (offset < 0) {
        PyErr_Clear();
        return 0;
    }
    if (options == lean_options_of) {
        o = lean_options;
    } else {
        if (parse_options(c->variant, c->feature_map, c->causal, c->window, c->method,
                          c->chunk_size, c->eps, c->p, c->M, 1, &o) < 0)
            return -1;
        if (o.kind == ATTNX_FM_FAVOR || o.kind == ATTNX_FM_IDENTITY ||
            o.kind == ATTNX_FM_COSFORMER || o.kind == ATTNX_FM_EFFICIENT ||
            resolve_method(&o, 0, 1) < 0 || o.method != ATTNX_METHOD_RECURRENT) {
            PyErr_Clear();
            return 0;
        }
        if (options_immutable(options)) {
            Py_INCREF(options);
            Py_XSETREF(lean_options_of, options);
            lean_options = o;
        }
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
    if (held_keys_of(tick_obj, pair, S, &pending) < 0) return -1;
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
    int kernel_status;
    Py_BEGIN_ALLOW_THREADS
    kernel_status = linear_kernels[typenum == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    PyObject *next_offset = PyLong_FromSsize_t((Py_ssize_t)(offset + 1));
    PyObject *next_tick = next_offset ? PyLong_FromSsize_t(attnx_pending_next(pending.tick, HELD_KEYS))
                                      : NULL;
    if (attnx_check_status(kernel_status) < 0 || !next_tick) {
        Py_XDECREF(next_offset);
        Py_XDECREF(next_tick);
        goto done;
    }
    slot_put(state, SLOT_OFFSET, next_offset);
    slot_put(state, SLOT_TICK, next_tick);
    if (c->out == Py_None && (PyObject *)out != last) {
        Py_INCREF(out);
        slot_put(state, SLOT_OUT, (PyObject *)out);
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

/* The arguments of state.step(q, k, v, out=None) from a vectorcall: found
 * (q, k, v, out), borrowed */
static int step_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                          PyObject *found[4])
{
    static const char *const names[4] = {"q", "k", "v", "out"};
    Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 4) {
        PyErr_Format(PyExc_TypeError, "step() takes q, k, v and optionally out (%zd given)", nargs);
        return -1;
    }
    for (int i = 0; i < 4; i++) found[i] = i < nargs ? args[i] : NULL;
    for (Py_ssize_t j = 0; j < keywords; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        int i = 0;
        while (i < 4 && PyUnicode_CompareWithASCIIString(name, names[i]) != 0) i++;
        if (i == 4) {
            PyErr_Format(PyExc_TypeError, "step() got an unexpected keyword argument %R", name);
            return -1;
        }
        if (found[i]) {
            PyErr_Format(PyExc_TypeError, "step() got multiple values for argument '%s'", names[i]);
            return -1;
        }
        found[i] = args[nargs + j];
    }
    for (int i = 0; i < 3; i++)
        if (!found[i]) {
            PyErr_Format(PyExc_TypeError, "step() missing required argument '%s'", names[i]);
            return -1;
        }
    if (!found[3]) found[3] = Py_None;
    return 0;
}

/* an attribute of the state: its slot when the state is of exactly
 * state_type and the slot is set, else getattr (new reference) */
static PyObject *state_attr(PyObject *state, int slot, PyObject *name)
{
    PyObject *value = Py_TYPE(state) == state_type ? slot_get(state, slot) : NULL;
    if (!value) return PyObject_GetAttr(state, name);
    Py_INCREF(value);
    return value;
}

/* state.step(q, k, v, out=None): the causal call that continues `state`,
 * with the options of the call that made it (state._options: variant,
 * feature_map, causal, eps, projection, p, M), writing the new state into
 * the state's own arrays and advancing its offset. A method descriptor of
 * LinearAttentionState (_C.state_class), so that a step is one C call. */
static PyObject *state_step(PyObject *state, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    linear_call c = {.key_mask = Py_None, .mask = Py_None, .window = Py_None, .method = Py_None,
                     .chunk_size = Py_None, .causal = Py_True, .normalise = 1, .in_place = 1,
                     .initial_state = state};
    PyObject *found[4], *options = NULL, *features = NULL, *mapped = NULL, *ret = NULL;
    if (step_arguments(args, PyVectorcall_NARGS(nargs), kwnames, found) < 0) return NULL;
    c.q = found[0];
    c.k = found[1];
    c.v = found[2];
    c.out = found[3];
    /* a callable feature map runs in Python (attnx/_linear.py), and its
     * features enter the kernel as q and k */
    if (!(features = state_attr(state, SLOT_FEATURES, name_features))) return NULL;
    if (features != Py_None) {
        mapped = PyObject_CallFunctionObjArgs(callable_features, features, c.q, c.k, c.v, NULL);
        if (!mapped) goto done;
        if (!PyTuple_Check(mapped) || PyTuple_GET_SIZE(mapped) != 2) {
            PyErr_SetString(PyExc_SystemError, "_callable_features must return (phi_q, phi_k)");
            goto done;
        }
        c.q = PyTuple_GET_ITEM(mapped, 0);
        c.k = PyTuple_GET_ITEM(mapped, 1);
    }
    if (!(options = state_attr(state, SLOT_OPTIONS, name_options))) goto done;
    if (!PyTuple_Check(options) || PyTuple_GET_SIZE(options) != 7 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(options, 0))) {
        PyErr_SetString(PyExc_ValueError,
                        "step() needs a state returned by an attnx call with return_state=True "
                        "(it remembers that call's feature map and options); this state was "
                        "built by hand");
        goto done;
    }
    int causal;
    PyObject *made_causal = PyTuple_GET_ITEM(options, 2);
    if (attnx_parse_causal(made_causal, &causal) < 0 || !causal) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError,
                            "step() continues causal decoding only: this state comes from a "
                            "non-causal call (causal=False)");
        goto done;
    }
    c.variant = PyUnicode_AsUTF8(PyTuple_GET_ITEM(options, 0));
    c.feature_map = PyTuple_GET_ITEM(options, 1);
    c.eps = PyTuple_GET_ITEM(options, 3);
    c.projection = PyTuple_GET_ITEM(options, 4);
    c.p = PyTuple_GET_ITEM(options, 5);
    c.M = PyTuple_GET_ITEM(options, 6);
    int lean = c.variant ? lean_step(&c, options, &ret) : -1;
    if (lean == 0) ret = run_linear(&c);
done:
    /* after the call: the tuples own the borrowed items */
    Py_XDECREF(options);
    Py_XDECREF(mapped);
    Py_DECREF(features);
    return ret;
}

static PyMethodDef state_step_def = {
    "step", (PyCFunction)(void (*)(void))state_step, METH_FASTCALL | METH_KEYWORDS,
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
    "True"};

/* _C.state_class(cls, callable_features): registers LinearAttentionState
 * (its slots) and the function applying a callable feature map; returns
 * the step method for the class */
PyObject *attnx_py_state_class(PyObject *self, PyObject *args)
{
    PyObject *cls, *function;
    Py_ssize_t offsets[NSLOTS];
    if (!PyArg_ParseTuple(args, "O!O:state_class", &PyType_Type, &cls, &function)) return NULL;
    for (int i = 0; i < NSLOTS; i++) {
        PyObject *descr = PyObject_GetAttrString(cls, slot_names[i]);
        if (!descr) return NULL;
        int is_slot = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                      ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        offsets[i] = is_slot ? ((PyMemberDescrObject *)descr)->d_member->offset : -1;
        Py_DECREF(descr);
        if (!is_slot) {
            PyErr_Format(PyExc_TypeError, "state_class: %s is not a slot of %R", slot_names[i], cls);
            return NULL;
        }
    }
    PyObject *step = PyDescr_NewMethod((PyTypeObject *)cls, &state_step_def);
    if (!step) return NULL;
    memcpy(slot_offsets, offsets, sizeof offsets);
    Py_INCREF(cls);
    Py_XSETREF(state_type, (PyTypeObject *)cls);
    Py_INCREF(function);
    Py_XSETREF(callable_features, function);
    return step;
}

/* state.S: the held keys of single-token steps into the state's S */
PyObject *attnx_py_linear_flush(PyObject *self, PyObject *state)
{
    PyArrayObject *S = (PyArrayObject *)PyObject_GetAttr(state, name_own_S);
    attnx_pending pending;
    PyObject *ret = NULL;
    if (!S) return NULL;
    if (!PyArray_Check(S) || PyArray_NDIM(S) < 2 || !PyArray_IS_C_CONTIGUOUS(S) ||
        !PyArray_ISWRITEABLE(S) || (PyArray_TYPE(S) != NPY_FLOAT && PyArray_TYPE(S) != NPY_DOUBLE)) {
        PyErr_SetString(PyExc_ValueError,
                        "this state holds decoding keys back from S, but its S was changed by "
                        "hand (no longer a writeable, C-contiguous float array)");
        goto done;
    }
    if (held_keys_get(state, S, &pending) == 0 && held_keys_flush(state, S, &pending) == 0) {
        ret = Py_None;
        Py_INCREF(ret);
    }
done:
    Py_DECREF(S);
    return ret;
}

/* ------------------------------------------------------------------------
 * The backward (linear.c, attnx_linear_bwd): _C.linear_attention_backward
 * takes every option positionally, already resolved by
 * attnx/_linear_grad.py (feature map and method as their ATTNX_* numbers,
 * cosFormer's M and the streaming offset as numbers), and returns the
 * gradients on the broadcast batch shape, which the Python side reduces to
 * each input's shape. */

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
"linear_attention(q, k, v, variant, feature_map, causal, key_mask, mask, window, method, chunk_size, eps, projection, p, M, initial_state, return_state, out, normalise)\n"
"--\n\n"
"The kernel behind attnx.linear_attention and the other kernelised front ends\n"
"(every argument positional; use the front ends). Returns out, or\n"
"(out, S, z, offset) with return_state.");

const char attnx_state_class_doc[] = (
"state_class(cls, callable_features)\n"
"--\n\n"
"Registers attnx.LinearAttentionState (its slots, read in place by a\n"
"decoding step) and the function that applies a callable feature map;\n"
"returns the class's step method.");

const char attnx_linear_flush_doc[] = (
"linear_flush(state)\n"
"--\n\n"
"Adds the keys single-token steps held back into state's S (behind the\n"
"attnx.LinearAttentionState.S property).");

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
