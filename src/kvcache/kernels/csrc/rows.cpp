// Row operations of a decode step that torch runs as chains of small ops: RoPE of a few rows,
// and K/V rows copied into their cells (converted to the buffer's dtype).
//
// Between two attention calls a decode step's Python runs with cold caches, where each small
// torch op costs microseconds (docs/design/kernels.md). Each function here is one call that
// does what those chains did, with the same rounding.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "api.h"
#include "simd.h"

namespace kvk {

namespace {

// One head's RoPE: o = r * c + swap(r) * s (the formula of rope_rows, below)
inline void rope_head(const float* r, const float* c, const float* s, int64_t D, float* o) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) o[i] = std::fma(r[i + half], s[i], r[i] * c[i]);
  for (int64_t i = half; i < D; ++i) o[i] = std::fma(r[i - half], s[i], r[i] * c[i]);
}

void check_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D) {
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == T * D,
                "kvcache rope: cos and sin [T, 1, D] float32, contiguous");
}

}  // namespace

// RoPE in rotate-half pairs: y = x * cos + swap(x) * sin for x [T, H, D] float32 (rows of any
// stride, channels contiguous), cos and sin [T, 1, D] or [T, D] float32 (the tables of
// models/rope.py: sin already signed), where swap(x) = (x[D/2:], x[:D/2]) -> y [T, H, D]
// contiguous. x * cos is rounded, then swap(x) * sin added in one fused multiply-add, as
// torch's x * cos and addcmul do: the same float32 as Rope.rotate.
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "kvcache rope: x [T, H, D] float32 with contiguous heads expected");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "kvcache rope: an even head_dim");
  check_tables(cos, sin, T, D);
  at::Tensor y = at::empty({T, H, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      rope_head(xp + t * xs + h * D, cp + t * D, sp + t * D, D, yp + (t * H + h) * D);
  return y;
}

// q [T, Hq, D], k and v [T, Hkv, D] (contiguous) of a fused projection's rows qkv [T, (Hq + 2
// Hkv) D] (channels contiguous): q and k RMS-normed per head by q_norm / k_norm [D] where
// given (Gemma 3), then rotated as rope_rows rotates them (k only with rotate_keys), v copied.
// One call for the slicing, norms and RoPE a decode step made as a chain of small ops; the
// bits of rms_norm_rows and rope_rows.
std::vector<at::Tensor> split_heads(const at::Tensor& qkv, int64_t hq, int64_t hkv,
                                    const at::Tensor& cos, const at::Tensor& sin,
                                    bool rotate_keys, const at::Tensor& q_norm,
                                    const at::Tensor& k_norm, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1,
              "kvcache split_heads: qkv [T, W] float32 with contiguous channels expected");
  TORCH_CHECK(hq > 0 && hkv > 0 && qkv.size(1) % (hq + 2 * hkv) == 0,
              "kvcache split_heads: qkv's width is not (Hq + 2 Hkv) heads");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (hq + 2 * hkv);
  TORCH_CHECK(D % 2 == 0, "kvcache split_heads: an even head_dim");
  check_tables(cos, sin, T, D);
  const bool normed = q_norm.numel() > 0;
  TORCH_CHECK((k_norm.numel() > 0) == normed, "kvcache split_heads: both norms or neither");
  if (normed)
    for (const at::Tensor* w : {&q_norm, &k_norm})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == D,
                  "kvcache split_heads: norms [D] float32");
  auto opts = qkv.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor q = at::empty({T, hq, D}, opts), k = at::empty({T, hkv, D}, opts),
             v = at::empty({T, hkv, D}, opts);
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* qw = normed ? q_norm.data_ptr<float>() : nullptr;
  const float* kw = normed ? k_norm.data_ptr<float>() : nullptr;
  float* out[3] = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>()};
  const int64_t heads[3] = {hq, hkv, hkv};
  std::vector<float> tmp(D);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * qkv.stride(0);
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    for (int part = 0, h0 = 0; part < 3; h0 += heads[part], ++part) {
      const bool rotate = part == 0 || (part == 1 && rotate_keys);
      const float* w = part == 0 ? qw : part == 1 ? kw : nullptr;
      for (int64_t h = 0; h < heads[part]; ++h) {
        const float* r = row + (h0 + h) * D;
        float* o = out[part] + (t * heads[part] + h) * D;
        if (w) {
          rms_row(r, w, D, (float)eps, tmp.data());
          r = tmp.data();
        }
        if (rotate) rope_head(r, c, s, D, o);
        else std::memcpy(o, r, D * sizeof(float));
      }
    }
  }
  return {q, k, v};
}

// dst[slots[i]] = src[rows[i]] (rows empty: src[i]) for i < len(slots), converted to dst's
// dtype (float32, or float16 rounded to nearest even as torch's .to does): dst [S, H, D]
// float32 or float16, contiguous; src [T, H, D] float32 with contiguous channels (rows and
// heads of any stride: a model's k and v are slices of its fused projection); slots and rows
// int64. Every index is checked before anything is written.
void put_rows(at::Tensor& dst, const at::Tensor& slots, const at::Tensor& src,
              const at::Tensor& rows) {
  TORCH_CHECK(dst.dim() == 3 && src.dim() == 3 && dst.size(1) == src.size(1) &&
                  dst.size(2) == src.size(2),
              "kvcache put_rows: dst [S, H, D] and src [T, H, D] expected");
  TORCH_CHECK(dst.is_contiguous() && src.stride(2) == 1,
              "kvcache put_rows: a contiguous dst and src channels");
  TORCH_CHECK(src.scalar_type() == at::kFloat, "kvcache put_rows: float32 src");
  const bool half = dst.scalar_type() == at::kHalf;
  TORCH_CHECK(half || dst.scalar_type() == at::kFloat, "kvcache put_rows: float32 or float16 dst");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "kvcache put_rows: slots int64 [n]");
  const int64_t n = slots.size(0), S = dst.size(0), T = src.size(0);
  const int64_t H = dst.size(1), D = dst.size(2);
  const bool mapped = rows.numel() > 0;
  if (mapped)
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                    rows.size(0) == n,
                "kvcache put_rows: rows int64 [n] or empty");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* rw = mapped ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < S, "kvcache put_rows: slot ", sl[i], " outside [0, ", S,
                ")");
    const int64_t r = mapped ? rw[i] : i;
    TORCH_CHECK(r >= 0 && r < T, "kvcache put_rows: row ", r, " outside [0, ", T, ")");
  }
  const float* sp = src.data_ptr<float>();
  at::Half* dh = half ? dst.data_ptr<at::Half>() : nullptr;
  float* df = half ? nullptr : dst.data_ptr<float>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  for (int64_t i = 0; i < n; ++i) {
    const float* from = sp + (mapped ? rw[i] : i) * s0;
    for (int64_t h = 0; h < H; ++h) {
      const float* f = from + h * s1;
      const int64_t off = (sl[i] * H + h) * D;
      if (half) {
        for (int64_t c = 0; c < D; ++c) dh[off + c] = at::Half(f[c]);
      } else {
        std::memcpy(df + off, f, D * sizeof(float));
      }
    }
  }
}

}  // namespace kvk
