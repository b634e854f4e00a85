/* One fused pass of AdamW (decoupled weight decay) over a slice of fp32 master weights.
 *
 * Reads the gradient in its transfer dtype (fp32, bf16 or fp16), optionally adds an fp32
 * accumulator, applies the unscale and clip factors, updates p, m, v and writes the
 * half-precision weight copy that travels back to the GPU, all in one sweep over memory:
 * about 2 + 12 + 12 + 2 = 28 bytes per parameter for bf16 grads and weights, against ~40 for
 * a stock AdamW plus separate casts.  The outputs may alias the inputs (in place) or not
 * (out of place: the caller commits the new buffers once the clip factor is known).
 *
 * The arithmetic is torch's single-tensor AdamW (mul_, lerp_, mul_/addcmul_, sqrt, div by a scalar,
 * add_, addcdiv_) as torch's CUDA kernels round it: the same fused multiply-adds, a correctly rounded
 * sqrt, a division by a scalar as a multiply by its reciprocal. So torch's single-tensor AdamW on CUDA
 * (and adam_math.adamw_torch_ there, which the GPU assist runs) gives these bits: a GPU test checks the
 * latter, and torch.optim.AdamW(foreach=False) was checked once on the H200 (docs/BENCHMARKS.md).
 * Torch's CPU kernels differ in the last bit in places (a true division by the scalar, a sqrt that is
 * not always correctly rounded, addcmul_ as (value * t1) * t2, addcdiv_ as (value * t1) / t2): within
 * 1e-6 of torch's CPU AdamW in the CPU tests.
 * fused_adamw_f32_device computes torch's fused CUDA AdamW instead (fused_adam_utils.cuh), as the one-pass
 * narrow kernel does (narrow_kernel.py: the arithmetics FLOAT, FLOAT_UNFUSED, DOUBLE), so that a CPU-stepped
 * parameter gets the bits the GPU's fused AdamW would have given it: fp32 scalars, m = fma(b1, m, fma(-b1, g, g)),
 * v likewise on g*g, the decay p - (lr*wd)*p (or its contraction), p -= (lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)
 * with true divisions; or those in double, rounded to fp32 where torch's older kernel rounds. Bias corrections come
 * from the caller, computed on the GPU as the fused kernel computes them.
 * Threading is left to the caller: each call is one slice, called with the GIL released.
 *
 * Streaming stores: an output that does not alias an input (the out-of-place bank, the half copy)
 * would otherwise be read into cache before it is overwritten (write-allocate), 12 extra bytes per
 * parameter out of place.  With `stream` set, such outputs are computed into an L1-sized block on
 * the stack and written with non-temporal stores, which skip that read; the arithmetic is the same
 * loop, so results are bitwise those of the plain path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_NONE = 3 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, NaN kept quiet: the same result as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    /* a NaN takes no rounding bias (which could carry into the sign) and gets the quiet bit; as masks rather than a
     * select, which gcc vectorises in 32-bit lanes instead of narrowing both candidates first */
    const uint32_t nan = -(uint32_t)((int32_t)(u & 0x7fffffffu) > (int32_t)0x7f800000);
    const uint32_t bias = (0x7fffu + ((u >> 16) & 1u)) & ~nan;
    return (uint16_t)(((u + bias) >> 16) | (nan & 0x40u));
}

/* fp16: the compiler's _Float16 where it has one (gcc >= 12, clang), which vectorises; else the F16C
 * instructions (gcc 11 on any x86 with AVX2-era -march=native). Both round to nearest even. */
#if defined(__FLT16_MAX__)
static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}
static inline uint16_t f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}
#elif defined(__F16C__)
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
#error "fp16 conversion needs _Float16 (gcc >= 12, clang >= 15) or the F16C instructions (x86 -march=native)"
#endif

typedef struct {
    float inv_scale, coef, decay, w1, one_minus_w1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size;
    /* the fused CUDA arithmetic's scalars (fused_adamw_f32_device), fp32 and double */
    float lr, b1, fb2, feps, lrwd, step_size, bc2_sqrt;
    double dlr, db1, db2, deps, dwd;
    int decays;
} hyper_t;

