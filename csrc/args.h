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

#define ATTNX_MAX_OPS 12

/* One array argument on its way to a kernel. */
typedef struct {
    const char *name;      /* argument name for messages */
    PyArrayObject *array;  /* owned reference, NULL when the argument is absent */
    int core_ndim;         /* trailing axes that are not broadcast batch axes */
    PyObject *source;      /* borrowed: what the caller passed (out= must not overlap it) */
} attnx_operand;

/* A result type for computing: float32 or float64; out_typenum is what the
 * caller gets back (float16 in, float16 out). */
typedef struct {
    int compute;
    int result;
} attnx_dtypes;

/* Resolve the dtypes of the given objects (NULL or None entries skipped)
 * by numpy promotion: float16 computes in float32, integers and bool in
 * float64; complex, object, string and datetime raise TypeError. */
int attnx_resolve_dtypes(PyObject *const *objs, const char *const *names, int count,
                         attnx_dtypes *dtypes);

/* Convert obj to an aligned native array of typenum with at least
 * min_ndim axes; kept in place when its last axis is contiguous and its row
 * stride can serve as a BLAS leading dimension, copied once otherwise.
 * elementwise operands (biases) are read through any strides, may have
 * fewer axes than core_ndim (broadcast) and are cast even where numpy
 * calls the cast unsafe. */
int attnx_operand_convert(attnx_operand *op, PyObject *obj, int typenum, int min_ndim,
                          int elementwise);

/* Convert a boolean mask (any array-like of dtype bool). */
int attnx_mask_convert(attnx_operand *op, PyObject *obj);

/* Check that an operand's core axis `axis` (negative, from the end) has
 * `size`, or 1 when broadcast_ok. A missing axis counts as 1. */
int attnx_check_core(const attnx_operand *op, int axis, npy_intp size, int broadcast_ok,
                     const char *what);

/* Element stride of core axis `axis` (negative); 0 when it has size 1 or
 * is missing (broadcast). */
ptrdiff_t attnx_core_stride(const attnx_operand *op, int axis);

/* Broadcast the leading axes of the operands; writes the batch shape. */
typedef struct {
    int ndim;
    npy_intp shape[NPY_MAXDIMS];
    ptrdiff_t heads;       /* product of shape */
} attnx_batch;

int attnx_broadcast(attnx_operand *ops, int count, attnx_batch *batch);

/* offsets[h * count + i]: byte offset of head h in operand i (0 if absent). */
ptrdiff_t *attnx_offsets(const attnx_operand *ops, int count, const attnx_batch *batch);

/* The output array batch + (rows, cols) of dtypes->result: `out_obj` when
 * given (checked for dtype, shape, layout, and overlap with the inputs),
 * else a new array. *compute_out receives the array the kernel writes: the
 * same, or a float32 scratch when the result is float16. */
int attnx_output(PyObject *out_obj, const attnx_dtypes *dtypes, const attnx_batch *batch,
                 npy_intp rows, npy_intp cols, const attnx_operand *inputs, int n_inputs,
                 PyArrayObject **result, PyArrayObject **compute_out);

/* ValueError unless `written` shares no element with the inputs (the
 * caller's arrays, not converted copies; NULL entries skipped). */
int attnx_check_disjoint(PyArrayObject *written, const char *name, const attnx_operand *inputs,
                         int n_inputs);

/* Copy/cast the kernel's float32 scratch into the float16 result. */
int attnx_output_finish(PyArrayObject *result, PyArrayObject *compute_out);

/* A new C-ordered array batch + (trailing...) */
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

/* Row stride in elements of the core matrix of a converted operand. */
ptrdiff_t attnx_row_stride(PyArrayObject *array);

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

void attnx_release(attnx_operand *ops, int count);

/* A kernel's status as a Python exception (MemoryError for ATTNX_ENOMEM);
 * 0 for ATTNX_OK, else -1. */
int attnx_check_status(int status);

#endif
