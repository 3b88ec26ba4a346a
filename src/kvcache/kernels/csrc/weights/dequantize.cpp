// Weights dequantized to float32 with gguf's arithmetic (gguf.quants.dequantize), bit for bit:
// the products and sums in its order, never fused into one FMA (an FMA rounds once where
// gguf rounds twice), hence fp-contract off for this file.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>

#include <vector>

#include "blocks.h"
#include "interleaved.h"
#include "weights.h"

namespace kvk {

void check_part(int64_t kind, const at::Tensor& data, int64_t K) {
  TORCH_CHECK(known_kind((int)kind), "kvcache qlinear: unknown block type ", kind);
  const BlockTraits t = traits((int)kind);
  TORCH_CHECK(K > 0 && K % t.values == 0, "kvcache qlinear: K = ", K,
              " is not a multiple of the block's ", t.values, " values");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous() &&
                  data.size(1) == K / t.values * t.nbytes,
              "kvcache qlinear: part data uint8 [rows, ", K / t.values * t.nbytes,
              "] contiguous expected");
  TORCH_CHECK(!interleaved((int)kind) || data.size(0) % 8 == 0,
              "kvcache qlinear: an interleaved part has rows in groups of 8");
}

namespace {

// out [K] = the row's weights, gguf's formula of each type
void dequantize_row(int kind, const uint8_t* src, int64_t K, std::vector<int8_t>& q,
                    std::vector<float>& d, std::vector<float>& dm, std::vector<int32_t>& sc,
                    std::vector<int32_t>& mn, float* out) {
  const BlockTraits t = traits(kind);
  decode_row(kind, src, K, Decoded{q.data(), d.data(), dm.data(), sc.data(), mn.data()});
  if (t.values == 32) {
    for (int64_t k = 0; k < K; ++k) {
      const float v = d[k / 32] * (float)q[k];
      out[k] = t.min ? v + dm[k / 32] : v;
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const float v = (d[k / 256] * (float)sc[k / 16]) * (float)q[k];
      out[k] = t.min ? v + dm[k / 256] * (float)mn[k / 32] : v;
    }
  }
}

}  // namespace

// rows `ids` (int64 [R]; all rows where ids is empty) of a part, as float32 [R, K]
at::Tensor dequantize_rows(int64_t kind, const at::Tensor& data, const at::Tensor& ids,
                           int64_t K) {
  check_part(kind, data, K);
  const int64_t N = data.size(0), row_bytes = data.size(1);
  const bool all = ids.numel() == 0;
  at::Tensor idx = all ? ids : ids.to(at::kLong).contiguous();
  const int64_t R = all ? N : idx.numel();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < (all ? 0 : R); ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "kvcache qlinear: row id ", ip[r], " not in [0, ", N,
                ")");
  at::Tensor out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = data.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> q(K);
    std::vector<float> d(K / 32), dm(K / 32);
    std::vector<int32_t> sc(K / 16), mn(K / 32);
    std::vector<uint8_t> gathered(interleaved((int)kind) ? row_bytes : 0);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = all ? r : ip[r];
      const uint8_t* bytes = src + row * row_bytes;
      if (interleaved((int)kind)) {  // the row's GGUF bytes back in their order
        x8_gather_row((int)kind, src, row, row_bytes, K, gathered.data());
        bytes = gathered.data();
      }
      dequantize_row(base_kind((int)kind), bytes, K, q, d, dm, sc, mn, op + r * K);
    }
  });
  return out;
}

}  // namespace kvk