/* the arithmetic of a loop: torch's single-tensor AdamW (the default), or one of the fused CUDA kernel's */
enum { MATH_SINGLE = 0, MATH_FLOAT = 1, MATH_FLOAT_UNFUSED = 2, MATH_DOUBLE = 3 };

/* One element's update from its (unscaled, clipped) fp32 gradient g, in the arithmetic `math`. */
static inline __attribute__((always_inline)) void adamw_update(float *p, float *m, float *v, const float gi,
                                                               const hyper_t *h, const int lerp_low, const int math) {
    float pi = *p, mi = *m, vi = *v;
    if (math == MATH_SINGLE) {
        pi = pi * h->decay;
        /* torch's vectorised lerp_: one fused multiply-add from the nearer end */
        mi = lerp_low ? fmaf(h->w1, gi - mi, mi) : fmaf(h->w1 - 1.0f, gi - mi, gi);
        vi = vi * h->beta2;
        vi = fmaf(h->one_minus_beta2, gi * gi, vi); /* CUDA addcmul_: self + value * (t1 * t2), contracted */
        float denom = sqrtf(vi) * h->inv_bc2_sqrt + h->eps; /* torch's CUDA div by a scalar: times its reciprocal */
        pi = fmaf(h->neg_step_size, mi / denom, pi); /* CUDA's addcdiv_: self + value * (t1 / t2), contracted */
    } else if (math == MATH_DOUBLE) {
        const double pd = pi, gd = gi;
        if (h->decays) pi = (float)fma(-(h->dlr * h->dwd), pd, pd);
        mi = (float)fma(h->db1, (double)mi, (1.0 - h->db1) * gd);
        vi = (float)fma(h->db2, (double)vi, (1.0 - h->db2) * gd * gd);
        const float denom = (float)((double)(sqrtf(vi) / h->bc2_sqrt) + h->deps);
        pi = pi - (h->step_size * mi) / denom;
    } else {
        if (h->decays) pi = math == MATH_FLOAT ? fmaf(-h->lrwd, pi, pi) : pi - h->lrwd * pi;
        mi = fmaf(h->b1, mi, fmaf(-h->b1, gi, gi));
        const float gg = gi * gi;
        vi = fmaf(h->fb2, vi, fmaf(-h->fb2, gg, gg));
        const float denom = sqrtf(vi) / h->bc2_sqrt + h->feps;
        pi = pi - (h->step_size * mi) / denom;
    }
    *p = pi, *m = mi, *v = vi;
}

/* The loop body with every dtype and mode a compile-time constant, so each instance is
 * branch-free and vectorises; the dispatcher below picks the instance once per call. */
static inline __attribute__((always_inline)) void adamw_loop(int64_t n, const float *restrict p, const float *restrict m,
                                                             const float *restrict v, const void *restrict g,
                                                             const float *restrict acc, float *p_out, float *m_out,
                                                             float *v_out, void *restrict half_out, hyper_t h,
                                                             const int gk, const int hk, const int has_acc,
                                                             const int lerp_low, const int math) {
    for (int64_t i = 0; i < n; ++i) {
        float gi = gk == KIND_BF16 ? bf16_to_f32(((const uint16_t *)g)[i])
                 : gk == KIND_F16  ? f16_to_f32(((const uint16_t *)g)[i])
                                   : ((const float *)g)[i];
        if (has_acc) gi = acc[i] + gi;
        gi = gi * h.inv_scale;
        gi = gi * h.coef;
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_update(&pi, &mi, &vi, gi, &h, lerp_low, math);
        p_out[i] = pi;
        m_out[i] = mi;
        v_out[i] = vi;
        if (hk == KIND_BF16) ((uint16_t *)half_out)[i] = f32_to_bf16(pi);
        else if (hk == KIND_F16) ((uint16_t *)half_out)[i] = f32_to_f16(pi);
    }
}

