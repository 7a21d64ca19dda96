/* args.h - the one place where Python arguments become kernel operands:
 * dtype resolution, conversion with zero copies where the layout allows,
 * gufunc-style broadcasting of the leading axes, output allocation, and
 * the option parsers every front end shares. Each function sets a Python
 * exception naming the argument and returns -1 (or NULL) on bad input. */
#ifndef ATTNX_ARGS_H
#define ATTNX_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL attnx_ARRAY_API
#include <numpy/arrayobject.h>

#include "attnx.h"

/* ------------------------------------------------------------------------
 * The call description: every front end lists its array arguments once,
 * as a table of attnx_param, and attnx_bind turns what Python passed into
 * kernel operands in one go:
 *   1. the compute dtype, by numpy promotion of the ATTNX_COMPUTE inputs;
 *   2. each input's shape read (no copy yet), its core axes bound to the
 *      symbols of the description and checked, every failure as one
 *      message: "k has shape (2, 7, 8), expected (..., m, d) = (..., 7,
 *      16) (d from q)";
 *   3. the symbols named in int_sizes checked below 2**31 and the leading
 *      axes broadcast, the outputs' sizes checked for overflow: all before
 *      any copy or allocation (a broadcast view of 2**31 keys is refused,
 *      not copied);
 *   4. the inputs converted (a copy only where the layout needs one);
 *   5. the outputs allocated, or the caller's out= checked (dtype, shape,
 *      layout, writeable, no overlap with any input);
 *   6. the kernel's offset table, by each param's slot.
 * attnx_call_release frees it all, whatever step failed, so a front end
 * has one error label.
 *
 * Core axes are a string of one-letter symbols, last axis last: "n d" is
 * (..., n, d); "n|1 m|1" may also have 1 (or no axis) where it broadcasts
 * against n and m. A symbol is bound by the first param that has it (in
 * table order) at a size other than a broadcast 1, or beforehand by the
 * front end (attnx_call_set, attnx_call_derive; call->legend then says
 * what they are in the messages that show them).
 *
 * Example, the softmax forward (py_softmax.c):
 *
 *   enum { Q, K, V, BIAS, MASK, OUT, LSE, NPARAMS };
 *   static const attnx_param params[NPARAMS] = {
 *       [Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_SM_Q},
 *       [K] = {"k", "m d", ATTNX_COMPUTE, ATTNX_SM_K},
 *       [V] = {"v", "m e", ATTNX_COMPUTE, ATTNX_SM_V},
 *       [BIAS] = {"bias", "n|1 m|1", ATTNX_ELEMENTWISE, ATTNX_SM_BIAS},
 *       [MASK] = {"mask", "n|1 m|1", ATTNX_BOOL, ATTNX_SM_MASK},
 *       [OUT] = {"out", "n e", ATTNX_OUTPUT | ATTNX_RESULT_DTYPE, ATTNX_SM_OUT},
 *       [LSE] = {"lse", "n", ATTNX_OUTPUT, ATTNX_SM_LSE},
 *   };
 *   attnx_call call;
 *   attnx_call_init(&call, params, NPARAMS, ATTNX_SM_NOPS, "dem");
 *   PyObject *objs[NPARAMS] = {q, k, v, bias, mask, out, want_lse ? Py_None : NULL};
 *   if (attnx_bind(&call, objs) < 0) goto done;
 *   args.n = attnx_size(&call, 'n'); args.q = attnx_data(&call, Q); ...
 *   args.offsets = call.offsets;  (release the GIL, run the kernel)
 *   if (attnx_finish(&call) < 0) goto done;   (float16 results)
 *   ret = the new references of call.results[OUT], call.results[LSE]
 * done:
 *   attnx_call_release(&call);
 *
 * A backward binding is the same shape: inputs dout "n e", q, k, v, out
 * "n e" (ATTNX_COMPUTE) and lse "n" (flags 0: converted to the compute
 * dtype without a say in it), outputs dq "n d",
 * dk "m d", dv "m e" (ATTNX_RESULT_DTYPE; objs[] the caller's dq= or None),
 * dbias "n m" (ATTNX_ZEROED; objs[] NULL unless asked for). An output has
 * the broadcast batch shape: the gradient of an input broadcast over a
 * leading axis is reduced to its shape afterwards.
 */
#define ATTNX_MAX_OPS 16
#define ATTNX_MAX_CORE 4

