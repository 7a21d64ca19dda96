/* convert_vec.h - convert.c's rows for one vector width, included by
 * convert.c once per instruction set (CV_LANES float32 lanes, CV_SFX the
 * names' suffix, CV_TARGET and CV_TARGET_POP around the bodies): AVX2 and
 * NEON from one source, in GNU vector extensions.
 *
 * The same integer arithmetic as attnx_bf16_widened (convert.h) and
 * narrow_one, lane by lane, so the bits are theirs: widening moves each bfloat16 into the upper half of
 * a 32-bit lane; narrowing adds 0x7fff plus the kept part's lowest bit,
 * shifts right by 16 and keeps NaN quiet (| 0x40) where the input is one.
 * A strided source, and the tail of a row, go one element at a time. */
#ifndef CV_LANES
#error "convert_vec.h is included by convert.c, with CV_LANES defined"
#endif

CV_TARGET

#define CV_CAT2(a, b) a##b
#define CV_CAT(a, b) CV_CAT2(a, b)
#define CV_NAME(name) CV_CAT(name, CV_CAT(_, CV_SFX))
#define CV_U32 CV_NAME(cv_u32)
#define CV_U16 CV_NAME(cv_u16)

/* unaligned, may alias the float and uint16_t arrays they are loaded from */
typedef uint32_t CV_U32 __attribute__((vector_size(CV_LANES * 4), aligned(4), may_alias));
typedef uint16_t CV_U16 __attribute__((vector_size(CV_LANES * 2), aligned(2), may_alias));

static void CV_NAME(widen_row)(float *dst, const uint16_t *src, ptrdiff_t stride, ptrdiff_t count)
{
    ptrdiff_t i = 0;
    if (stride == 1)
        for (; i + CV_LANES <= count; i += CV_LANES)
            *(CV_U32 *)(dst + i) = __builtin_convertvector(*(const CV_U16 *)(src + i), CV_U32) << 16;
    for (; i < count; i++) dst[i] = attnx_bf16_widened(src[i * stride]);
}

static void CV_NAME(narrow_row)(uint16_t *dst, const float *src, ptrdiff_t stride, ptrdiff_t count)
{
    ptrdiff_t i = 0;
    if (stride == 1)
        for (; i + CV_LANES <= count; i += CV_LANES) {
            CV_U32 bits = *(const CV_U32 *)(src + i);
            CV_U32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
            /* all ones in the lanes that hold a NaN (a vector comparison) */
            CV_U32 nan = (CV_U32)((bits & 0x7fffffffu) > 0x7f800000u);
            CV_U32 kept = (((bits >> 16) | 0x40u) & nan) | (rounded & ~nan);
            *(CV_U16 *)(dst + i) = __builtin_convertvector(kept, CV_U16);
        }
    for (; i < count; i++) dst[i] = narrow_one(src[i * stride]);
}

#undef CV_CAT2
#undef CV_CAT
#undef CV_NAME
#undef CV_U32
#undef CV_U16
CV_TARGET_POP
#undef CV_LANES
#undef CV_SFX
#undef CV_TARGET
#undef CV_TARGET_POP
