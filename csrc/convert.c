/* convert.c - bfloat16 and float16 <-> float32 over strided arrays
 * (convert.h).
 *
 * attnx.torch computes bfloat16 and float16 tensors in float32: every input is widened
 * once on the way in and every result and gradient narrowed once on the way
 * out. Done here rather than by torch's .to() so that it runs on attnx's
 * own threads, reads strided tensors (a transposed head layout, a
 * gradient expanded with stride 0) without a contiguous copy first, and
 * starts no parallel region for tensors too small to gain from one
 * (PER_THREAD).
 *
 * Work split: the destination is C-ordered, so the elements are numbered
 * 0 .. total-1 in C order and cut into pieces of PIECE elements; a piece
 * walks the source rows it covers with an odometer over the leading axes
 * (one division per axis per piece, none per row). */
#include <string.h>

#include "attnx.h"
#include "convert.h"
#include "portable.h"
#include "dispatch.h"

#if defined(ATTNX_CONVERT_X86) || defined(ATTNX_X86_KERNELS)
#include <immintrin.h>
#elif defined(ATTNX_NEON_KERNELS)
#include <arm_neon.h>
#endif

#define CONVERT_HOT ATTNX_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")

/* 16 Ki elements: 64 KiB of float32, a few microseconds of work */
#define PIECE ((ptrdiff_t)16384)
/* elements each thread must have before a second one is started: a
 * parallel region waits for its slowest thread to be scheduled, which on
 * a machine shared with other work can cost more than the pass saves
 * (docs/performance.md, the C code's choices) */
#define PER_THREAD ((ptrdiff_t)1 << 18)

/* ---------------------------------------------------------- one element */

/* round to nearest, ties to even: add just under half a bfloat16 unit,
 * plus one when the kept part is odd, then drop the low 16 bits (a carry
 * into the exponent is the correct rounding up, up to infinity). NaN is
 * kept quiet with its sign (the addition could turn it into infinity). */
static inline uint16_t narrow_one(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40u)
                                              : (uint16_t)rounded;
}

/* to nearest, ties to even, as VCVTPS2PH (F16C) and NEON's FCVTN do:
 * overflow to infinity, float16 subnormals below 2^-14, NaN made quiet
 * with the upper bits of its payload */
static inline uint16_t f16_narrow_one(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    /* 65520, half way from the largest float16 (65504) to 2^16, and up */
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
    if (magnitude >= 0x38800000u) {
        /* a normal float16: the exponent rebiased, 13 mantissa bits
         * rounded off (a carry into the exponent is the right result) */
        uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
        return sign | (uint16_t)((rounded - ((127u - 15u) << 23)) >> 13);
    }
    /* a subnormal: units of 2^-24; at most 2^-25 (a tie with zero) is 0 */
    uint32_t exponent = magnitude >> 23;
    if (exponent < 102) return sign;
    uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u, shift = 126 - exponent;
    uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
    kept += rest > half || (rest == half && (kept & 1u));
    return sign | (uint16_t)kept;
}

/* ---------------------------------------------------------- one row */

static CONVERT_HOT void widen_row(float *dst, const uint16_t *src, ptrdiff_t stride,
                                  ptrdiff_t count)
{
    if (stride == 1) {
        for (ptrdiff_t i = 0; i < count; i++) dst[i] = attnx_bf16_widened(src[i]);
    } else {
        for (ptrdiff_t i = 0; i < count; i++) dst[i] = attnx_bf16_widened(src[i * stride]);
    }
}

static CONVERT_HOT void narrow_row_portable(uint16_t *dst, const float *src, ptrdiff_t stride,
                                            ptrdiff_t count)
{
    if (stride == 1) {
        for (ptrdiff_t i = 0; i < count; i++) dst[i] = narrow_one(src[i]);
    } else {
        for (ptrdiff_t i = 0; i < count; i++) dst[i] = narrow_one(src[i * stride]);
    }
}

static CONVERT_HOT void f16_widen_row(float *dst, const uint16_t *src, ptrdiff_t stride,
                                     ptrdiff_t count)
{
    for (ptrdiff_t i = 0; i < count; i++) dst[i] = attnx_f16_widened(src[i * stride]);
}

static CONVERT_HOT void f16_narrow_row(uint16_t *dst, const float *src, ptrdiff_t stride,
                                       ptrdiff_t count)
{
    for (ptrdiff_t i = 0; i < count; i++) dst[i] = f16_narrow_one(src[i * stride]);
}

#ifdef ATTNX_CONVERT_X86
/* VCVTNEPS2BF16 rounds to nearest even and quiets NaN as narrow_one does,
 * but reads denormal inputs as zero; lanes holding one are redone by
 * narrow_one so that both paths give the same bits. */
