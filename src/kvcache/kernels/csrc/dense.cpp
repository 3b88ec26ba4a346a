// Attention without a mask over dense windows of keys and values: Whisper's cross-attention.
//
//   q [T, H, D] float32, keys / values [A, H, S, D] float32 (window a, head h: S rows of D),
//   windows [T] int64 (row t reads window windows[t])   ->   out [T, H, D] float32
//
// A work item is one (window, head): every row reading that window shares one pass over its S
// keys (their scores in the linear kernel's blocks: rows x keys accumulators) and one pass over
// its S values per two rows (their weighted sums in registers). torch's batched matmuls for one
// or a few query rows read the 4.6 MB of a Whisper tiny layer's keys and values at about half
// the memory bandwidth.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "api.h"
#include "matrows.h"

namespace kvk {

namespace {

constexpr int PV_ROWS = 2;  // rows summed in one pass over a window's values

// out[i][c0 : c0 + 8 V] = inv[i] * sum_j p[i * S + j] * v[j * D + c0 ...] for R rows: R x V
// vector accumulators, each value vector loaded once for the R rows. Every channel is the
// same sum in the same order (one FMA per j) whatever R: rows do not change each other's bits.
template <int R, int V>
inline void weighted_block(const float* p, int64_t S, const float* v, int64_t D, int64_t c0,
                           const float* inv, float* const* out) {
#if KVK_AVX2
  __m256 acc[R][V];
  KVK_UNROLL
  for (int r = 0; r < R; ++r)
    KVK_UNROLL
    for (int i = 0; i < V; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    __m256 vv[V];
    KVK_UNROLL
    for (int i = 0; i < V; ++i) vv[i] = _mm256_loadu_ps(v + j * D + c0 + 8 * i);
    KVK_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * S + j);
      KVK_UNROLL
      for (int i = 0; i < V; ++i) acc[r][i] = _mm256_fmadd_ps(pr, vv[i], acc[r][i]);
    }
  }
  KVK_UNROLL
  for (int r = 0; r < R; ++r)
    KVK_UNROLL
    for (int i = 0; i < V; ++i)
      _mm256_storeu_ps(out[r] + c0 + 8 * i, _mm256_mul_ps(acc[r][i], _mm256_set1_ps(inv[r])));
#else
  KVK_UNROLL
  for (int r = 0; r < R; ++r)
    for (int64_t c = c0; c < c0 + 8 * V; ++c) {
      float a = 0.0f;
      for (int64_t j = 0; j < S; ++j) a += p[r * S + j] * v[j * D + c];
      out[r][c] = a * inv[r];
    }
#endif
}

// channels in chunks of 8 V (R x V accumulators: 8 x 1 or 4 x 2 of the 16 registers), so a
// single row reads each 64-channel value row in one pass
template <int R>
inline void weighted_rows_of(const float* p, int64_t S, const float* v, int64_t D,
                             const float* inv, float* const* out) {
  constexpr int V = R == 1 ? 8 : 4;
  int64_t c = 0;
  for (; c + 8 * V <= D; c += 8 * V) weighted_block<R, V>(p, S, v, D, c, inv, out);
  for (; c < D; c += 8) weighted_block<R, 1>(p, S, v, D, c, inv, out);
}

// n (<= PV_ROWS) rows of weights p [n, S] over values v [S, D] into out[0..n), scaled by inv
inline void weighted_rows(int64_t n, const float* p, int64_t S, const float* v, int64_t D,
                          const float* inv, float* const* out) {
  if (n == 2)
    weighted_rows_of<2>(p, S, v, D, inv, out);
  else
    weighted_rows_of<1>(p, S, v, D, inv, out);
}

}  // namespace

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
    std::vector<float> qs, scores, inv;
    float* outs[PV_ROWS];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t a = used[item / H], h = item % H;
      const std::vector<int64_t>& rows = rows_of[a];
      const int64_t R = (int64_t)rows.size();
      qs.resize(R * D);
      scores.resize(R * S);
      inv.resize(R);
      for (int64_t r = 0; r < R; ++r)  // the rows' queries of head h, scaled
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qp[(rows[r] * H + h) * D + d] * sc;
      const float* kb = kp + (a * H + h) * S * D;
      const float* vb = vp + (a * H + h) * S * D;
      const int64_t nb = R == 1 ? NB1 : NB;
      for (int64_t n = 0; n < S; n += nb)  // scores [R, S]: blocks of rows x keys
        for (int64_t m = 0; m < R; m += MB)
          run_block(std::min<int64_t>(MB, R - m), std::min<int64_t>(nb, S - n), qs.data() + m * D,
                    D, kb + n * D, scores.data() + m * S + n, S, nullptr);
      for (int64_t r = 0; r < R; ++r) {  // scores -> softmax weights (unnormalised), 1 / sum
        float* s = scores.data() + r * S;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < S; ++j) mx = std::max(mx, s[j]);
        inv[r] = 1.0f / exp_shift_sum(s, (int)S, mx);
      }
      for (int64_t r = 0; r < R; r += PV_ROWS) {  // outputs: PV_ROWS rows per pass over V
        const int64_t n = std::min<int64_t>(PV_ROWS, R - r);
        for (int64_t i = 0; i < n; ++i) outs[i] = op + (rows[r + i] * H + h) * D;
        weighted_rows(n, scores.data() + r * S, S, vb, D, inv.data() + r, outs);
      }
    }
  });
  return out;
}

}  // namespace kvk
