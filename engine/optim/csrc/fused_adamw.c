/* One fused pass of AdamW (decoupled weight decay) over a slice of fp32 master weights.
 *
 * Reads the gradient in its transfer dtype (fp32, bf16 or fp16), optionally adds an fp32
 * accumulator, applies the unscale and clip factors, updates p, m, v and writes the
 * half-precision weight copy that travels back to the GPU, all in one sweep over memory:
 * about 2 + 12 + 12 + 2 = 28 bytes per parameter for bf16 grads and weights, against ~40 for
 * a stock AdamW plus separate casts.  The outputs may alias the inputs (in place) or not
 * (out of place: the caller commits the new buffers once the clip factor is known).
 *
 * The arithmetic mirrors torch's single-tensor AdamW operation by operation in fp32
 * (mul_, lerp_, mul_/addcmul_, sqrt/div/add, addcdiv_), including where torch's CPU kernels fuse a
 * multiply-add or divide by a scalar's reciprocal, so the two agree bit for bit.
 * Threading is left to the caller: each call is one slice, called with the GIL released.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

typedef struct {
    float inv_scale, coef, decay, w1, one_minus_w1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size;
} hyper_t;

/* The loop body with every dtype and mode a compile-time constant, so each instance is
 * branch-free and vectorises; the dispatcher below picks the instance once per call. */
static inline __attribute__((always_inline)) void adamw_loop(int64_t n, const float *restrict p, const float *restrict m,
                                                             const float *restrict v, const void *restrict g,
                                                             const float *restrict acc, float *p_out, float *m_out,
                                                             float *v_out, void *restrict half_out, hyper_t h,
                                                             const int gk, const int hk, const int has_acc,
                                                             const int lerp_low) {
    for (int64_t i = 0; i < n; ++i) {
        float gi = gk == KIND_BF16 ? bf16_to_f32(((const uint16_t *)g)[i])
                 : gk == KIND_F16  ? (float)((const _Float16 *)g)[i]
                                   : ((const float *)g)[i];
        if (has_acc) gi = acc[i] + gi;
        gi = gi * h.inv_scale;
        gi = gi * h.coef;
        float pi = p[i] * h.decay;
        float mi = m[i];
        /* torch's vectorised lerp_: one fused multiply-add from the nearer end */
        mi = lerp_low ? fmaf(h.w1, gi - mi, mi) : fmaf(h.w1 - 1.0f, gi - mi, gi);
        float vi = v[i] * h.beta2;
        vi = fmaf(h.one_minus_beta2 * gi, gi, vi); /* addcmul_, contracted as torch's build does */
        float denom = sqrtf(vi) * h.inv_bc2_sqrt + h.eps; /* torch divides by a scalar as a multiply by its reciprocal */
        pi = pi + (h.neg_step_size * mi) / denom; /* addcdiv_: self + value * t1 / t2 */
        p_out[i] = pi;
        m_out[i] = mi;
        v_out[i] = vi;
        if (hk == KIND_BF16) ((uint16_t *)half_out)[i] = f32_to_bf16(pi);
        else if (hk == KIND_F16) ((_Float16 *)half_out)[i] = (_Float16)pi;
    }
}

#define LOOP(GK, HK, ACC, LOW) adamw_loop(n, p, m, v, g, acc, p_out, m_out, v_out, half_out, h, GK, HK, ACC, LOW)
#define BY_LOW(GK, HK, ACC) (lerp_low ? LOOP(GK, HK, ACC, 1) : LOOP(GK, HK, ACC, 0))
#define BY_ACC(GK, HK) (acc ? BY_LOW(GK, HK, 1) : BY_LOW(GK, HK, 0))
#define BY_HALF(GK) (half_kind == KIND_BF16 ? BY_ACC(GK, KIND_BF16) : half_kind == KIND_F16 ? BY_ACC(GK, KIND_F16) : BY_ACC(GK, KIND_NONE))

/* Returns 0 on success, 1 on a bad dtype kind. */
int fused_adamw_f32(int64_t n, const float *p, const float *m, const float *v, const void *g, int g_kind,
                    const float *acc, float inv_scale, float coef, float *p_out, float *m_out, float *v_out,
                    void *half_out, int half_kind, float decay, float w1, float beta2, float one_minus_beta2,
                    float bc2_sqrt, float eps, float neg_step_size) {
    if (g_kind < KIND_F32 || g_kind > KIND_F16 || half_kind < KIND_BF16 || half_kind > KIND_NONE) return 1;
    hyper_t h = {inv_scale, coef, decay, w1, 1.0f - w1, beta2, one_minus_beta2, 1.0f / bc2_sqrt, eps, neg_step_size};
    const int lerp_low = w1 < 0.5f;
    if (g_kind == KIND_BF16) BY_HALF(KIND_BF16);
    else if (g_kind == KIND_F16) BY_HALF(KIND_F16);
    else BY_HALF(KIND_F32);
    return 0;
}
