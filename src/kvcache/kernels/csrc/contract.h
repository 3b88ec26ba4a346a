// The contract between a codec's Layout and the readers: src/kvcache/kernels/contract.py,
// mirrored line for line (tests/test_kernel_sources.py checks that the two agree).
#pragma once

#include <cstdint>

namespace kvk {

// how a buffer's rows are stored (contract.py, Kind)
enum Kind : int64_t { F32 = 0, F16, BF16, INT8, AFFINE_ROWS, AFFINE_CHANNELS, TURBO };

// a Layout's tensors in the order the readers take them (contract.py, SLOTS)
enum Slot : int {
  DATA = 0, SCALE, LOW, META_OF, META_A, META_B, WINDOW, RESIDUAL, CENTROIDS, SIGNS, NUM_SLOTS
};
// then its ints (contract.py, INT_SLOTS)
enum IntSlot : int { KIND = 0, BITS, GROUP, LOG_SCALE, ROPE_MODE, ROTATED, NUM_INTS };

// how stored keys stand to RoPE (contract.py, RopeMode)
enum RopeMode : int64_t { AFTER_ROPE = 0, BEFORE_ROPE = 1, CENTRE_ROPE = 2 };

constexpr int kMaxDim = 256;  // the largest head_dim (contract.py, MAX_DIM)
constexpr int kAlign = 16;    // head_dim is a multiple of it (contract.py, ALIGN)

}  // namespace kvk
