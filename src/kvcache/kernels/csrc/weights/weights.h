// The weights unit's entry points (bindings.cpp binds them).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace kvk {

// dequantize.cpp
at::Tensor dequantize_rows(int64_t kind, const at::Tensor& data, const at::Tensor& ids, int64_t K);
// qlinear.cpp
at::Tensor qlinear_rows(const at::Tensor& x, const std::vector<int64_t>& kinds,
                        const std::vector<at::Tensor>& parts, const at::Tensor& residual,
                        const at::Tensor& norm, double eps, bool glu);
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t group);
std::string weights_isa();

// the checks every entry makes of a part: uint8 [rows, K / values * nbytes], contiguous
void check_part(int64_t kind, const at::Tensor& data, int64_t K);

}  // namespace kvk