#define LOOP(GK, HK, ACC, LOW, M) adamw_loop(n, p, m, v, g, acc, p_out, m_out, v_out, half_out, h, GK, HK, ACC, LOW, M)
#define BY_LOW(GK, HK, ACC)                                                                                    \
    (math == MATH_FLOAT ? LOOP(GK, HK, ACC, 0, MATH_FLOAT)                                                     \
     : math == MATH_FLOAT_UNFUSED ? LOOP(GK, HK, ACC, 0, MATH_FLOAT_UNFUSED)                                   \
     : math == MATH_DOUBLE ? LOOP(GK, HK, ACC, 0, MATH_DOUBLE)                                                 \
     : lerp_low ? LOOP(GK, HK, ACC, 1, MATH_SINGLE) : LOOP(GK, HK, ACC, 0, MATH_SINGLE))
#define BY_ACC(GK, HK) (acc ? BY_LOW(GK, HK, 1) : BY_LOW(GK, HK, 0))
#define BY_HALF(GK) (half_kind == KIND_BF16 ? BY_ACC(GK, KIND_BF16) : half_kind == KIND_F16 ? BY_ACC(GK, KIND_F16) : BY_ACC(GK, KIND_NONE))

static void adamw_plain(int64_t n, const float *p, const float *m, const float *v, const void *g, int g_kind,
                        const float *acc, float *p_out, float *m_out, float *v_out, void *half_out, int half_kind,
                        hyper_t h, int lerp_low, int math) {
    if (g_kind == KIND_BF16) BY_HALF(KIND_BF16);
    else if (g_kind == KIND_F16) BY_HALF(KIND_F16);
    else BY_HALF(KIND_F32);
}

/* Elements per staged block: 3 fp32 blocks and a half one (14 KiB) stay in L1 between the two passes. */
enum { BLOCK = 1024, STREAM_ALIGN = 64 };

static int aligned(const void *ptr) { return ((uintptr_t)ptr % STREAM_ALIGN) == 0; }

/* nbytes: a multiple of 64; dst and src: 64-byte aligned. */
static void stream_copy(void *restrict dst, const void *restrict src, int64_t nbytes) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < nbytes; i += 64)
        _mm512_stream_si512((__m512i *)((char *)dst + i), _mm512_load_si512((const char *)src + i));
#elif defined(__AVX__)
    for (int64_t i = 0; i < nbytes; i += 32)
        _mm256_stream_si256((__m256i *)((char *)dst + i), _mm256_load_si256((const __m256i *)((const char *)src + i)));
#else
    memcpy(dst, src, (size_t)nbytes);
#endif
}

static int have_streaming(void) {
#if defined(__AVX512F__) || defined(__AVX__)
    return 1;
#else
    return 0;
#endif
}

static int run_f32(int64_t n, const float *p, const float *m, const float *v, const void *g, int g_kind,
                   const float *acc, float *p_out, float *m_out, float *v_out, void *half_out, int half_kind,
                   hyper_t h, int lerp_low, int math, int stream);

/* The scalars of the fused CUDA arithmetic `math` (see fused_adamw_f32_device). */
static hyper_t device_hyper(float inv_scale, float coef, int math, double lr, double beta1, double beta2, double eps,
                            double weight_decay, float bc1, float bc2_sqrt) {
    hyper_t h = {0};
    h.inv_scale = inv_scale;
    h.coef = coef;
    h.lr = (float)lr;
    h.b1 = (float)beta1;
    h.fb2 = (float)beta2;
    h.feps = (float)eps;
    h.lrwd = h.lr * (float)weight_decay;
    h.bc2_sqrt = bc2_sqrt;
    h.dlr = lr, h.db1 = beta1, h.db2 = beta2, h.deps = eps, h.dwd = weight_decay;
    h.decays = weight_decay != 0.0;
    h.step_size = math == MATH_DOUBLE ? (float)(lr / (double)bc1) : h.lr / bc1;
    return h;
}

