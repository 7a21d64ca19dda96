/* module.c - the attnx._C extension module: method table, thread control
 * and build information. The front ends live in py_<family>.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define PY_ARRAY_UNIQUE_SYMBOL attnx_ARRAY_API
#include <numpy/arrayobject.h>

#include "amx.h"
#include "attnx.h"
#include "bindings.h"

static PyObject *get_num_threads(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(attnx_get_num_threads());
}

static PyObject *set_num_threads(PyObject *self, PyObject *arg)
{
    if (PyBool_Check(arg) || !PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "num_threads must be an int, got %s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    long threads = PyLong_AsLong(arg);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    if (threads < 1 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "num_threads must be between 1 and 4096, got %ld", threads);
        return NULL;
    }
    attnx_set_num_threads((int)threads);
    Py_RETURN_NONE;
}

static PyObject *set_amx(PyObject *self, PyObject *arg)
{
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0) return NULL;
    return PyBool_FromLong(attnx_set_amx(enabled));
}

static PyObject *build_info(PyObject *self, PyObject *unused)
{
    int amx = 0;
#ifdef ATTNX_HAVE_AMX
    amx = attnx_amx_enabled() && attnx_amx_usable();
#endif
    return Py_BuildValue("{s:s,s:s,s:N,s:i,s:s}", "blas", attnx_blas_name(), "simd",
                         attnx_simd_level(), "amx", PyBool_FromLong(amx), "num_threads",
                         attnx_get_num_threads(), "compiler",
#ifdef __VERSION__
                         "gcc " __VERSION__
#else
                         "unknown"
#endif
    );
}

#define KW_METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_VARARGS | METH_KEYWORDS, doc}

static PyMethodDef methods[] = {
    KW_METHOD("softmax_attention", attnx_py_softmax_attention, attnx_softmax_attention_doc),
    KW_METHOD("gaussian_attention", attnx_py_gaussian_attention, attnx_gaussian_attention_doc),
    {"softmax_backward", attnx_py_softmax_backward, METH_VARARGS, attnx_softmax_backward_doc},
    {"linear_attention", attnx_py_linear_attention, METH_VARARGS, attnx_linear_attention_doc},
    {"linear_step", attnx_py_linear_step, METH_VARARGS, attnx_linear_step_doc},
    {"linear_flush", attnx_py_linear_flush, METH_O, attnx_linear_flush_doc},
    {"get_num_threads", get_num_threads, METH_NOARGS, "Threads attnx kernels use."},
    {"set_num_threads", set_num_threads, METH_O, "Set the threads attnx kernels use."},
    {"_set_amx", set_amx, METH_O,
     "Allow (True) or forbid AMX for float32 softmax attention; returns the previous setting."},
    {"build_info", build_info, METH_NOARGS, "BLAS, SIMD level, AMX in use, threads, compiler."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnx._C", NULL, -1, methods};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    attnx_blas_init();
    if (attnx_linear_names_init() < 0) return NULL;
    return PyModule_Create(&module);
}