enum {
    /* inputs (objs[i] NULL or None: absent) */
    ATTNX_COMPUTE = 1 << 0,      /* takes part in the compute dtype (q, k, v) */
    ATTNX_ELEMENTWISE = 1 << 1,  /* read through any strides, cast even where numpy calls
                                    the cast unsafe; otherwise the last axis must be
                                    contiguous with a row stride BLAS takes (copied once
                                    where it is not) */
    ATTNX_BOOL = 1 << 2,         /* a boolean mask, read through any strides */
    ATTNX_EXACT_DTYPE = 1 << 8,  /* already an array of the compute dtype, never cast
                                    (TypeError): a state carried from a call of that dtype */
    ATTNX_REQUIRED = 1 << 9,     /* an input that must be given (ATTNX_COMPUTE inputs are
                                    required too): None is a TypeError */
    ATTNX_BROADCAST_ROWS = 1 << 10, /* its kernel reads the rows itself or through gemm
                                    (which takes a row stride of 0): a broadcast row axis
                                    (stride 0, np.broadcast_to one row) is read as one row,
                                    never copied */
    ATTNX_HALF = 1 << 11,        /* half-precision numbers read as they are: float16, or
                                    bfloat16 as its bits (int16 or uint16; else a
                                    TypeError), aligned and in native order: no part in the
                                    compute dtype, never cast, copied once where its kernel
                                    could not read its layout */
    /* outputs (objs[i] NULL: not wanted, None: allocated, an array: out=) */
    ATTNX_OUTPUT = 1 << 3,
    ATTNX_RESULT_DTYPE = 1 << 4, /* the caller's dtype (float16 in, float16 out, computed
                                    in a float32 scratch); otherwise the compute dtype */
    ATTNX_ALIGNED = 1 << 5,      /* allocated ATTNX_ALIGN-byte aligned */
    ATTNX_ZEROED = 1 << 6,       /* zeros before the kernel runs, the caller's out= too
                                    (an output the kernel accumulates into) */
    ATTNX_IN_PLACE = 1 << 7,     /* objs[i] is also an input that this output overwrites:
                                    it must be that input's own array (no converted copy),
                                    writeable, C-contiguous, of the batch shape, and
                                    disjoint from every other input */
};

/* One array argument of a call. */
typedef struct {
    const char *name;  /* as messages name it */
    const char *axes;  /* core axes, e.g. "m d" or "n|1 m|1" */
    int flags;         /* ATTNX_* above; 0: an input of the compute dtype */
    int slot;          /* its column in the kernel's offset table, -1 for none */
} attnx_param;

/* One array argument on its way to a kernel. */
typedef struct {
    const char *name;      /* argument name for messages */
    PyArrayObject *array;  /* owned reference, NULL when the argument is absent */
    int core_ndim;         /* trailing axes that are not broadcast batch axes */
    PyObject *source;      /* borrowed: what the caller passed (out= must not overlap it) */
} attnx_operand;

/* The dtype kernels compute in (float32 or float64) and the one the caller
 * gets back (result: float16 in, float16 out). */
typedef struct {
    int compute;
    int result;
} attnx_dtypes;

/* The broadcast leading axes of a call. */
typedef struct {
    int ndim;
    npy_intp shape[NPY_MAXDIMS];
    ptrdiff_t heads;       /* product of shape */
} attnx_batch;

typedef struct {
    /* the description (attnx_call_init) */
    const attnx_param *params;
    int count, nslots;
    const char *int_sizes;  /* symbols the kernels take as int: below 2**31 */
    const char *legend;     /* NULL, or what the front end's own symbols mean (messages) */
    struct { char symbol, from; npy_intp mul, add; } derived;  /* symbol = mul from + add */
    /* what attnx_bind found */
    attnx_dtypes dtypes;
    npy_intp size[26];               /* symbol 'a' + i; -1 while unbound */
    signed char bound_by[26];        /* the param that bound it; -1: the front end */
    attnx_batch batch;
    attnx_operand ops[ATTNX_MAX_OPS];      /* per param: the array the kernel reads/writes */
    PyArrayObject *results[ATTNX_MAX_OPS]; /* per output: the array the caller gets */
    ptrdiff_t *offsets;                    /* (heads, nslots) byte offsets */
} attnx_call;

void attnx_call_init(attnx_call *call, const attnx_param *params, int count, int nslots,
                     const char *int_sizes);
/* bind a symbol beforehand (e.g. r, the features of a map's projection) */
void attnx_call_set(attnx_call *call, char symbol, npy_intp size);
/* bind `symbol` to mul * from + add as soon as `from` is bound */
void attnx_call_derive(attnx_call *call, char symbol, char from, npy_intp mul, npy_intp add);

/* Steps 1-6 above; objs[i] for params[i]. -1 with a Python exception. */
int attnx_bind(attnx_call *call, PyObject *const *objs);

static inline npy_intp attnx_size(const attnx_call *call, char symbol)
{
    return call->size[symbol - 'a'];
}

/* the data of param i (NULL when absent) */
static inline void *attnx_data(const attnx_call *call, int i)
{
    return call->ops[i].array ? PyArray_DATA(call->ops[i].array) : NULL;
}

/* Row stride in elements of the core matrix of a converted operand. */
ptrdiff_t attnx_row_stride(PyArrayObject *array);

/* Stride (bytes) of param i's core axis `axis` (negative, from the end);
 * 0 when it has size 1, is missing (broadcast) or the param is absent. */
ptrdiff_t attnx_core_stride(const attnx_call *call, int i, int axis);

/* After the kernel: float32 scratch copied into float16 results. */
int attnx_finish(attnx_call *call);

/* Everything attnx_bind made, whatever step it stopped at. */
void attnx_call_release(attnx_call *call);