__attribute__((target("avx512f,avx512bf16"))) static void narrow_row_avx512(
    uint16_t *dst, const float *src, ptrdiff_t stride, ptrdiff_t count)
{
    if (stride != 1) {
        narrow_row_portable(dst, src, stride, count);
        return;
    }
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    const __m512i mantissa = _mm512_set1_epi32(0x007fffff);
    ptrdiff_t i = 0;
    for (; i + 16 <= count; i += 16) {
        __m512 x = _mm512_loadu_ps(src + i);
        __m256bh narrowed = _mm512_cvtneps_pbh(x);
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)narrowed);
        __m512i bits = _mm512_castps_si512(x);
        __mmask16 denormal = _mm512_testn_epi32_mask(bits, exponent)
                           & _mm512_test_epi32_mask(bits, mantissa);
        for (int lane = 0; denormal; lane++, denormal >>= 1)
            if (denormal & 1) dst[i + lane] = narrow_one(src[i + lane]);
    }
    for (; i < count; i++) dst[i] = narrow_one(src[i]);
}
#endif

/* the rows in vectors: AVX2 (8 lanes), NEON (4) */
#if defined(ATTNX_X86_KERNELS)
#define CV_LANES 8
#define CV_SFX avx2
#define CV_TARGET ATTNX_TARGET_PUSH("avx2")
#define CV_TARGET_POP ATTNX_TARGET_POP
#include "convert_vec.h"
#elif defined(ATTNX_NEON_KERNELS)
#define CV_LANES 4
#define CV_SFX neon
#define CV_TARGET
#define CV_TARGET_POP
#include "convert_vec.h"
#endif

/* float16 rows by the instructions: F16C (every CPU with AVX2), NEON */
#if defined(ATTNX_X86_KERNELS)
ATTNX_TARGET_PUSH("avx2,f16c")
static void f16_widen_row_avx2(float *dst, const uint16_t *src, ptrdiff_t stride, ptrdiff_t count)
{
    ptrdiff_t i = 0;
    if (stride == 1)
        for (; i + 8 <= count; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < count; i++) dst[i] = attnx_f16_widened(src[i * stride]);
}

static void f16_narrow_row_avx2(uint16_t *dst, const float *src, ptrdiff_t stride, ptrdiff_t count)
{
    ptrdiff_t i = 0;
    if (stride == 1)
        for (; i + 8 <= count; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < count; i++) dst[i] = f16_narrow_one(src[i * stride]);
}
ATTNX_TARGET_POP
#elif defined(ATTNX_NEON_KERNELS)
static void f16_widen_row_neon(float *dst, const uint16_t *src, ptrdiff_t stride, ptrdiff_t count)
{
    ptrdiff_t i = 0;
    if (stride == 1)
        for (; i + 4 <= count; i += 4)
            vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(src + i))));
    for (; i < count; i++) dst[i] = attnx_f16_widened(src[i * stride]);
}

static void f16_narrow_row_neon(uint16_t *dst, const float *src, ptrdiff_t stride, ptrdiff_t count)
{
    ptrdiff_t i = 0;
    if (stride == 1)
        for (; i + 4 <= count; i += 4)
            vst1_u16(dst + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i))));
    for (; i < count; i++) dst[i] = f16_narrow_one(src[i * stride]);
}
#endif

/* ---------------------------------------------------------- the walk */

/* the source layout with size-1 axes dropped and axes that step through
 * memory as one (stride[a] == stride[a+1] * shape[a+1]) merged */
typedef attnx_conversion_layout layout;

static ptrdiff_t collapse(layout *out, int ndim, const ptrdiff_t *shape, const ptrdiff_t *strides)
{
    ptrdiff_t total = 1;
    out->ndim = 0;
    for (int a = 0; a < ndim; a++) {
        total *= shape[a];
        if (shape[a] == 1) continue;
        int last = out->ndim - 1;
        if (last >= 0 && out->strides[last] == strides[a] * shape[a]) {
            out->shape[last] *= shape[a];
            out->strides[last] = strides[a];
        } else {
            out->shape[out->ndim] = shape[a];
            out->strides[out->ndim] = strides[a];
            out->ndim++;
        }
    }
    if (out->ndim == 0) {
        /* one element */
        out->shape[0] = 1;
        out->strides[0] = 1;
        out->ndim = 1;
    }
    return total;
}

typedef void (*widen_fn)(float *, const uint16_t *, ptrdiff_t, ptrdiff_t);
typedef void (*narrow_fn)(uint16_t *, const float *, ptrdiff_t, ptrdiff_t);

/* elements [first, last) of the C order: dst + first on, source rows
 * located through the odometer `index` over the leading axes */
