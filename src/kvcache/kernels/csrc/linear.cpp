// A linear layer for decode-sized inputs: y [M, N] = x [M, K] @ w [N, K]^T (+ bias), few rows;
// and the RMSNorm in front of it.
//
// Decode steps multiply a handful of rows (one per sequence) by every weight matrix, and the
// BLAS behind torch handles that shape poorly here (AVX2, no AMX): a 16-row pass over an
// 80-113 MB LM head reads the weights at a fraction of the memory bandwidth. This kernel reads
// each weight row once per step: an item is a block of NB weight rows, multiplied by every
// block of MB input rows (matrows.h). Every output is the same sum in the same order whatever
// M, the row's place in the batch or the thread count: a row's result does not depend on the
// rows decoded beside it.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "api.h"
#include "matrows.h"

namespace kvk {

namespace {

// SwiGLU's hidden row: y = silu(a) * b for x = [a | b], K values each; silu(a) = a / (1 +
// exp(-a)), torch's formula
void glu_row(const float* x, int64_t K, float* y) {
  for (int64_t i = 0; i < K; ++i) y[i] = x[i] / (1.f + std::exp(-x[i])) * x[K + i];
}

}  // namespace

// y [M, N] = f(x) [M, K] @ w [N, K]^T (+ bias [N]) (+ residual [M, N]), x and w float32 and
// contiguous. f: the rows as they are; with `norm` [K] their RMSNorm (eps); with glu, x is
// [M, 2K] and f(x) = silu(x[:, :K]) * x[:, K:]. One call where a decode step took three to
// five small ops (each costly with the caches cold between two weight passes:
// docs/design/kernels.md).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                       const at::Tensor& residual, const at::Tensor& norm, double eps, bool glu) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) * (glu ? 2 : 1),
              "kvcache linear: x [M, K] (glu: [M, 2K]) and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "kvcache linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "kvcache linear: contiguous x and w");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "kvcache linear: K must be a multiple of 8");
  const bool has_bias = bias.numel() > 0, has_res = residual.numel() > 0;
  const bool has_norm = norm.numel() > 0;
  if (has_bias)
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N,
                "kvcache linear: bias [N] float32");
  if (has_res)
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                    residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N,
                "kvcache linear: residual [M, N] float32, contiguous");
  TORCH_CHECK(!(has_norm && glu), "kvcache linear: norm or glu, not both");
  if (has_norm)
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.dim() == 1 &&
                    norm.numel() == K,
                "kvcache linear: norm [K] float32");
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor staged;  // f(x) where it is not x itself
  const float* xp = x.data_ptr<float>();
  if (has_norm || glu) {
    staged = at::empty({M, K}, x.options());
    float* sp = staged.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      if (has_norm) rms_row(xp + m * K, norm.data_ptr<float>(), K, (float)eps, sp + m * K);
      else glu_row(xp + m * 2 * K, K, sp + m * K);
    }
    xp = sp;
  }
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t nb = M == 1 ? NB1 : NB, blocks = (N + nb - 1) / nb;
  // ~64 KB of weights per grain: enough work per task, many tasks for the threads
  const int64_t grain = std::max<int64_t>(1, 16384 / (nb * K));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {  // nb weight rows, every input row block over them
      const int64_t n = b * nb, c = std::min<int64_t>(nb, N - n);
      // With several row blocks, the weights are read from memory by the first and from L1 by
      // the others, when no miss is in flight: the next block's lines are asked for (into L2)
      // a share before each row block, so that memory works while the FMAs do.
      const int64_t next = b + 1 < end ? std::min<int64_t>(nb, N - n - nb) * K * 4 / 64 : 0;
      const int64_t per = M > MB ? (next + (M + MB - 1) / MB - 1) / ((M + MB - 1) / MB) : 0;
      const char* ahead = reinterpret_cast<const char*>(wp + (n + nb) * K);
      for (int64_t m = 0, line = 0; m < M; m += MB) {
        for (const int64_t stop = std::min(next, line + per); line < stop; ++line)
          __builtin_prefetch(ahead + line * 64, 0, 2);  // prefetcht1: into L2
        run_block(std::min<int64_t>(MB, M - m), c, xp + m * K, K, wp + n * K, yp + m * N + n, N,
                  bp ? bp + n : nullptr, m > 0);
      }
    }
  });
  if (has_res) {  // residual + product, as torch adds them
    const float* rp = residual.data_ptr<float>();
    for (int64_t i = 0; i < M * N; ++i) yp[i] = rp[i] + yp[i];
  }
  return y;
}

// RMSNorm of rows: y [M, K] = x / sqrt(mean(x^2) + eps) * w for x [M, K], w [K] (float32,
// contiguous), in one pass over a row where torch's rms_norm is a chain of small ops (why and
// what it bought: docs/design/kernels.md).
// A decode step's rows run on the calling thread (a parallel region costs more than the work).
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0),
              "kvcache rms_norm: x [M, K] and w [K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "kvcache rms_norm: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "kvcache rms_norm: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 8 == 0, "kvcache rms_norm: K must be a positive multiple of 8");
  at::Tensor y = at::empty({M, K}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      rms_row(xp + m * K, wp, K, (float)eps, yp + m * K);
    }
  });
  return y;
}

}  // namespace kvk
