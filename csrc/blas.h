/* blas.h - the cblas entry points, whichever OpenBLAS we were built with.
 * The scipy-openblas32 wheel prefixes every symbol with "scipy_" so that it
 * can live in one process beside numpy's and torch's own BLAS. */
#ifndef ATTNX_BLAS_H
#define ATTNX_BLAS_H

#include <cblas.h>

#ifdef ATTNX_BLAS_SCIPY_PREFIX
#define ATTNX_CBLAS(name) scipy_##name
#define ATTNX_OPENBLAS(name) scipy_##name
#else
#define ATTNX_CBLAS(name) name
#define ATTNX_OPENBLAS(name) name
#endif

#ifndef ATTNX_BLAS_NAME
#define ATTNX_BLAS_NAME "openblas"
#endif

#endif
