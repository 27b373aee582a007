/* Quantized matrix products for the embedded engine's `gguf` weight format (CPU).

   y[m, n] = sum_k x[m, k] * W[n, k] with W as a GGUF ships it, in blocks of 32 along k: Q4_1
   (4-bit codes q, float16 scale d and minimum mn: w = d * q + mn) for the layers' projections,
   Q8_0 (int8 codes, float16 scale d: w = d * q) for the LM head. Each row of x is quantized per
   block of 32 to int8 codes with one float scale (llama.cpp's Q8_1 / Q8_0 arithmetic), so a
   block's dot product is an exact integer sum and only its scaling is floating point:

       y[m, n] = sum over blocks b, in order, of  fma(dot_b, d[n,b] * xd[m,b], .)  (+ mn[n,b] * xs[m,b])

   Lossless speculation needs a row's result not to depend on the rows beside it. Every output
   element here is that same sequence of float operations whatever M is: a row of x is quantized
   on its own, integer dots are exact, and M only decides how many rows share one load of a
   weight block.

   The weights are repacked once (qmm_pack_*) into the layout of the path compiled in:
   - AVX512-VNNI: 16 output rows side by side, 4 bytes of k each per 32-bit lane, so one vpdpbusd
     against 4 broadcast bytes of x advances 16 outputs and a block's dot lands whole in its
     lane (llama.cpp's repacked kernels do the same); up to 8 rows of x share each weight load.
   - AVX2: the same layout at 8 output rows a vector; without VNNI a 4-byte dot is vpmaddubsw then
     vpmaddwd; up to 4 rows of x share each weight load.
   - plain C: row by row as shipped, one block's dot in 8 lanes.

   Compiled on first use with -march=native and -ffp-contract=off (qmm.py), so the float steps
   are exactly those written here. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32
#define MT 4 /* rows of x that share one weight load */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(QMM_NO_AVX512)
#define QMM_AVX512 1
#endif

/* ---- activations: int8 per block of 32, one float scale xd and xd * sum(q) per block ---- */

typedef struct {
    int8_t *q;   /* [K] codes */
    uint8_t *u;  /* [K] codes + 128, for Q8_0 weights on the AVX512 path (else NULL) */
    float *d;    /* [nb] scales */
    float *s;    /* [nb] scale * sum of the block's codes */
} xrow_t;

static void quantize_row(const float *x, int64_t K, xrow_t r) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            r.q[b * QK + j] = (int8_t)v;
            if (r.u) r.u[b * QK + j] = (uint8_t)(v + 128);
            sum += v;
        }
        r.d[b] = d;
        r.s[b] = d * (float)sum;
    }
}

/* RMS norm of one row, as the model's: x / sqrt(mean(x^2) + eps) * w, the squares summed in order. */
static void rms_norm_row(const float *x, const float *w, float eps, int64_t K, float *out) {
    float ss = 0.0f;
    for (int64_t j = 0; j < K; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (int64_t j = 0; j < K; j++) out[j] = (x[j] * r) * w[j];
}

void qmm_rms_norm(const float *x, const float *w, float eps, int64_t M, int64_t K, float *out) {
    for (int64_t i = 0; i < M; i++) rms_norm_row(x + i * K, w + 0, eps, K, out + i * K);
}

/* x's rows (RMS-normed first when norm is not NULL) quantized into one allocation (freed by the caller). */
static xrow_t *quantize(const float *x, const float *norm, float eps, int64_t M, int64_t K, int with_u) {
    const int64_t nb = K / QK;
    size_t bytes = sizeof(xrow_t) * M + sizeof(float) * (2 * M * nb + (norm ? K : 0))
                   + (size_t)(M * K) * (with_u ? 2 : 1);
    char *p = malloc(bytes);
    if (!p) return NULL;
    xrow_t *rows = (xrow_t *)p;
    float *f = (float *)(rows + M);
    float *normed = f + 2 * M * nb;
    int8_t *q = (int8_t *)(normed + (norm ? K : 0));
    for (int64_t i = 0; i < M; i++) {
        rows[i] = (xrow_t){q + i * K, with_u ? (uint8_t *)(q + M * K + i * K) : NULL, f + 2 * i * nb,
                           f + (2 * i + 1) * nb};
        if (norm) rms_norm_row(x + i * K, norm, eps, K, normed);
        quantize_row(norm ? normed : x + i * K, K, rows[i]);
    }
    return rows;
}

static inline uint16_t f32_to_f16(float v) { /* exact for the float16 values GGUF blocks hold */
    _Float16 h = (_Float16)v;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

#if defined(QMM_AVX512) || defined(__AVX2__)
/* Each tile asks for the weight block QMM_PF_BLOCKS ahead of the one it multiplies (on AVX512, 2.5 KB of
   Q4_1, 4.8 KB of Q8_0 at 8; past a tile's last block, the next tile's first ones). The packed
   weights are read in order, yet a product of a few rows waits on memory block after block
   without it (scripts/qmm_prefetch.py measures the difference; docs/engine.md). A prefetch
   never faults, so the last tile's may point past the end. -DQMM_PF_BLOCKS=0 builds without.
   always_inline: GCC 12 dropped the prefetches of a plain static inline here. */
#ifndef QMM_PF_BLOCKS
#define QMM_PF_BLOCKS 8
#endif
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *p, int bytes) {
    if (QMM_PF_BLOCKS > 0)
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(p + l), _MM_HINT_T0);
}
#endif

#ifdef QMM_AVX512
/* ================= AVX512-VNNI: 16 output rows a vector ================= */

#define NR 16
#undef MT
#define MT 8
/* Q4_1, per 16 rows and block: 4 x 64 code bytes (lane n, byte j of vector v: low nibble k = 8v + j,
   high nibble k = 8v + 4 + j), 16 float16 d, 16 float16 mn. */
