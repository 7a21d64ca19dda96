/* output_cache.c - where the arrays attnx returns get their memory.
 *
 * A large result (dq, dk, dv and out of a training step) freed by the
 * user would go back to the system: glibc returns blocks above its mmap
 * threshold (at most 32 MiB) with munmap, and the next call's result of
 * the same size is faulted in and zeroed page by page anew, which took a
 * third of a large causal linear attention forward + backward (docs/performance.md, the C code's choices).
 * So results of REUSE_MIN_BYTES or more
 * are allocated through a numpy memory handler of attnx's own, whose free
 * keeps the last few blocks (at most `limit` bytes in all, the oldest
 * released first) for the next result of the same size.
 *
 * numpy calls a handler's functions with the GIL held (it frees an
 * array's data in its deallocator), and attnx allocates its results before
 * it releases the GIL: the GIL guards the cache, as it guards numpy's own
 * small-block cache. */
#include "args.h"
#include "bindings.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define REUSE_MIN_BYTES ((size_t)1 << 20)
#define SLOTS 8
#define DEFAULT_LIMIT ((size_t)256 << 20)

typedef struct {
    void *block;
    size_t bytes;
    uint64_t freed_at;  /* the free's sequence number: the oldest goes first */
} cached_block;

static struct {
    cached_block slot[SLOTS];
    size_t held, limit;
    uint64_t frees;
} cache = {.limit = DEFAULT_LIMIT};

static void release_slot(int s)
{
    free(cache.slot[s].block);
    cache.held -= cache.slot[s].bytes;
    cache.slot[s] = (cached_block){0};
}

static void *cache_malloc(void *ctx, size_t bytes)
{
    (void)ctx;
    for (int s = 0; s < SLOTS; s++)
        if (cache.slot[s].block && cache.slot[s].bytes == bytes) {
            void *block = cache.slot[s].block;
            cache.held -= bytes;
            cache.slot[s] = (cached_block){0};
            return block;
        }
    return malloc(bytes);
}

static void *cache_calloc(void *ctx, size_t count, size_t size)
{
    if (size && count > SIZE_MAX / size) return NULL;
    void *block = cache_malloc(ctx, count * size);
    if (block) memset(block, 0, count * size);
    return block;
}

static void *cache_realloc(void *ctx, void *block, size_t bytes)
{
    (void)ctx;
    return realloc(block, bytes);  /* a live block is never in the cache */
}

static void cache_free(void *ctx, void *block, size_t bytes)
{
    (void)ctx;
    if (!block) return;
    if (bytes < REUSE_MIN_BYTES || bytes > cache.limit) {
        free(block);
        return;
    }
    /* room: an empty slot, then the oldest blocks released until it fits */
    while (1) {
        int empty = -1, oldest = -1;
        for (int s = 0; s < SLOTS; s++) {
            if (!cache.slot[s].block) empty = s;
            else if (oldest < 0 || cache.slot[s].freed_at < cache.slot[oldest].freed_at) oldest = s;
        }
        if (empty >= 0 && cache.held + bytes <= cache.limit) {
            cache.slot[empty] = (cached_block){block, bytes, ++cache.frees};
            cache.held += bytes;
            return;
        }
        release_slot(oldest);
    }
}

static PyDataMem_Handler handler = {
    "attnx_output_cache",
    1,
    {NULL, cache_malloc, cache_calloc, cache_realloc, cache_free},
};
static PyObject *handler_capsule;

int attnx_output_cache_init(void)
{
    handler_capsule = PyCapsule_New(&handler, "mem_handler", NULL);
    return handler_capsule ? 0 : -1;
}

PyArrayObject *attnx_new_result(int ndim, const npy_intp *shape, int typenum)
{
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (!descr) return NULL;
    size_t bytes = (size_t)PyDataType_ELSIZE(descr);
    Py_DECREF(descr);
    for (int ax = 0; ax < ndim; ax++) bytes *= (size_t)shape[ax];
    if (bytes < REUSE_MIN_BYTES || cache.limit == 0)
        return (PyArrayObject *)PyArray_SimpleNew(ndim, shape, typenum);
    PyObject *previous = PyDataMem_SetHandler(handler_capsule);
    if (!previous) return NULL;
    PyArrayObject *array = (PyArrayObject *)PyArray_SimpleNew(ndim, shape, typenum);
    PyObject *restored = PyDataMem_SetHandler(previous);
    Py_DECREF(previous);
    if (!restored) {
        Py_XDECREF(array);
        return NULL;
    }
    Py_DECREF(restored);
    return array;
}

/* _C.set_output_cache(limit) -> the previous limit: the bytes of freed
 * results kept for reuse; 0 turns the cache off and frees what it holds */
PyObject *attnx_py_set_output_cache(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t limit = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (limit < 0) {
        PyErr_Format(PyExc_ValueError, "the output cache's limit must be at least 0 bytes, got %zd",
                     limit);
        return NULL;
    }
    size_t previous = cache.limit;
    cache.limit = (size_t)limit;
    for (int s = 0; s < SLOTS; s++)
        if (cache.slot[s].block && cache.held > cache.limit) release_slot(s);
    return PyLong_FromSize_t(previous);
}

/* _C._output_cache_held() -> (bytes held, blocks held), for tests */
PyObject *attnx_py_output_cache_held(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    int blocks = 0;
    for (int s = 0; s < SLOTS; s++) blocks += cache.slot[s].block != NULL;
    return Py_BuildValue("(ni)", (Py_ssize_t)cache.held, blocks);
}
