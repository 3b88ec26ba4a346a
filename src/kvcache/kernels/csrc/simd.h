// Small vector helpers over float rows: AVX2 + F16C when the compiler targets them
// (built with -march=native), plain loops otherwise. Rows are D floats, D a multiple of 8.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVK_AVX2 1
#else
#define KVK_AVX2 0
#endif
// 512-bit paths where the CPU has them (byte shuffles and masked loads need BW and VL)
#if KVK_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVK_AVX512 1
#else
#define KVK_AVX512 0
#endif

// Unroll a loop over a template constant completely, before the compiler decides what lives in
// memory: a register block (acc[NR][NC]) indexed by such loops is otherwise kept on the stack
// by GCC 12, a store and a reload per FMA chain on every cell
#define KVK_UNROLL _Pragma("GCC unroll 16")

namespace kvk {

// fp16 bits -> float (IEEE half; subnormals and inf/nan kept)
inline float half_to_float(uint16_t h) {
#if KVK_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// dst[0:n] = src[0:n] as float (fp16 source)
inline void half_row(const uint16_t* src, float* dst, int n) {
#if KVK_AVX2
  for (int i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#else
  for (int i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
#endif
}

inline void bf16_row(const uint16_t* src, float* dst, int n) {
#if KVK_AVX2
  for (int i = 0; i < n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#else
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
#endif
}

#if KVK_AVX2
// Keep a loaded vector in a register: an empty asm statement the compiler cannot see through.
// A vector loaded once and used by several FMAs is otherwise often folded into each FMA's memory
// operand by GCC, which then loads it once per use (matrows.h's 3 x 4 block: 15 loads per 12
// FMAs instead of 7; tiles.h's float key and value rows).
inline void pin(__m256& v) {
#if KVK_AVX512
  __asm__("" : "+v"(v));
#else
  __asm__("" : "+x"(v));
#endif
}

// the sum of a register's 8 floats
inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

inline float dot(const float* a, const float* b, int n) {
#if KVK_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum8(_mm256_add_ps(s0, s1));
#else
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
#endif
}

// RMSNorm of one row: y = x / sqrt(mean(x^2) + eps) * w (rms_norm_rows, the fused norm of
// linear_rows and the per-head norms of split_heads: one formula, the same bits)
inline void rms_row(const float* x, const float* w, int64_t K, float eps, float* y) {
  const float inv = 1.f / std::sqrt(dot(x, x, (int)K) / (float)K + eps);
  for (int64_t i = 0; i < K; ++i) y[i] = x[i] * inv * w[i];
}

// y[0:n] += p * x[0:n]
inline void axpy(float p, const float* x, float* y, int n) {
#if KVK_AVX2
  __m256 pv = _mm256_set1_ps(p);
  for (int i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#else
  for (int i = 0; i < n; ++i) y[i] += p * x[i];
#endif
}

inline void scale_row(float f, float* y, int n) {
#if KVK_AVX2
  __m256 fv = _mm256_set1_ps(f);
  for (int i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(fv, _mm256_loadu_ps(y + i)));
#else
  for (int i = 0; i < n; ++i) y[i] *= f;
#endif
}

#if KVK_AVX2
// The 4-bit codes of channels [c, c + 8) of a packed row (two a byte, low nibble first) as 8
// integers: one 4-byte load, never past the row (c + 8 <= the row's channels).
inline __m256i nibbles8(const uint8_t* row, int64_t c) {
  uint32_t w;
  std::memcpy(&w, row + c / 2, 4);
  const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                      _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  return _mm256_and_si256(v, _mm256_set1_epi32(15));
}
#endif

// max(init, x[0:n]); NaN entries are passed over (as std::max(m, x) does)
inline float row_max(const float* x, int n, float init) {
  int i = 0;
  float m = init;
#if KVK_AVX2
  if (n >= 8) {  // 4 independent chains: vmaxps's latency, not its throughput, bounds one
    __m256 a = _mm256_set1_ps(init), b = a, c = a, d = a;
    for (; i + 32 <= n; i += 32) {
      a = _mm256_max_ps(_mm256_loadu_ps(x + i), a);
      b = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), b);
      c = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), c);
      d = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), d);
    }
    for (; i + 8 <= n; i += 8) a = _mm256_max_ps(_mm256_loadu_ps(x + i), a);
    a = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// y[0:n] *= x[0:n]
inline void mul_rows(const float* x, float* y, int n) {
  int i = 0;
#if KVK_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] *= x[i];
}

// w[0:n] = p[0:n] * s[0:n]; returns sum(p[0:n] * lo[0:n])
inline float scaled_weights(const float* p, const float* s, const float* lo, float* w, int n) {
  int i = 0;
  float sum = 0.f;
#if KVK_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 pv = _mm256_loadu_ps(p + i);
    _mm256_storeu_ps(w + i, _mm256_mul_ps(pv, _mm256_loadu_ps(s + i)));
    acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(lo + i), acc);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) {
    w[i] = p[i] * s[i];
    sum += p[i] * lo[i];
  }
  return sum;
}

// y[0:n] += b
inline void add_const(float b, float* y, int n) {
  int i = 0;
#if KVK_AVX2
  const __m256 bv = _mm256_set1_ps(b);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(bv, _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += b;
}

// y = a * x + b  (elementwise a, b rows; in place on y = x allowed)
inline void fma_rows(const float* x, const float* a, const float* b, float* y, int n) {
#if KVK_AVX2
  for (int i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(a + i),
                                            _mm256_loadu_ps(b + i)));
#else
  for (int i = 0; i < n; ++i) y[i] = x[i] * a[i] + b[i];
#endif
}

}  // namespace kvk

namespace kvk {

#if KVK_AVX2
// exp of 8 floats (Cephes' expf scheme: 2^n * polynomial, relative error ~1e-7); x <= 88
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365f);
  x = _mm256_max_ps(x, lo);  // exp(-inf) -> ~1e-38 * 0 below; callers mask -inf separately
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, c1, x);
  x = _mm256_fnmadd_ps(fx, c2, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

// x[0:n] = exp(x[0:n] - m); returns the sum. Entries equal to -inf give 0.
inline float exp_shift_sum(float* x, int n, float m) {
  float sum = 0.f;
  int i = 0;
#if KVK_AVX2
  const __m256 mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, mv)));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

}  // namespace kvk