#define Q4_STRIDE (4 * 64 + 2 * 32)
/* Q8_0, per 16 rows and block: 8 x 64 code bytes (lane n, byte j of vector g: k = 4g + j), 16
   float16 d, 16 int32 -128 * sum of the row's 32 codes (undoes x + 128). */
#define Q8_STRIDE (8 * 64 + 32 + 64)

int64_t qmm_q4_1_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * (K / QK) * Q4_STRIDE; }
int64_t qmm_q8_0_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * (K / QK) * Q8_STRIDE; }

void qmm_pack_q4_1(const uint8_t *codes, const float *d, const float *mn, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK;
    memset(out, 0, (size_t)qmm_q4_1_packed_size(N, K));
    for (int64_t n = 0; n < N; n++) {
        const int64_t blk = n / NR, lane = n % NR;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = out + (blk * nb + b) * Q4_STRIDE;
            const uint8_t *c = codes + n * K + b * QK;
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < 4; j++)
                    p[v * 64 + lane * 4 + j] = (uint8_t)(c[8 * v + j] | (c[8 * v + 4 + j] << 4));
            uint16_t hd = f32_to_f16(d[n * nb + b]), hm = f32_to_f16(mn[n * nb + b]);
            memcpy(p + 256 + lane * 2, &hd, 2);
            memcpy(p + 288 + lane * 2, &hm, 2);
        }
    }
}

void qmm_pack_q8_0(const int8_t *codes, const float *d, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK;
    memset(out, 0, (size_t)qmm_q8_0_packed_size(N, K));
    for (int64_t n = 0; n < N; n++) {
        const int64_t blk = n / NR, lane = n % NR;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = out + (blk * nb + b) * Q8_STRIDE;
            const int8_t *c = codes + n * K + b * QK;
            int32_t sum = 0;
            for (int g = 0; g < 8; g++)
                for (int j = 0; j < 4; j++) {
                    p[g * 64 + lane * 4 + j] = (uint8_t)c[4 * g + j];
                    sum += c[4 * g + j];
                }
            uint16_t hd = f32_to_f16(d[n * nb + b]);
            int32_t corr = -128 * sum;
            memcpy(p + 512 + lane * 2, &hd, 2);
            memcpy(p + 544 + lane * 4, &corr, 4);
        }
    }
}

static inline __m512i bcast4(const void *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }


static inline __attribute__((always_inline)) void q4_1_tile(
        int mt, int64_t nb, const uint8_t *w, const xrow_t *x, float *y, int64_t ldy, int64_t n) {
    const __mmask16 store = n >= NR ? 0xFFFF : (__mmask16)((1u << n) - 1);
    __m512 acc[MT];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++, w += Q4_STRIDE) {
        prefetch_block(w + QMM_PF_BLOCKS * Q4_STRIDE, Q4_STRIDE);
        __m512i dot[MT], dot2[MT]; /* two chains of integer sums a row, added after (exact) */
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mt; i++) dot[i] = dot2[i] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")
        for (int v = 0; v < 4; v++) {
            const __m512i raw = _mm512_loadu_si512(w + v * 64);
            const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < mt; i++) {
                const int8_t *xq = x[i].q + b * QK + 8 * v;
                dot[i] = _mm512_dpbusd_epi32(dot[i], lo, bcast4(xq));
                dot2[i] = _mm512_dpbusd_epi32(dot2[i], hi, bcast4(xq + 4));
            }
        }
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mt; i++) dot[i] = _mm512_add_epi32(dot[i], dot2[i]);
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 256)));
        const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 288)));
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mt; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(x[i].d[b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(x[i].s[b]), acc[i]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mt; i++) _mm512_mask_storeu_ps(y + i * ldy, store, acc[i]);
}

static inline __attribute__((always_inline)) void q8_0_tile(
        int mt, int64_t nb, const uint8_t *w, const xrow_t *x, float *y, int64_t ldy, int64_t n) {
    const __mmask16 store = n >= NR ? 0xFFFF : (__mmask16)((1u << n) - 1);
    __m512 acc[MT];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += Q8_STRIDE) {
        prefetch_block(w + QMM_PF_BLOCKS * Q8_STRIDE, Q8_STRIDE);
        const __m512i corr = _mm512_loadu_si512(w + 544);
        __m512i dot[MT], dot2[MT]; /* two chains of integer sums a row, added after (exact) */
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mt; i++) { dot[i] = corr; dot2[i] = _mm512_setzero_si512(); }
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 8; g += 2) {
            const __m512i w0 = _mm512_loadu_si512(w + g * 64), w1 = _mm512_loadu_si512(w + g * 64 + 64);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < mt; i++) {
                dot[i] = _mm512_dpbusd_epi32(dot[i], bcast4(x[i].u + b * QK + 4 * g), w0);
                dot2[i] = _mm512_dpbusd_epi32(dot2[i], bcast4(x[i].u + b * QK + 4 * g + 4), w1);
            }
        }
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mt; i++) dot[i] = _mm512_add_epi32(dot[i], dot2[i]);
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 512)));
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(x[i].d[b])), acc[i]);
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mt; i++) _mm512_mask_storeu_ps(y + i * ldy, store, acc[i]);
}

#define TILES(CALL)                                                                  \
    for (int64_t blk = 0; blk * NR < N; blk++) {                                     \
        const int64_t n = N - blk * NR;                                              \
        int64_t m = 0;                                                               \
        for (; m + MT <= M; m += MT) CALL(MT);                                       \
        switch (M - m) {                                                             \
        case 7: CALL(7); break;                                                      \
        case 6: CALL(6); break;                                                      \
        case 5: CALL(5); break;                                                      \
        case 4: CALL(4); break;                                                      \
        case 3: CALL(3); break;                                                      \
        case 2: CALL(2); break;                                                      \
        case 1: CALL(1); break;                                                      \
        default: break;                                                              \
        }                                                                            \
    }