/* Returns 0 on success, 1 on a bad dtype kind. */
int fused_adamw_f32(int64_t n, const float *p, const float *m, const float *v, const void *g, int g_kind,
                    const float *acc, float inv_scale, float coef, float *p_out, float *m_out, float *v_out,
                    void *half_out, int half_kind, float decay, float w1, float beta2, float one_minus_beta2,
                    float bc2_sqrt, float eps, float neg_step_size, int stream) {
    if (g_kind < KIND_F32 || g_kind > KIND_F16 || half_kind < KIND_BF16 || half_kind > KIND_NONE) return 1;
    hyper_t h = {inv_scale, coef, decay, w1, 1.0f - w1, beta2, one_minus_beta2, 1.0f / bc2_sqrt, eps, neg_step_size};
    return run_f32(n, p, m, v, g, g_kind, acc, p_out, m_out, v_out, half_out, half_kind, h, w1 < 0.5f, MATH_SINGLE,
                   stream);
}

/* As fused_adamw_f32 in the fused CUDA kernel's arithmetic `math` (MATH_FLOAT, MATH_FLOAT_UNFUSED, MATH_DOUBLE):
 * lr, beta1, beta2, eps, weight_decay as the optimizer holds them (rounded to fp32 here for the fp32 forms),
 * bc1 = 1 - beta1^step and bc2_sqrt = sqrt(1 - beta2^step) as that kernel computed them. Returns 1 on a bad kind. */
int fused_adamw_f32_device(int64_t n, const float *p, const float *m, const float *v, const void *g, int g_kind,
                           const float *acc, float inv_scale, float coef, float *p_out, float *m_out, float *v_out,
                           void *half_out, int half_kind, int math, double lr, double beta1, double beta2, double eps,
                           double weight_decay, float bc1, float bc2_sqrt, int stream) {
    if (g_kind < KIND_F32 || g_kind > KIND_F16 || half_kind < KIND_BF16 || half_kind > KIND_NONE) return 1;
    if (math < MATH_FLOAT || math > MATH_DOUBLE) return 1;
    const hyper_t h = device_hyper(inv_scale, coef, math, lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt);
    return run_f32(n, p, m, v, g, g_kind, acc, p_out, m_out, v_out, half_out, half_kind, h, 0, math, stream);
}

static int run_f32(int64_t n, const float *p, const float *m, const float *v, const void *g, int g_kind,
                   const float *acc, float *p_out, float *m_out, float *v_out, void *half_out, int half_kind,
                   hyper_t h, int lerp_low, int math, int stream) {
    const int gsz = g_kind == KIND_F32 ? 4 : 2;
    if (!stream || !have_streaming() || n < 2 * BLOCK) {
        adamw_plain(n, p, m, v, g, g_kind, acc, p_out, m_out, v_out, half_out, half_kind, h, lerp_low, math);
        return 0;
    }
    /* head: plain, up to the first element where the fp32 outputs are 64-byte aligned */
    int64_t head = (int64_t)(((STREAM_ALIGN - (uintptr_t)p_out % STREAM_ALIGN) % STREAM_ALIGN) / 4);
    if ((uintptr_t)p_out % 4) head = n; /* not even float-aligned: no streaming */
    adamw_plain(head, p, m, v, g, g_kind, acc, p_out, m_out, v_out, half_out, half_kind, h, lerp_low, math);
    const int64_t body_end = head + (n - head) / BLOCK * BLOCK;
    /* an output is streamed when it does not alias an input and is aligned at the body's start */
    const int s_p = p_out != p && aligned(p_out + head);
    const int s_m = m_out != m && aligned(m_out + head);
    const int s_v = v_out != v && aligned(v_out + head);
    const int s_h = half_kind != KIND_NONE && aligned((char *)half_out + head * 2);
    static _Thread_local float bp[BLOCK] __attribute__((aligned(64))), bm[BLOCK] __attribute__((aligned(64))),
        bv[BLOCK] __attribute__((aligned(64)));
    static _Thread_local uint16_t bh[BLOCK] __attribute__((aligned(64)));
    for (int64_t i = head; i < body_end; i += BLOCK) {
        float *po = s_p ? bp : p_out + i, *mo = s_m ? bm : m_out + i, *vo = s_v ? bv : v_out + i;
        void *ho = half_kind == KIND_NONE ? NULL : s_h ? (void *)bh : (void *)((char *)half_out + i * 2);
        adamw_plain(BLOCK, p + i, m + i, v + i, (const char *)g + i * gsz, g_kind, acc ? acc + i : NULL, po, mo, vo,
                    ho, half_kind, h, lerp_low, math);
        if (s_p) stream_copy(p_out + i, bp, BLOCK * 4);
        if (s_m) stream_copy(m_out + i, bm, BLOCK * 4);
        if (s_v) stream_copy(v_out + i, bv, BLOCK * 4);
        if (s_h) stream_copy((char *)half_out + i * 2, bh, BLOCK * 2);
    }
    adamw_plain(n - body_end, p + body_end, m + body_end, v + body_end, (const char *)g + body_end * gsz, g_kind,
                acc ? acc + body_end : NULL, p_out + body_end, m_out + body_end, v_out + body_end,
                half_kind == KIND_NONE ? NULL : (void *)((char *)half_out + body_end * 2), half_kind, h, lerp_low,
                math);
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence(); /* streamed lines reach memory before another thread or the DMA engine reads them */
#endif
    return 0;
}

