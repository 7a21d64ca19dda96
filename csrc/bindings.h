/* bindings.h - the Python-callable functions, one group per family file. */
#ifndef ATTNX_BINDINGS_H
#define ATTNX_BINDINGS_H
#include <Python.h>

PyObject *attnx_py_softmax_attention(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_gaussian_attention(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_softmax_backward(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_linear_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames);
PyObject *attnx_py_linear_attention_backward(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_linear_variants(PyObject *self, PyObject *unused);
PyObject *attnx_py_linear_resolve(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_lsh_attention(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_delta_rule(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_delta_rule_backward(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_causal_conv1d_update(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_lsh_backward(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *attnx_py_lsh_buckets(PyObject *self, PyObject *args);
PyObject *attnx_py_convert_half(PyObject *self, PyObject *args);
/* adds LinearAttentionState to the module (py_linear.c) */
int attnx_linear_init(PyObject *module);
/* the memory handler of attnx's results (output_cache.c) */
int attnx_output_cache_init(void);
PyObject *attnx_py_set_output_cache(PyObject *self, PyObject *limit);
PyObject *attnx_py_output_cache_held(PyObject *self, PyObject *unused);
/* which thread handles signals, for interrupting calls (args.c) */
void attnx_interrupt_init(void);

extern const char attnx_softmax_attention_doc[];
extern const char attnx_gaussian_attention_doc[];
extern const char attnx_softmax_backward_doc[];
extern const char attnx_linear_attention_doc[];
extern const char attnx_linear_attention_backward_doc[];
extern const char attnx_linear_variants_doc[];
extern const char attnx_linear_resolve_doc[];
extern const char attnx_lsh_attention_doc[];
extern const char attnx_delta_rule_doc[];
extern const char attnx_delta_rule_backward_doc[];
extern const char attnx_causal_conv1d_update_doc[];
extern const char attnx_lsh_backward_doc[];
extern const char attnx_lsh_buckets_doc[];

#endif