/* ------------------------------------------------------------------------
 * The pieces under attnx_bind that front ends also use on their own. */

/* Resolve the dtypes of the given objects (NULL or None entries skipped)
 * by numpy promotion: float16 computes in float32, integers and bool in
 * float64; complex, object, string and datetime raise TypeError. */
int attnx_resolve_dtypes(PyObject *const *objs, const char *const *names, int count,
                         attnx_dtypes *dtypes);

/* A new C-ordered array for a result: one of 1 MiB or more takes its
 * memory from the blocks of attnx's earlier results (output_cache.c) */
PyArrayObject *attnx_new_result(int ndim, const npy_intp *shape, int typenum);

/* A new C-ordered result array batch + (trailing...) */
PyArrayObject *attnx_new_array(const attnx_batch *batch, const npy_intp *trailing, int n_trailing,
                               int typenum);

/* The same, its data ATTNX_ALIGN-byte aligned (numpy only guarantees 16),
 * in a uint8 buffer that is its base: for arrays read and written whole
 * vectors at a time, such as the streaming state a decoding step updates
 * in place, where a vector straddling two cache lines costs two accesses
 * (measured: ~5% of a 32-head float32 decoding step). */
#define ATTNX_ALIGN 64
PyArrayObject *attnx_new_aligned_array(const attnx_batch *batch, const npy_intp *trailing,
                                       int n_trailing, int typenum);

/* The arguments of a METH_FASTCALL | METH_KEYWORDS entry point by name,
 * for the ones a decoding call goes through (PyArg_ParseTupleAndKeywords
 * packs them into a tuple and a dict first). A keyword is matched first by
 * identity with the interned name (the names a call site spells out are
 * interned), starting after the last one matched, so a call passing them
 * in table order costs one pointer comparison each. */
typedef struct {
    const char *function;      /* for messages: "linear_attention" */
    const char *const *names;  /* every argument, in order */
    int count;
    int positional;            /* names[0..positional) may also come by position */
    int required;              /* names[0..required) must be given */
    PyObject **interned;       /* count entries, NULL until the first call */
} attnx_keywords;

/* found[i] for names[i], borrowed (NULL where not given); TypeError with
 * Python's own wording for an unknown, repeated or missing argument. */
int attnx_parse_keywords(attnx_keywords *spec, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames, PyObject **found);

/* A keyword-only argument without a default, which PyArg_ParseTupleAndKeywords
 * cannot express: parsed as "O" left NULL, then checked here. */
int attnx_required(const char *function, const char *name, PyObject *obj);

/* Options shared by the front ends. */
int attnx_parse_causal(PyObject *obj, int *causal);  /* 0 none, 1 lower right, 2 upper left */
int attnx_parse_window(PyObject *obj, int *has_left, npy_intp *left, int *has_right,
                       npy_intp *right);
int attnx_parse_positive(PyObject *obj, const char *name, double *value);
attnx_band attnx_make_band(npy_intp n, npy_intp m, int causal, int has_left, npy_intp left,
                           int has_right, npy_intp right);

/* dropout_p (None or a number in [0, 1)) and seed (None or an int in
 * [0, 2**64), required when dropout_p > 0) */
int attnx_parse_dropout(PyObject *p_obj, PyObject *seed_obj, double *p, uint64_t *seed);

/* The interrupt of a call made now (attnx.h): polled for signals when the
 * call runs on the main thread (attnx_interrupt_init, at import, records
 * which one that is). */
attnx_interrupt attnx_interrupt_for_call(void);

/* A kernel's status as a Python exception (MemoryError for ATTNX_ENOMEM,
 * the signal handler's exception for ATTNX_EINTR); 0 for ATTNX_OK, else -1. */
int attnx_check_status(int status);

/* job = src converted into dst between a half-precision format (float16,
 * or bfloat16 bits as int16 or uint16) and float32 (convert.h), after
 * checking both (py_convert.c); -1 with an exception whose message starts with
 * `name` */
struct attnx_conversion;
int attnx_prepare_half_conversion(PyArrayObject *src, PyArrayObject *dst,
                                  struct attnx_conversion *job, const char *name);
/* A new float32 array of half-precision `half` widened, or NULL with an
 * exception whose message starts with `name` (py_convert.c) */
PyObject *attnx_widened_half(PyArrayObject *half, const char *name);
/* an array's half-precision format (convert.h's attnx_half_format: NPY_HALF
 * is float16, int16 and uint16 hold bfloat16 bits); 0 for other dtypes */
int attnx_half_format_of(PyArrayObject *array);
/* to = the `count` params of `from`, with params k and v (computing
 * inputs) taking half-precision arrays as they are instead: the private
 * _half_kv of the softmax bindings (py_convert.c) */
void attnx_half_kv_params(attnx_param *to, const attnx_param *from, int count, int k, int v);
/* the one half-precision format of bound k and v, or -1 with a TypeError
 * when they differ (py_convert.c) */
int attnx_half_kv_format(PyArrayObject *k, PyArrayObject *v);

#endif