#define Q8_WITH_U 1 /* Q8_0 products take x + 128 */
#define QMM_PATH "avx512-vnni"

#elif defined(__AVX2__)
/* ================= AVX2: 8 output rows a vector ================= */

#define NR 8
/* Q4_1, per 8 rows and block: 4 x 32 code bytes (lane n, byte j of vector v: low nibble k = 8v + j,
   high nibble k = 8v + 4 + j), 8 float d, 8 float mn. */
#define Q4_STRIDE (4 * 32 + 2 * 32)
/* Q8_0, per 8 rows and block: 8 x 32 code bytes (lane n, byte j of vector g: k = 4g + j), 8 float d. */
#define Q8_STRIDE (8 * 32 + 32)

int64_t qmm_q4_1_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * (K / QK) * Q4_STRIDE; }
int64_t qmm_q8_0_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * (K / QK) * Q8_STRIDE; }

void qmm_pack_q4_1(const uint8_t *codes, const float *d, const float *mn, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK;
    memset(out, 0, (size_t)qmm_q4_1_packed_size(N, K));
    for (int64_t n = 0; n < N; n++) {
        const int64_t blk = n / NR, lane = n % NR;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = out + (blk * nb + b) * Q4_STRIDE;
            const uint8_t *c = codes + n * K + b * QK;
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < 4; j++)
                    p[v * 32 + lane * 4 + j] = (uint8_t)(c[8 * v + j] | (c[8 * v + 4 + j] << 4));
            memcpy(p + 128 + lane * 4, d + n * nb + b, 4);
            memcpy(p + 160 + lane * 4, mn + n * nb + b, 4);
        }
    }
}

void qmm_pack_q8_0(const int8_t *codes, const float *d, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK;
    memset(out, 0, (size_t)qmm_q8_0_packed_size(N, K));
    for (int64_t n = 0; n < N; n++) {
        const int64_t blk = n / NR, lane = n % NR;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = out + (blk * nb + b) * Q8_STRIDE;
            for (int g = 0; g < 8; g++) memcpy(p + g * 32 + lane * 4, codes + n * K + b * QK + 4 * g, 4);
            memcpy(p + 256 + lane * 4, d + n * nb + b, 4);
        }
    }
}

static inline __m256i bcast4(const void *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }


static inline __attribute__((always_inline)) void store_rows(float *y, __m256 v, int64_t n) {
    if (n >= NR) {
        _mm256_storeu_ps(y, v);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, v);
        memcpy(y, tmp, sizeof(float) * (size_t)n);
    }
}

/* Without VNNI a 4-byte dot takes vpmaddubsw (pairs into int16) and vpmaddwd (pairs into int32).
   Q4_1: a code times an int8 of x is at most 15 * 127, so a block's 8 pair sums of pairs add up in
   int16 (16 * 1905 < 32768) before one vpmaddwd; exact. */
static inline __attribute__((always_inline)) void q4_1_tile(
        int mt, int64_t nb, const uint8_t *w, const xrow_t *x, float *y, int64_t ldy, int64_t n) {
    __m256 acc[MT];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += Q4_STRIDE) {
        prefetch_block(w + QMM_PF_BLOCKS * Q4_STRIDE, Q4_STRIDE);
        __m256i s16[MT];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mt; i++) s16[i] = _mm256_setzero_si256();
        _Pragma("GCC unroll 4")
        for (int v = 0; v < 4; v++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + v * 32));
            const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mt; i++) {
                const int8_t *xq = x[i].q + b * QK + 8 * v;
                s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, bcast4(xq)));
                s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, bcast4(xq + 4)));
            }
        }
        const __m256 wd = _mm256_loadu_ps((const float *)(w + 128)), wm = _mm256_loadu_ps((const float *)(w + 160));
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mt; i++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));
            acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(wd, _mm256_set1_ps(x[i].d[b])), acc[i]);
            acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(x[i].s[b]), acc[i]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mt; i++) store_rows(y + i * ldy, acc[i], n);
}

/* Q8_0: |w| as unsigned times x with w's sign (a pair is at most 2 * 128 * 127 < 32768), each group
   of 4 bytes into int32 at once. */
static inline __attribute__((always_inline)) void q8_0_tile(
        int mt, int64_t nb, const uint8_t *w, const xrow_t *x, float *y, int64_t ldy, int64_t n) {
    __m256 acc[MT];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += Q8_STRIDE) {
        prefetch_block(w + QMM_PF_BLOCKS * Q8_STRIDE, Q8_STRIDE);
        __m256i dot[MT];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mt; i++) dot[i] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 8; g++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + g * 32));
            const __m256i wabs = _mm256_sign_epi8(wv, wv);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mt; i++) {
                const __m256i xs = _mm256_sign_epi8(bcast4(x[i].q + b * QK + 4 * g), wv);
                dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones));
            }
        }
        const __m256 wd = _mm256_loadu_ps((const float *)(w + 256));
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mt; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(wd, _mm256_set1_ps(x[i].d[b])), acc[i]);
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mt; i++) store_rows(y + i * ldy, acc[i], n);
}

#define TILES(CALL)                                                                  \
    for (int64_t blk = 0; blk * NR < N; blk++) {                                     \
        const int64_t n = N - blk * NR;                                              \
        int64_t m = 0;                                                               \
        for (; m + MT <= M; m += MT) CALL(MT);                                       \
        switch (M - m) {                                                             \
        case 3: CALL(3); break;                                                      \
        case 2: CALL(2); break;                                                      \
        case 1: CALL(1); break;                                                      \
        default: break;                                                              \
        }                                                                            \
    }