/* ---- the narrow forms: bf16/fp16 moments and the remainder master, read and written in the same pass ----
 *
 * The same update as adamw_loop, op for op, with each state in its storage form:
 *   moments   fp32, bf16 or fp16: widened exactly on load, the fp32 result rounded to nearest even on store
 *   master    fp32, or (P_REM) the bf16 weight plus a 16-bit remainder, megatron/Transformer Engine's
 *             store_param_remainders: the fp32 master's high half rounded to nearest with ties away from zero
 *             is the bf16 weight, its low half the remainder; the fp32 master is rebuilt bit for bit (a
 *             negative remainder says the high half was rounded up). Round-to-nearest-even cannot be undone
 *             from 16 bits at an exact tie, hence ties away (only there do the weights differ from RNE's).
 * No streaming stores here: the narrow forms are stepped in place or into spare banks the caller owns. */

enum { P_F32 = 0, P_REM = 1 };

static inline __attribute__((always_inline)) float load_as(const void *x, int64_t i, const int k) {
    return k == KIND_BF16 ? bf16_to_f32(((const uint16_t *)x)[i])
         : k == KIND_F16  ? f16_to_f32(((const uint16_t *)x)[i])
                          : ((const float *)x)[i];
}

static inline __attribute__((always_inline)) void store_as(void *x, int64_t i, float f, const int k) {
    if (k == KIND_BF16) ((uint16_t *)x)[i] = f32_to_bf16(f);
    else if (k == KIND_F16) ((uint16_t *)x)[i] = f32_to_f16(f);
    else ((float *)x)[i] = f;
}

static inline float rem_join(uint16_t hi, int16_t rem) {
    uint32_t h = (uint32_t)hi - (rem < 0); /* undo the round up (mod 2^16: the shift drops a borrow) */
    uint32_t u = (h << 16) | (uint16_t)rem;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void rem_split(float f, uint16_t *hi, int16_t *rem) {
    uint32_t u;
    memcpy(&u, &f, 4);
    *rem = (int16_t)(uint16_t)u;
    *hi = (uint16_t)((u >> 16) + ((u >> 15) & 1u)); /* round the high half up when the low half is >= 0x8000 */
}

/* Elements per narrow block: the fp32 master and moments of a block (3 x 2 KiB) stay in L1 between the widening,
 * the update and the narrowing. */
enum { NBLOCK = 512 };

static inline __attribute__((always_inline)) void widen_loop(int64_t n, const uint16_t *restrict x,
                                                             float *restrict out, const int k) {
    for (int64_t i = 0; i < n; ++i) out[i] = load_as(x, i, k);
}

static inline __attribute__((always_inline)) void narrow_store_loop(int64_t n, const float *restrict x,
                                                                    uint16_t *restrict out, const int k) {
    for (int64_t i = 0; i < n; ++i) store_as(out, i, x[i], k);
}

/* gcc leaves a loop of bare fp16 conversions scalar: F16C's, 8 at a time, round to nearest even as the scalar
 * conversion does */
static void widen16(int64_t n, const void *x, float *out, int k) {
    if (k == KIND_BF16) {
        widen_loop(n, x, out, KIND_BF16);
        return;
    }
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))));
#endif
    widen_loop(n - i, (const uint16_t *)x + i, out + i, KIND_F16);
}

