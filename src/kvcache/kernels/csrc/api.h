// The functions the attention unit binds (bindings.cpp), by the file that defines them.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace kvk {

// attention.cpp
std::vector<at::Tensor> partials(const at::Tensor& q, const at::Tensor& cells,
                                 const at::Tensor& pos, const at::Tensor& segs,
                                 const at::Tensor& entries,
                                 const std::vector<at::Tensor>& k_tensors,
                                 const std::vector<int64_t>& k_ints,
                                 const std::vector<at::Tensor>& v_tensors,
                                 const std::vector<int64_t>& v_ints, int64_t kv_heads,
                                 const at::Tensor& cos, const at::Tensor& sin, double scale);
at::Tensor merge(const at::Tensor& pm, const at::Tensor& pl, const at::Tensor& pacc,
                 const at::Tensor& paccr, const at::Tensor& row_ptr,
                 const at::Tensor& row_entries, const at::Tensor& rotation);
at::Tensor attend(const at::Tensor& q, const at::Tensor& cells, const at::Tensor& pos,
                  const at::Tensor& segs, const at::Tensor& entries,
                  const std::vector<at::Tensor>& k_tensors, const std::vector<int64_t>& k_ints,
                  const std::vector<at::Tensor>& v_tensors, const std::vector<int64_t>& v_ints,
                  int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin, double scale,
                  const at::Tensor& row_ptr, const at::Tensor& row_entries,
                  const at::Tensor& rotation);
at::Tensor gather(const at::Tensor& cells, const at::Tensor& pos,
                  const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints,
                  int64_t heads, int64_t dim, const at::Tensor& cos, const at::Tensor& sin);
std::vector<std::string> tile_paths(const at::Tensor& cells,
                                    const std::vector<at::Tensor>& k_tensors,
                                    const std::vector<int64_t>& k_ints,
                                    const std::vector<at::Tensor>& v_tensors,
                                    const std::vector<int64_t>& v_ints, int64_t heads,
                                    int64_t dim);
std::vector<at::Tensor> query_steps16(const at::Tensor& q, bool nibble_order);
std::vector<at::Tensor> turbo_steps16(const at::Tensor& q, const at::Tensor& signs);
int64_t parallel_threads(int64_t n);
std::string isa();
// linear.cpp
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                       const at::Tensor& residual, const at::Tensor& norm, double eps, bool glu);
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps);
// encode.cpp
void encode_int8(const at::Tensor& x, const at::Tensor& cells, at::Tensor& codes,
                 at::Tensor& scale);
void encode_affine(const at::Tensor& x, const at::Tensor& cells, int64_t bits, int64_t group,
                   at::Tensor& codes, at::Tensor& scale, at::Tensor& low, int64_t refits);
void range_channels(const at::Tensor& x, int64_t meta, int64_t bits, at::Tensor& scale,
                    at::Tensor& low);
void encode_channels(const at::Tensor& x, const at::Tensor& cells, const at::Tensor& metas,
                     int64_t bits, at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low);
void encode_turbo(const at::Tensor& x, const at::Tensor& cells, const at::Tensor& offsets,
                  const at::Tensor& signs, const at::Tensor& cell_codes,
                  const at::Tensor& cell_squares, int64_t grid_bits, int64_t bits,
                  at::Tensor& codes, at::Tensor& scale);
// rows.cpp
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::vector<at::Tensor> split_heads(const at::Tensor& qkv, int64_t hq, int64_t hkv,
                                    const at::Tensor& cos, const at::Tensor& sin,
                                    bool rotate_keys, const at::Tensor& q_norm,
                                    const at::Tensor& k_norm, double eps);
void put_rows(at::Tensor& dst, const at::Tensor& slots, const at::Tensor& src,
              const at::Tensor& rows);
// dense.cpp
at::Tensor dense_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& windows, double scale);

}  // namespace kvk