#define Q8_WITH_U 0
#define QMM_PATH "avx2"

#else
/* ================= plain C: row by row, one block's dot in 8 lanes ================= */

/* Q4_1 per row: nb x 16 code bytes (byte j: code j low nibble, code j + 16 high), nb float d, nb float mn. */
#define Q4_ROW(K) ((K) / QK * (16 + 8))
#define Q8_ROW(K) ((K) + (K) / QK * 4)

int64_t qmm_q4_1_packed_size(int64_t N, int64_t K) { return N * Q4_ROW(K); }
int64_t qmm_q8_0_packed_size(int64_t N, int64_t K) { return N * Q8_ROW(K); }

void qmm_pack_q4_1(const uint8_t *codes, const float *d, const float *mn, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK;
    for (int64_t n = 0; n < N; n++) {
        uint8_t *p = out + n * Q4_ROW(K);
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < 16; j++)
                p[b * 16 + j] = (uint8_t)(codes[n * K + b * QK + j] | (codes[n * K + b * QK + 16 + j] << 4));
        memcpy(p + nb * 16, d + n * nb, sizeof(float) * nb);
        memcpy(p + nb * 20, mn + n * nb, sizeof(float) * nb);
    }
}

void qmm_pack_q8_0(const int8_t *codes, const float *d, int64_t N, int64_t K, uint8_t *out) {
    for (int64_t n = 0; n < N; n++) {
        memcpy(out + n * Q8_ROW(K), codes + n * K, (size_t)K);
        memcpy(out + n * Q8_ROW(K) + K, d + n * (K / QK), sizeof(float) * (K / QK));
    }
}

typedef struct { float v[8]; } acc_t;
static inline acc_t acc_zero(void) { acc_t a; memset(&a, 0, sizeof a); return a; }
static inline float acc_sum(acc_t a) {
    float v0 = a.v[0] + a.v[4], v1 = a.v[1] + a.v[5], v2 = a.v[2] + a.v[6], v3 = a.v[3] + a.v[7];
    return (v0 + v2) + (v1 + v3);
}

static inline __attribute__((always_inline)) void q4_1_tile(
        int mt, int64_t K, const uint8_t *w, const xrow_t *x, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    const float *wd = (const float *)(w + nb * 16), *wm = (const float *)(w + nb * 20);
    acc_t acc[MT];
    float mins[MT];
    for (int i = 0; i < mt; i++) { acc[i] = acc_zero(); mins[i] = 0.0f; }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs = w + b * 16;
        for (int i = 0; i < mt; i++) {
            const int8_t *xb = x[i].q + b * QK;
            const float scale = wd[b] * x[i].d[b];
            for (int l = 0; l < 8; l++) {
                int dot = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++) dot += (j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) * xb[j];
                acc[i].v[l] = fmaf((float)dot, scale, acc[i].v[l]);
            }
            mins[i] = fmaf(wm[b], x[i].s[b], mins[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[i * ldy] = acc_sum(acc[i]) + mins[i];
}

static inline __attribute__((always_inline)) void q8_0_tile(
        int mt, int64_t K, const uint8_t *w, const xrow_t *x, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    const int8_t *wq = (const int8_t *)w;
    const float *wd = (const float *)(w + K);
    acc_t acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = acc_zero();
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < mt; i++) {
            const int8_t *xb = x[i].q + b * QK;
            const float scale = wd[b] * x[i].d[b];
            for (int l = 0; l < 8; l++) {
                int dot = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++) dot += wq[b * QK + j] * xb[j];
                acc[i].v[l] = fmaf((float)dot, scale, acc[i].v[l]);
            }
        }
    }
    for (int i = 0; i < mt; i++) y[i * ldy] = acc_sum(acc[i]);
}

/* The rows past the last whole tile share one weight load too: a ragged verify feeds any count. */
#define ROWS(CALL, ROWBYTES)                                                         \
    for (int64_t n = 0; n < N; n++) {                                                \
        const uint8_t *w = packed + n * (ROWBYTES);                                  \
        int64_t m = 0;                                                               \
        for (; m + MT <= M; m += MT) CALL(MT);                                       \
        switch (M - m) {                                                             \
        case 3: CALL(3); break;                                                      \
        case 2: CALL(2); break;                                                      \
        case 1: CALL(1); break;                                                      \
        default: break;                                                              \
        }                                                                            \
    }

int qmm_linear_q4_1(const float *x, const float *norm, float eps, int64_t M, int64_t K, const uint8_t *packed, int64_t N, float *y) {
    xrow_t *rows = quantize(x, norm, eps, M, K, 0);
    if (!rows) return -1;
#define Q4CALL(T) q4_1_tile(T, K, w, rows + m, y + m * N + n, N)
    ROWS(Q4CALL, Q4_ROW(K))
    free(rows);
    return 0;
}

int qmm_linear_q8_0(const float *x, const float *norm, float eps, int64_t M, int64_t K, const uint8_t *packed, int64_t N, float *y) {
    xrow_t *rows = quantize(x, norm, eps, M, K, 0);
    if (!rows) return -1;
#define Q8CALL(T) q8_0_tile(T, K, w, rows + m, y + m * N + n, N)
    ROWS(Q8CALL, Q8_ROW(K))
    free(rows);
    return 0;
}

const char *qmm_path(void) { return "c"; }
#endif

#if defined(QMM_AVX512) || defined(__AVX2__)
/* Both repacked paths: TILES runs tiles of NR output rows, n of them real (fewer in the last tile
   of an N not a multiple of NR), over MT rows of x at a time and the rows past the last whole MT
   together. */