static void narrow16(int64_t n, const float *x, void *out, int k) {
    if (k == KIND_BF16) {
        narrow_store_loop(n, x, out, KIND_BF16);
        return;
    }
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    narrow_store_loop(n - i, x + i, (uint16_t *)out + i, KIND_F16);
}

static void rem_join_loop(int64_t n, const uint16_t *restrict hi, const int16_t *restrict rem, float *restrict out) {
    for (int64_t i = 0; i < n; ++i) out[i] = rem_join(hi[i], rem[i]);
}

static void rem_split_loop(int64_t n, const float *restrict x, uint16_t *restrict hi, int16_t *restrict rem) {
    for (int64_t i = 0; i < n; ++i) {
        uint16_t a;
        int16_t r;
        rem_split(x[i], &a, &r);
        hi[i] = a, rem[i] = r;
    }
}

/* Block by block: each narrow state is widened into an fp32 block on the stack, the block is stepped by the fp32
 * loop (adamw_plain) and narrowed back. Fused into the update's loop, the conversions make gcc vectorise 16 elements
 * at a time (for the 16-bit loads) and spill the update's registers, which costs where the pass is bound by the
 * cores rather than by DRAM (docs/BENCHMARKS.md). Each block is read whole before it is written, so outputs may
 * alias inputs element for element. */
static void narrow_dispatch(int64_t n, const void *p, const int16_t *rem, int p_kind, const void *m, int m_kind,
                            const void *v, int v_kind, const void *g, int g_kind, void *p_out, int16_t *rem_out,
                            void *m_out, void *v_out, void *half_out, int half_kind, hyper_t h, int lerp_low,
                            int math) {
    float bp[NBLOCK] __attribute__((aligned(64))), bm[NBLOCK] __attribute__((aligned(64))),
        bv[NBLOCK] __attribute__((aligned(64)));
    const int gsz = g_kind == KIND_F32 ? 4 : 2, rem_form = p_kind == P_REM;
    const int m16 = m_kind != KIND_F32, v16 = v_kind != KIND_F32;
    /* the remainder form's weight is its master's high half: no separate half copy */
    const int hk = rem_form ? KIND_NONE : half_kind;
    for (int64_t i = 0; i < n; i += NBLOCK) {
        const int64_t len = n - i < NBLOCK ? n - i : NBLOCK;
        if (rem_form) rem_join_loop(len, (const uint16_t *)p + i, rem + i, bp);
        if (m16) widen16(len, (const uint16_t *)m + i, bm, m_kind);
        if (v16) widen16(len, (const uint16_t *)v + i, bv, v_kind);
        float *pb = rem_form ? bp : (float *)p + i, *mb = m16 ? bm : (float *)m + i, *vb = v16 ? bv : (float *)v + i;
        float *po = rem_form ? bp : (float *)p_out + i, *mo = m16 ? bm : (float *)m_out + i;
        float *vo = v16 ? bv : (float *)v_out + i;
        adamw_plain(len, pb, mb, vb, (const char *)g + i * gsz, g_kind, NULL, po, mo, vo,
                    hk == KIND_NONE ? NULL : (uint16_t *)half_out + i, hk, h, lerp_low, math);
        if (rem_form) rem_split_loop(len, bp, (uint16_t *)p_out + i, rem_out + i);
        if (m16) narrow16(len, bm, (uint16_t *)m_out + i, m_kind);
        if (v16) narrow16(len, bv, (uint16_t *)v_out + i, v_kind);
    }
}

static int bad_kinds(int p_kind, int m_kind, int v_kind, int g_kind, int half_kind, int m_max, int v_max) {
    return p_kind < P_F32 || p_kind > P_REM || m_kind < KIND_F32 || m_kind > m_max || v_kind < KIND_F32 ||
           v_kind > v_max || g_kind < KIND_F32 || g_kind > KIND_F16 || half_kind < KIND_BF16 || half_kind > KIND_NONE;
}