static void convert_span(widen_fn widen, narrow_fn narrow, void *dst, const void *src,
                         const layout *from, ptrdiff_t first, ptrdiff_t last)
{
    const int lead = from->ndim - 1;
    const ptrdiff_t cols = from->shape[lead], col_stride = from->strides[lead];
    ptrdiff_t index[ATTNX_CONVERT_MAX_DIMS];
    ptrdiff_t row = first / cols, col = first % cols, offset = 0;
    for (int a = lead - 1; a >= 0; a--) {
        index[a] = row % from->shape[a];
        row /= from->shape[a];
        offset += index[a] * from->strides[a];
    }
    for (ptrdiff_t at = first; at < last;) {
        ptrdiff_t count = cols - col < last - at ? cols - col : last - at;
        ptrdiff_t source = offset + col * col_stride;
        if (widen)
            widen((float *)dst + at, (const uint16_t *)src + source, col_stride, count);
        else
            narrow((uint16_t *)dst + at, (const float *)src + source, col_stride, count);
        at += count;
        col = 0;
        for (int a = lead - 1; a >= 0; a--) {
            offset += from->strides[a];
            if (++index[a] < from->shape[a]) break;
            offset -= from->strides[a] * from->shape[a];
            index[a] = 0;
        }
    }
}

/* the rows of the conversions' kernel set (dispatch.h); the AVX-512 set
 * narrows bfloat16 by VCVTNEPS2BF16 and does the rest as the AVX2 set */
static widen_fn chosen_widen(attnx_half_format format)
{
    int set = attnx_kernels(ATTNX_FAMILY_CONVERT);
    (void)set;
#if defined(ATTNX_X86_KERNELS)
    if (set == ATTNX_KERNELS_AVX2 || set == ATTNX_KERNELS_AVX512_BF16)
        return format == ATTNX_F16 ? f16_widen_row_avx2 : widen_row_avx2;
#elif defined(ATTNX_NEON_KERNELS)
    if (set == ATTNX_KERNELS_NEON) return format == ATTNX_F16 ? f16_widen_row_neon : widen_row_neon;
#endif
    return format == ATTNX_F16 ? f16_widen_row : widen_row;
}

static narrow_fn chosen_narrow(attnx_half_format format)
{
    int set = attnx_kernels(ATTNX_FAMILY_CONVERT);
    (void)set;
#ifdef ATTNX_CONVERT_X86
    if (set == ATTNX_KERNELS_AVX512_BF16 && format == ATTNX_BF16) return narrow_row_avx512;
#endif
#if defined(ATTNX_X86_KERNELS)
    if (set == ATTNX_KERNELS_AVX2 || set == ATTNX_KERNELS_AVX512_BF16)
        return format == ATTNX_F16 ? f16_narrow_row_avx2 : narrow_row_avx2;
#elif defined(ATTNX_NEON_KERNELS)
    if (set == ATTNX_KERNELS_NEON) return format == ATTNX_F16 ? f16_narrow_row_neon : narrow_row_neon;
#endif
    return format == ATTNX_F16 ? f16_narrow_row : narrow_row_portable;
}

void attnx_widen_rows(float *dst, ptrdiff_t dst_row, const uint16_t *src, ptrdiff_t src_row,
                      ptrdiff_t rows, ptrdiff_t cols, attnx_half_format format)
{
    widen_fn widen = chosen_widen(format);
    for (ptrdiff_t r = 0; r < rows; r++) widen(dst + r * dst_row, src + r * src_row, 1, cols);
}

int attnx_conversion_prepare(attnx_conversion *job, void *dst, const void *src, int widen,
                             attnx_half_format format, int ndim, const ptrdiff_t *shape,
                             const ptrdiff_t *src_strides)
{
    if (ndim < 1 || ndim > ATTNX_CONVERT_MAX_DIMS) return -1;
    job->dst = dst;
    job->src = src;
    job->widen = widen;
    job->format = format;
    job->total = collapse(&job->from, ndim, shape, src_strides);
    return 0;
}

static ptrdiff_t job_pieces(const attnx_conversion *job)
{
    return (job->total + PIECE - 1) / PIECE;
}

/* piece `piece` of `job` */
static void convert_piece(const attnx_conversion *job, ptrdiff_t piece)
{
    ptrdiff_t first = piece * PIECE;
    ptrdiff_t last = first + PIECE < job->total ? first + PIECE : job->total;
    convert_span(job->widen ? chosen_widen(job->format) : NULL,
                 job->widen ? NULL : chosen_narrow(job->format),
                 job->dst, job->src, &job->from, first, last);
}

void attnx_conversion_run(const attnx_conversion *jobs, int count)
{
    ptrdiff_t pieces = 0, total = 0;
    for (int j = 0; j < count; j++) {
        pieces += job_pieces(&jobs[j]);
        total += jobs[j].total;
    }
    int threads = attnx_get_num_threads();
    if (total / PER_THREAD < threads)
        threads = total / PER_THREAD > 1 ? (int)(total / PER_THREAD) : 1;
    /* the jobs' pieces numbered one after the other: one region for all */
    #pragma omp parallel for num_threads(attnx_omp_threads(threads)) schedule(static) if (threads > 1)
    for (ptrdiff_t piece = 0; piece < pieces; piece++) {
        int j = 0;
        ptrdiff_t first = piece;
        while (first >= job_pieces(&jobs[j])) first -= job_pieces(&jobs[j++]);
        convert_piece(&jobs[j], first);
    }
}