int qmm_linear_q4_1(const float *x, const float *norm, float eps, int64_t M, int64_t K, const uint8_t *packed, int64_t N, float *y) {
    const int64_t nb = K / QK;
    xrow_t *rows = quantize(x, norm, eps, M, K, 0);
    if (!rows) return -1;
#define Q4CALL(T) q4_1_tile(T, nb, packed + blk * nb * Q4_STRIDE, rows + m, y + m * N + blk * NR, N, n)
    TILES(Q4CALL)
    free(rows);
    return 0;
}

int qmm_linear_q8_0(const float *x, const float *norm, float eps, int64_t M, int64_t K, const uint8_t *packed, int64_t N, float *y) {
    const int64_t nb = K / QK;
    xrow_t *rows = quantize(x, norm, eps, M, K, Q8_WITH_U);
    if (!rows) return -1;
#define Q8CALL(T) q8_0_tile(T, nb, packed + blk * nb * Q8_STRIDE, rows + m, y + m * N + blk * NR, N, n)
    TILES(Q8CALL)
    free(rows);
    return 0;
}

const char *qmm_path(void) { return QMM_PATH; }
#endif

/* ---- attention of one layer: RoPE, the cache write and causal attention, row by row ---- */

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline float sum16(v16 v) { /* a fixed tree: halves added, then halves of that */
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline v16 max16(v16 a, v16 b) {
    v16 r;
    for (int j = 0; j < 16; j++) r[j] = a[j] > b[j] ? a[j] : b[j];
    return r;
}

/* e^x for x <= 0 (scores minus their maximum), 16 at a time: x = n ln2 + r, |r| <= ln2 / 2,
   e^r by its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n; 0 below -87. */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.0f, shifter = (v16){0} + 12582912.0f; /* 1.5 * 2^23 */
    const i16v low = x < lo; /* -1 where x < -87 */
    x = (v16)((low & (i16v)lo) | (~low & (i16v)x));
    /* x * log2(e) rounded to the nearest integer, ties to even (as nearbyintf): |x * log2(e)| < 126 */
    const v16 n = (x * 1.44269504f + shifter) - shifter;
    const v16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    v16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i16v bits = (i16v)p + (__builtin_convertvector(n, i16v) << 23);
    return (v16)(~(x <= lo) & bits); /* 0 at -87 and below */
}

/* x * cos + rotate_half(x) * sin over one head of D values (the halves layout). */
static void rope_head(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t j = 0; j < D; j++) {
        const float rot = j < half ? -x[j + half] : x[j - half];
        out[j] = x[j] * c[j] + rot * s[j];
    }
}

/* scores[0 .. nk) -> their exponentials minus the maximum, in place, summed in chunks of 16 from key 0
   (past the last key: e = 0, scores padded with -inf up to a multiple of 16); returns 1 / the sum. */
static inline float softmax_exp(float *scores, int64_t nk) {
    const int64_t padded = (nk + 15) / 16 * 16;
    for (int64_t l = nk; l < padded; l++) scores[l] = -INFINITY;
    v16 mv = load16(scores);
    for (int64_t l = 16; l < padded; l += 16) mv = max16(mv, load16(scores + l));
    float mx = mv[0];
    for (int j = 1; j < 16; j++) mx = mv[j] > mx ? mv[j] : mx;
    v16 tv = (v16){0};
    for (int64_t l = 0; l < padded; l += 16) {
        const v16 e = exp16(load16(scores + l) - mx);
        store16(scores + l, e);
        tv = tv + e;
    }
    return 1.0f / sum16(tv);
}

#define GQ 6 /* queries of one KV head that share each load of its keys and values (D = 64) */

#ifdef QMM_AVX512
/* 16 vectors -> the 16 sums of their lanes, in order, by a fixed tree: lanes i and i + 8 added,
   then i and i + 4, i and i + 2, i and i + 1, each step pairing two vectors' halves. */
static inline __m512 reduce16(__m512 a[16]) {
    const __m512i s1a = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i s1b = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i s2a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i s2b = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i s3a = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    const __m512i s3b = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    const __m512i s4a = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    const __m512i s4b = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) /* lanes 0-7: key k's 8 partial sums, 8-15: key k + 8's */
        t[k] = _mm512_add_ps(_mm512_permutex2var_ps(a[k], s1a, a[k + 8]), _mm512_permutex2var_ps(a[k], s1b, a[k + 8]));
    for (int k = 0; k < 4; k++) /* 4 lanes each: keys k, k + 4, k + 8, k + 12 */
        u[k] = _mm512_add_ps(_mm512_permutex2var_ps(t[k], s2a, t[k + 4]), _mm512_permutex2var_ps(t[k], s2b, t[k + 4]));
    for (int k = 0; k < 2; k++) /* 2 lanes each: keys k, k + 2, ..., k + 14 */
        w[k] = _mm512_add_ps(_mm512_permutex2var_ps(u[k], s3a, u[k + 2]), _mm512_permutex2var_ps(u[k], s3b, u[k + 2]));
    return _mm512_add_ps(_mm512_permutex2var_ps(w[0], s4a, w[1]), _mm512_permutex2var_ps(w[0], s4b, w[1]));
}

/* One query's score against one key: explicit FMAs over the 4 quarters, then its lanes summed. */
static inline __m512 qk_lanes(const __m512 *qv, const float *k) {
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    acc = _mm512_fmadd_ps(qv[1], _mm512_loadu_ps(k + 16), acc);
    acc = _mm512_fmadd_ps(qv[2], _mm512_loadu_ps(k + 32), acc);
    return _mm512_fmadd_ps(qv[3], _mm512_loadu_ps(k + 48), acc);
}

/* D = 64 on AVX512: n (<= GQ) queries q[t] (scaled, roped) attending to the keys 0 .. nk[t] - 1 of
   one KV head (k, v: [length, 64]); scratch: n rows of `stride` scores. A query's scores come 16
   keys at a time (reduce16) over the whole blocks of 16 below nk[t], key by key after, so each is
   fixed by the query, the keys and nk[t]; the queries only share the loads of the values. */