/* p: fp32 master, or (p_kind P_REM) the bf16 weights with rem their remainders; outputs likewise (p_out the
 * new bf16 weights then, half_out unused). m, v and their outputs in m_kind, v_kind. Returns 0, or 1 on a bad
 * kind. The outputs may alias the inputs element for element. */
int fused_adamw_narrow(int64_t n, const void *p, const int16_t *rem, int p_kind, const void *m, int m_kind,
                       const void *v, int v_kind, const void *g, int g_kind, float inv_scale, float coef, void *p_out,
                       int16_t *rem_out, void *m_out, void *v_out, void *half_out, int half_kind, float decay,
                       float w1, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size,
                       int math, double d_lr, double d_beta1, double d_beta2, double d_eps, double d_weight_decay,
                       float d_bc1, float d_bc2_sqrt) {
    if (bad_kinds(p_kind, m_kind, v_kind, g_kind, half_kind, KIND_F16, KIND_F16)) return 1;
    if (math != MATH_SINGLE && math != MATH_FLOAT) return 1;
    hyper_t h = {inv_scale, coef, decay, w1, 1.0f - w1, beta2, one_minus_beta2, 1.0f / bc2_sqrt, eps, neg_step_size};
    if (math != MATH_SINGLE)
        h = device_hyper(inv_scale, coef, math, d_lr, d_beta1, d_beta2, d_eps, d_weight_decay, d_bc1, d_bc2_sqrt);
    narrow_dispatch(n, p, rem, p_kind, m, m_kind, v, v_kind, g, g_kind, p_out, rem_out, m_out, v_out, half_out,
                    half_kind, h, w1 < 0.5f, math);
    return 0;
}

/* ---- block-wise 8-bit moments (blockwise.py): uint8 codes into a 256-entry map, one fp32 absmax per block ----
 *
 * Per block of QBLOCK elements (the slice starts on a block boundary of its parameter; the last block may be
 * short): a coded moment is dequantised into an L1 block (map[code] * absmax), the block is stepped by the same
 * narrow pass with that moment as fp32, then requantised: the block's absmax, each value divided by it (a zero
 * block by 1) and coded as the number of map midpoints below it (the nearest map value). One sweep over memory. */

enum { KIND_Q8 = 4, QBLOCK = 256 };

/* How many of the 256 midpoints (the last +inf) lie below x: x's cell (sign, binade from 2^-26, top 7 mantissa
 * bits) holds at most one midpoint (blockwise.py checks), so its first code, plus one past that midpoint. */
static inline uint8_t q8_code(const float *restrict mid, const uint8_t *restrict cells, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    int e = (int)((u >> 23) & 0xffu) - 101;
    e = e < 0 ? 0 : e > 31 ? 31 : e;
    const int c = cells[((u >> 31) << 12) | ((uint32_t)e << 7) | ((u >> 16) & 0x7fu)];
    return (uint8_t)(c + (mid[c] < x));
}

/* n <= QBLOCK. The maximum over 8 lanes and the division into a block of its own, so both vectorise; the code
 * lookup (two table reads) stays scalar. The lanes' maximum is the block's (max is exact in any order). */
static void q8_quantise(int64_t n, const float *restrict x, const float *restrict mid, const uint8_t *restrict cells,
                        uint8_t *restrict codes, float *absmax) {
    float lane[8] = {0}, scaled[QBLOCK];
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; ++k) {
            const float a = fabsf(x[j + k]);
            lane[k] = a > lane[k] ? a : lane[k];
        }
    for (; j < n; ++j) {
        const float a = fabsf(x[j]);
        lane[0] = a > lane[0] ? a : lane[0];
    }
    float amax = lane[0];
    for (int k = 1; k < 8; ++k) amax = lane[k] > amax ? lane[k] : amax;
    *absmax = amax;
    const float d = amax > 0.0f ? amax : 1.0f;
    for (j = 0; j < n; ++j) scaled[j] = x[j] / d;
    for (j = 0; j < n; ++j) codes[j] = q8_code(mid, cells, scaled[j]);
}

static int kind_size(int k) { return k == KIND_F32 ? 4 : k == KIND_Q8 ? 1 : 2; }

