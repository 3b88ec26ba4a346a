// Attention without a mask over dense windows of keys and values: Whisper's cross-attention.
//
//   q [T, H, D] float32, keys / values [A, H, S, D] float32 (window a, head h: S rows of D),
//   windows [T] int64 (row t reads window windows[t])   ->   out [T, H, D] float32
//
// A work item is one (window, head): every row reading that window shares one pass over its S
// keys (their scores in the linear kernel's blocks: rows x keys accumulators) and one pass
// over its S values (in L2 for a second row). torch's batched matmuls for one or a few query
// rows read the 4.6 MB of a Whisper tiny layer's keys and values at about half the memory
// bandwidth; this reads them once per step for all rows of a window.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "matrows.h"

namespace kvk {

at::Tensor dense_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& windows, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "kvcache dense attention: q [T, H, D], keys and values [A, H, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "kvcache dense attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(),
              "kvcache dense attention: contiguous tensors");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t A = keys.size(0), S = keys.size(2);
  TORCH_CHECK(keys.size(1) == H && keys.size(3) == D, "kvcache dense attention: q and keys differ");
  TORCH_CHECK(D % 8 == 0, "kvcache dense attention: head_dim must be a multiple of 8");
  TORCH_CHECK(S > 0, "kvcache dense attention: empty windows");
  TORCH_CHECK(windows.scalar_type() == at::kLong && windows.dim() == 1 && windows.size(0) == T &&
                  windows.is_contiguous(),
              "kvcache dense attention: windows [T] int64");
  const int64_t* win = windows.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows_of(A);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(win[t] >= 0 && win[t] < A, "kvcache dense attention: window out of range");
    rows_of[win[t]].push_back(t);
  }
  std::vector<int64_t> used;  // windows some row reads
  for (int64_t a = 0; a < A; ++a)
    if (!rows_of[a].empty()) used.push_back(a);
  at::Tensor out = at::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  const int64_t items = (int64_t)used.size() * H;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs, scores, acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t a = used[item / H], h = item % H;
      const std::vector<int64_t>& rows = rows_of[a];
      const int64_t R = (int64_t)rows.size();
      qs.resize(R * D);
      scores.resize(R * S);
      for (int64_t r = 0; r < R; ++r)  // the rows' queries of head h, scaled
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qp[(rows[r] * H + h) * D + d] * sc;
      const float* kb = kp + (a * H + h) * S * D;
      const float* vb = vp + (a * H + h) * S * D;
      const int64_t nb = R == 1 ? NB1 : NB;
      for (int64_t n = 0; n < S; n += nb)  // scores [R, S]: blocks of rows x keys
        for (int64_t m = 0; m < R; m += MB)
          run_block(std::min<int64_t>(MB, R - m), std::min<int64_t>(nb, S - n), qs.data() + m * D,
                    D, kb + n * D, scores.data() + m * S + n, S, nullptr);
      for (int64_t r = 0; r < R; ++r) {
        float* s = scores.data() + r * S;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < S; ++j) mx = std::max(mx, s[j]);
        const float inv = 1.0f / exp_shift_sum(s, (int)S, mx);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < S; ++j) axpy(s[j], vb + j * D, acc.data(), (int)D);
        float* o = op + (rows[r] * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
      }
    }
  });
  return out;
}

}  // namespace kvk