static inline __attribute__((always_inline)) void attend64(
        int n, const float *const *q, const int64_t *nk, const float *k, const float *v, float *scratch,
        int64_t stride, float *const *out) {
    int64_t most = 0, whole[GQ];
    __m512 qv[GQ][4];
    float inv[GQ];
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < 4; j++) qv[t][j] = _mm512_loadu_ps(q[t] + 16 * j);
        whole[t] = nk[t] / 16 * 16;
        most = nk[t] > most ? nk[t] : most;
    }
    for (int64_t l = 0; l + 16 <= most; l += 16) /* a block of keys stays in L1 for every query */
        _Pragma("GCC unroll 6")
        for (int t = 0; t < n; t++)
            if (l < whole[t]) {
                __m512 acc[16];
                for (int kk = 0; kk < 16; kk++) acc[kk] = qk_lanes(qv[t], k + (l + kk) * 64);
                _mm512_storeu_ps(scratch + t * stride + l, reduce16(acc));
            }
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++) {
        float *sc = scratch + t * stride;
        for (int64_t l = whole[t]; l < nk[t]; l++) sc[l] = _mm512_reduce_add_ps(qk_lanes(qv[t], k + l * 64));
        inv[t] = softmax_exp(sc, nk[t]);
    }
    __m512 o[GQ][4];
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++)
        for (int j = 0; j < 4; j++) o[t][j] = _mm512_setzero_ps();
    for (int64_t l = 0; l < most; l++) {
        const __m512 v0 = _mm512_loadu_ps(v + l * 64), v1 = _mm512_loadu_ps(v + l * 64 + 16),
                     v2 = _mm512_loadu_ps(v + l * 64 + 32), v3 = _mm512_loadu_ps(v + l * 64 + 48);
        _Pragma("GCC unroll 6")
        for (int t = 0; t < n; t++)
            if (l < nk[t]) {
                const __m512 e = _mm512_set1_ps(scratch[t * stride + l]);
                o[t][0] = _mm512_fmadd_ps(e, v0, o[t][0]);
                o[t][1] = _mm512_fmadd_ps(e, v1, o[t][1]);
                o[t][2] = _mm512_fmadd_ps(e, v2, o[t][2]);
                o[t][3] = _mm512_fmadd_ps(e, v3, o[t][3]);
            }
    }
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++) {
        const __m512 s = _mm512_set1_ps(inv[t]);
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out[t] + 16 * j, _mm512_mul_ps(o[t][j], s));
    }
}
#else
/* D = 64: n (<= GQ) queries q[t] (scaled, roped) attending to the keys 0 .. nk[t] - 1 of one KV
   head (k, v: [length, 64]); scratch: n rows of `stride` scores. Each query's arithmetic is that
   of attending alone: the queries only share the loads. */
static inline __attribute__((always_inline)) void attend64(
        int n, const float *const *q, const int64_t *nk, const float *k, const float *v, float *scratch,
        int64_t stride, float *const *out) {
    v16 qv[GQ][4];
    int64_t most = 0;
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < 4; j++) qv[t][j] = load16(q[t] + 16 * j);
        most = nk[t] > most ? nk[t] : most;
    }
    for (int64_t l = 0; l < most; l++) {
        const v16 k0 = load16(k + l * 64), k1 = load16(k + l * 64 + 16), k2 = load16(k + l * 64 + 32),
                  k3 = load16(k + l * 64 + 48);
        _Pragma("GCC unroll 6")
        for (int t = 0; t < n; t++)
            if (l < nk[t])
                scratch[t * stride + l] = sum16(((qv[t][0] * k0 + qv[t][1] * k1) + qv[t][2] * k2) + qv[t][3] * k3);
    }
    float inv[GQ];
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++) inv[t] = softmax_exp(scratch + t * stride, nk[t]);
    v16 o[GQ][4];
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++)
        for (int j = 0; j < 4; j++) o[t][j] = (v16){0};
    for (int64_t l = 0; l < most; l++) {
        const v16 v0 = load16(v + l * 64), v1 = load16(v + l * 64 + 16), v2 = load16(v + l * 64 + 32),
                  v3 = load16(v + l * 64 + 48);
        _Pragma("GCC unroll 6")
        for (int t = 0; t < n; t++)
            if (l < nk[t]) {
                const float e = scratch[t * stride + l];
                o[t][0] = o[t][0] + e * v0;
                o[t][1] = o[t][1] + e * v1;
                o[t][2] = o[t][2] + e * v2;
                o[t][3] = o[t][3] + e * v3;
            }
    }
    _Pragma("GCC unroll 6")
    for (int t = 0; t < n; t++)
        for (int j = 0; j < 4; j++) store16(out[t] + 16 * j, o[t][j] * inv[t]);
}

#endif

/* D = 64 (SmolLM2's head size): the Q rows x G heads of each sequence's KV head attend in groups of
   up to GQ queries. Returns -1 when there is no memory for the scores. */
