// int8 rows, one fp16 scale a row: decoded, or read as codes by the tile math.
#include "family.h"

namespace kvk {

void decode_int8(const Tile& t, int a, int b) {
  const Reader& r = t.r;
  each_row(t, a, b, [&](int, int64_t c, float* out) {
    const int8_t* q = reinterpret_cast<const int8_t*>(code_row(r, c, t.h));
    const float s = half_to_float(r.scale[c * r.H + t.h]);
#if KVK_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t i = 0; i < r.D; i += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sv));
    }
#else
    for (int64_t i = 0; i < r.D; ++i) out[i] = (float)q[i] * s;
#endif
    return true;
  });
}

void int8_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
               const int8_t** rows, float* scales) {
  TORCH_CHECK(r.kind == INT8 && r.scale_head == 1, "kvcache kernel: int8_rows of another codec");
  code_rows(r, h, cells, a, b, rows);
  half_fields(r.scale, r.rows, r.H, h, cells, a, b, scales);
}

}  // namespace kvk