/* As fused_adamw_narrow, with m_kind and/or v_kind KIND_Q8: m (v) then codes with m_absmax (v_absmax) one per
 * block, written to m_out, m_absmax_out (which may alias them); m_map/m_mid/m_cells, v_map/v_mid/v_cells: the
 * maps, their midpoints and cell codes (blockwise.tables()). */
int fused_adamw_blockwise(int64_t n, const void *p, const int16_t *rem, int p_kind, const void *m, int m_kind,
                          const float *m_absmax, const void *v, int v_kind, const float *v_absmax, const void *g,
                          int g_kind, float inv_scale, float coef, void *p_out, int16_t *rem_out, void *m_out,
                          float *m_absmax_out, void *v_out, float *v_absmax_out, void *half_out, int half_kind,
                          float decay, float w1, float beta2, float one_minus_beta2, float bc2_sqrt, float eps,
                          float neg_step_size, const float *m_map, const float *m_mid, const uint8_t *m_cells,
                          const float *v_map, const float *v_mid, const uint8_t *v_cells, int math, double d_lr,
                          double d_beta1, double d_beta2, double d_eps, double d_weight_decay, float d_bc1,
                          float d_bc2_sqrt) {
    if (bad_kinds(p_kind, m_kind, v_kind, g_kind, half_kind, KIND_Q8, KIND_Q8)) return 1;
    if (math != MATH_SINGLE && math != MATH_FLOAT) return 1;
    hyper_t h = {inv_scale, coef, decay, w1, 1.0f - w1, beta2, one_minus_beta2, 1.0f / bc2_sqrt, eps, neg_step_size};
    if (math != MATH_SINGLE)
        h = device_hyper(inv_scale, coef, math, d_lr, d_beta1, d_beta2, d_eps, d_weight_decay, d_bc1, d_bc2_sqrt);
    const int lerp_low = w1 < 0.5f, psz = p_kind == P_REM ? 2 : 4, gsz = kind_size(g_kind);
    const int msz = kind_size(m_kind), vsz = kind_size(v_kind), hsz = 2; /* half weights: bf16 or fp16 */
    float bm[QBLOCK], bv[QBLOCK];
    for (int64_t i = 0, b = 0; i < n; i += QBLOCK, ++b) {
        const int64_t len = n - i < QBLOCK ? n - i : QBLOCK;
        const uint8_t *mc = (const uint8_t *)m + i, *vc = (const uint8_t *)v + i;
        if (m_kind == KIND_Q8)
            for (int64_t j = 0; j < len; ++j) bm[j] = m_map[mc[j]] * m_absmax[b];
        if (v_kind == KIND_Q8)
            for (int64_t j = 0; j < len; ++j) bv[j] = v_map[vc[j]] * v_absmax[b];
        const void *mi = m_kind == KIND_Q8 ? (const void *)bm : (const char *)m + i * msz;
        const void *vi = v_kind == KIND_Q8 ? (const void *)bv : (const char *)v + i * vsz;
        void *mo = m_kind == KIND_Q8 ? (void *)bm : (char *)m_out + i * msz;
        void *vo = v_kind == KIND_Q8 ? (void *)bv : (char *)v_out + i * vsz;
        narrow_dispatch(len, (const char *)p + i * psz, rem ? rem + i : NULL, p_kind, mi,
                        m_kind == KIND_Q8 ? KIND_F32 : m_kind, vi, v_kind == KIND_Q8 ? KIND_F32 : v_kind,
                        (const char *)g + i * gsz, g_kind, (char *)p_out + i * psz, rem_out ? rem_out + i : NULL, mo,
                        vo, half_out ? (char *)half_out + i * hsz : NULL, half_kind, h, lerp_low, math);
        if (m_kind == KIND_Q8) q8_quantise(len, bm, m_mid, m_cells, (uint8_t *)m_out + i, m_absmax_out + b);
        if (v_kind == KIND_Q8) q8_quantise(len, bv, v_mid, v_cells, (uint8_t *)v_out + i, v_absmax_out + b);
    }
    return 0;
}