static int attend_grouped(const float *qr, const int64_t *pos, int64_t B, int64_t Q, int64_t H, int64_t KV,
                          const float *kc, const float *vc, int64_t slot0, const int64_t *slots, int64_t length,
                          int64_t maxpos, float *out) {
    const int64_t D = 64, G = H / KV, NQ = Q * G, stride = maxpos + 17;
    float *scratch = malloc(sizeof(float) * (size_t)(GQ * stride));
    if (!scratch) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t slot = slots ? slots[b] : slot0 + b;
        for (int64_t g = 0; g < KV; g++) {
            const float *kh = kc + (slot * KV + g) * length * D, *vh = vc + (slot * KV + g) * length * D;
            for (int64_t t0 = 0; t0 < NQ; t0 += GQ) {
                const float *qs[GQ];
                float *os[GQ];
                int64_t nks[GQ];
                const int n = NQ - t0 < GQ ? (int)(NQ - t0) : GQ;
                for (int t = 0; t < n; t++) { /* query t0 + t: row (t0 + t) / G of the sequence, head (t0 + t) % G of the group */
                    const int64_t r = b * Q + (t0 + t) / G, h = g * G + (t0 + t) % G;
                    qs[t] = qr + (r * H + h) * D;
                    os[t] = out + (r * H + h) * D;
                    nks[t] = pos[r] + 1;
                }
                switch (n) { /* a constant n for each, so that the queries' vectors stay in registers */
                case 1: attend64(1, qs, nks, kh, vh, scratch, stride, os); break;
                case 2: attend64(2, qs, nks, kh, vh, scratch, stride, os); break;
                case 3: attend64(3, qs, nks, kh, vh, scratch, stride, os); break;
                case 4: attend64(4, qs, nks, kh, vh, scratch, stride, os); break;
                case 5: attend64(5, qs, nks, kh, vh, scratch, stride, os); break;
                default: attend64(GQ, qs, nks, kh, vh, scratch, stride, os); break;
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* Any other head size: row by row, head by head. */
static int attend_rows(const float *qr, float *scores, const int64_t *pos, int64_t B, int64_t Q, int64_t H,
                       int64_t KV, int64_t D, const float *kc, const float *vc, int64_t slot0, const int64_t *slots,
                       int64_t length, float *out) {
    const int64_t G = H / KV;
    const int vec = D % 16 == 0;
    for (int64_t r = 0; r < B * Q; r++) {
        const int64_t slot = slots ? slots[r / Q] : slot0 + r / Q, nk = pos[r] + 1;
        for (int64_t h = 0; h < H; h++) {
            const float *qh = qr + (r * H + h) * D;
            const float *kh = kc + (slot * KV + h / G) * length * D, *vh = vc + (slot * KV + h / G) * length * D;
            for (int64_t l = 0; l < nk; l++) {
                float dot;
                if (vec) {
                    v16 acc = load16(qh) * load16(kh + l * D);
                    for (int64_t j = 16; j < D; j += 16) acc = acc + load16(qh + j) * load16(kh + l * D + j);
                    dot = sum16(acc);
                } else {
                    dot = 0.0f;
                    for (int64_t j = 0; j < D; j++) dot += qh[j] * kh[l * D + j];
                }
                scores[l] = dot;
            }
            const float inv = softmax_exp(scores, nk);
            float *o = out + (r * H + h) * D;
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int64_t l = 0; l < nk; l++) {
                const float e = scores[l];
                if (vec) {
                    for (int64_t j = 0; j < D; j += 16) store16(o + j, load16(o + j) + e * load16(vh + l * D + j));
                } else {
                    for (int64_t j = 0; j < D; j++) o[j] += e * vh[l * D + j];
                }
            }
            for (int64_t j = 0; j < D; j++) o[j] *= inv;
        }
    }
    return 0;
}

/* qkv [R, (H + 2 KV) * D] for R = B * Q rows (sequence b's Q positions pos[b * Q + i], in slot
   slots[b] of the caches kc, vc [slots, KV, length, D], or slot0 + b when slots is NULL)
   -> out [R, H * D]; -2 (nothing written) when a position is outside 0 .. length - 1. Keys and values of
   every row are written first; then each query row attends to keys 0 .. its position, with
   arithmetic fixed by its own query, keys and position, so a row's result does not depend on
   the rows beside it. */
int qmm_attention(const float *qkv, const int64_t *pos, int64_t B, int64_t Q, int64_t H, int64_t KV, int64_t D,
                  const float *cos, const float *sin, float *kc, float *vc, int64_t slot0, const int64_t *slots,
                  int64_t length, float *out) {
    const int64_t R = B * Q, W = (H + 2 * KV) * D;
    const float scale = 1.0f / sqrtf((float)D);
    int64_t maxpos = 0;
    for (int64_t r = 0; r < R; r++) {
        if (pos[r] < 0 || pos[r] >= length) return -2; /* outside the caches */
        maxpos = pos[r] > maxpos ? pos[r] : maxpos;
    }
    float *qr = malloc(sizeof(float) * (size_t)(R * H * D + maxpos + 17 + D));
    if (!qr) return -1;
    float *scores = qr + R * H * D, *tmp = scores + maxpos + 17;
    for (int64_t r = 0; r < R; r++) {
        const int64_t p = pos[r], slot = slots ? slots[r / Q] : slot0 + r / Q;
        const float *row = qkv + r * W, *c = cos + p * D, *s = sin + p * D;
        for (int64_t h = 0; h < H; h++) {
            rope_head(row + h * D, c, s, D, tmp);
            for (int64_t j = 0; j < D; j++) qr[(r * H + h) * D + j] = tmp[j] * scale;
        }
        for (int64_t g = 0; g < KV; g++) {
            const int64_t at = ((slot * KV + g) * length + p) * D;
            rope_head(row + (H + g) * D, c, s, D, kc + at);
            memcpy(vc + at, row + (H + KV + g) * D, sizeof(float) * (size_t)D);
        }
    }
    const int failed = D == 64 ? attend_grouped(qr, pos, B, Q, H, KV, kc, vc, slot0, slots, length, maxpos, out)
                               : attend_rows(qr, scores, pos, B, Q, H, KV, D, kc, vc, slot0, slots, length, out);
    free(qr);
    return failed;
}

/* An EAGLE draft head in Q4_1 (serve_app/engines/embedded/eagle.py): one Llama layer over a
   feature and a token's embedding, and the drafting loop of EagleDrafter.propose, in one call
   where PyTorch took some twenty small ops a pass. */
typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down, *lm_head; /* packed Q4_1 */
    const float *norm_in, *norm_mlp, *norm_out;          /* [2, d] (embedding's, feature's), [d], [d] */
    const float *embed;                                  /* the target's token embeddings [vocab, d] */
    const int64_t *d2t;                                  /* draft vocabulary -> token id */
    const float *cos, *sin;                              /* the target's RoPE tables [positions, head_dim] */
    float *kc, *vc;                                      /* the head's caches [slots, kv_heads, length, head_dim] */
    int64_t d, heads, kv_heads, head_dim, inter, draft_vocab, length;
    float eps;
} eagle_t;

/* The layer over R rows: features g [R, d], tokens tok [R] at cache positions pos [R] in slots
   slot [R] -> out [R, d]. Keys and values of every row are written before any row attends, so
   rows of one sequence see each other as in one pass over its positions. */
static int eagle_pass(const eagle_t *e, const float *g, const int64_t *tok, const int64_t *pos, const int64_t *slot,
                      int64_t R, float *out) {
    const int64_t d = e->d, I = e->inter, nq = e->heads * e->head_dim;
    const int64_t W = nq + 2 * e->kv_heads * e->head_dim;
    float *h = malloc(sizeof(float) * (size_t)(R * (2 * d + W + nq + d + 3 * I)));
    if (!h) return -1;
    float *qkv = h + R * 2 * d, *attn = qkv + R * W, *x = attn + R * nq, *gu = x + R * d, *act = gu + R * 2 * I;
    for (int64_t r = 0; r < R; r++) { /* [norm(embedding), norm(feature)] */
        rms_norm_row(e->embed + tok[r] * d, e->norm_in, e->eps, d, h + r * 2 * d);
        rms_norm_row(g + r * d, e->norm_in + d, e->eps, d, h + r * 2 * d + d);
    }
    int rc = qmm_linear_q4_1(h, NULL, 0.0f, R, 2 * d, e->qkv, W, qkv);
    if (!rc) rc = qmm_attention(qkv, pos, R, 1, e->heads, e->kv_heads, e->head_dim, e->cos, e->sin, e->kc, e->vc,
                                0, slot, e->length, attn);
    if (!rc) rc = qmm_linear_q4_1(attn, NULL, 0.0f, R, nq, e->o, d, x);
    if (!rc) {
        for (int64_t j = 0; j < R * d; j++) x[j] = g[j] + x[j];
        rc = qmm_linear_q4_1(x, e->norm_mlp, e->eps, R, d, e->gate_up, 2 * I, gu);
    }
    if (!rc) {
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < I; j++) {
                const float a = gu[r * 2 * I + j];
                act[r * I + j] = a / (1.0f + expf(-a)) * gu[r * 2 * I + I + j];
            }
        rc = qmm_linear_q4_1(act, NULL, 0.0f, R, I, e->down, d, out);
    }
    if (!rc)
        for (int64_t j = 0; j < R * d; j++) out[j] = x[j] + out[j];
    free(h);
    return rc;
}

/* Catch-up and k drafts for B sequences. g [R, d] and tok [R] hold, sequence after sequence,
   the num[b] verified positions of sequence b that the head has not run, from cache index
   lens[b], in slot slots[b] (R = the sum of num). The last one's output drafts token 0; draft
   j, fed back with that output at index lens[b] + num[b] + j, drafts token j + 1 -> drafts
   [B, k] token ids. An index past the caches' last is held at it: the scratch index, whose
   keys no query at a real position reads. */
int qmm_eagle_propose(const eagle_t *e, const float *g, const int64_t *tok, const int64_t *lens, const int64_t *num,
                      const int64_t *slots, int64_t B, int64_t k, int64_t *drafts) {
    const int64_t d = e->d, V = e->draft_vocab, last = e->length - 1;
    int64_t R = 0;
    for (int64_t b = 0; b < B; b++) {
        if (num[b] < 1 || lens[b] < 0) return -2;
        R += num[b];
    }
    if (R < 1) return -2;
    float *hid = malloc(sizeof(float) * (size_t)(R * d + 2 * B * d + B * V));
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(2 * R + B));
    if (!hid || !idx) { free(hid); free(idx); return -1; }
    float *a = hid + R * d, *next = a + B * d, *logits = next + B * d;
    int64_t *slot = idx + R, *t = slot + R;
    for (int64_t b = 0, r = 0; b < B; b++)
        for (int64_t i = 0; i < num[b]; i++, r++) {
            idx[r] = lens[b] + i < last ? lens[b] + i : last;
            slot[r] = slots[b];
        }
    int rc = eagle_pass(e, g, tok, idx, slot, R, hid);
    for (int64_t b = 0, r = 0; b < B && !rc; r += num[b], b++)
        memcpy(a + b * d, hid + (r + num[b] - 1) * d, sizeof(float) * (size_t)d);
    for (int64_t j = 0; j < k && !rc; j++) {
        rc = qmm_linear_q4_1(a, e->norm_out, e->eps, B, d, e->lm_head, V, logits);
        if (rc) break;
        for (int64_t b = 0; b < B; b++) { /* the first index of the largest logit (or of a NaN), as torch.argmax */
            const float *l = logits + b * V;
            int64_t best = 0;
            for (int64_t v = 1; v < V && l[best] == l[best]; v++) best = (l[v] > l[best] || l[v] != l[v]) ? v : best;
            t[b] = e->d2t[best];
            drafts[b * k + j] = t[b];
            const int64_t p = lens[b] + num[b] + j;
            idx[b] = p < last ? p : last;
        }
        if (j + 1 < k) {
            rc = eagle_pass(e, a, t, idx, slots, B, next);
            float *swap = a; a = next; next = swap;
        }
    }
    free(hid);
    free(idx);
    return rc;
}
