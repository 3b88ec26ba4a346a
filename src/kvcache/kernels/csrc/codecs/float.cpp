// Float rows (fp32, fp16, bf16 storage, and every codec's fp16 window): decoded, or read
// as they are by the tile math.
#include "family.h"

namespace kvk {

void decode_float(const Tile& t, int a, int b) {
  const Reader& r = t.r;
  if (r.direct && r.window == nullptr) {  // fp32 storage, nothing to convert: pointers only
    code_rows(r, t.h, t.cells, a, b, t.rows);
    std::memset(t.dom + a, 0, (size_t)(b - a));
    return;
  }
  each_row(t, a, b, [&](int j, int64_t c, float* out) {
    const uint8_t* row = code_row(r, c, t.h);
    if (r.kind == F32) {
      if (r.direct) {
        t.rows[j] = reinterpret_cast<const float*>(row);
        return false;
      }
      std::memcpy(out, row, (size_t)r.D * 4);
    } else if (r.kind == F16) {
      half_row(reinterpret_cast<const uint16_t*>(row), out, (int)r.D);
    } else {
      bf16_row(reinterpret_cast<const uint16_t*>(row), out, (int)r.D);
    }
    return true;
  });
}

void half_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
               const uint16_t** rows) {
  for (int j = a; j < b; ++j) {
    const int64_t c = cells[j];
    if (in_window(r, c)) {
      const int32_t slot = r.window[c];
      if (slot >= r.residual_rows) out_of_range("window slot", slot, r.residual_rows);
      rows[j] = r.residual + ((int64_t)slot * r.H + h) * r.D;
    } else {
      rows[j] = reinterpret_cast<const uint16_t*>(code_row(r, c, h));
    }
  }
}

void rope_half_keys(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a,
                    int b, const Rope& rope, KiviKeys& t) {
  TORCH_CHECK(r.pre_rope, "kvcache kernel: rope_half_keys of keys stored after RoPE");
  half_rows(r, h, cells, a, b, t.half);
  for (int j = a; j < b; ++j) std::tie(t.cs[j], t.sn[j]) = rope_rows(rope, pos[j], r.D);
}

}  // namespace kvk
