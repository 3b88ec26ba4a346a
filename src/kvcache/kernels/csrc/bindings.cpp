// The attention unit's Python module: every function api.h declares.
#include "api.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &kvk::attend, "attention over plan segments from the codes, merged per row");
  m.def("partials", &kvk::partials, "attention partial sums over plan segments, from the codes");
  m.def("merge", &kvk::merge, "merge each row's partial sums");
  m.def("gather", &kvk::gather, "decoded rows of cells");
  m.def("tile_paths", &kvk::tile_paths, "the key and value paths that would read a tile");
  m.def("linear_rows", &kvk::linear_rows,
        "f(x) @ w^T (+ bias) (+ residual) for a few rows of x; f: RMSNorm by `norm`, SwiGLU "
        "(glu), or none",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("residual"), py::arg("norm"),
        py::arg("eps"), py::arg("glu"));
  m.def("rms_norm_rows", &kvk::rms_norm_rows, "RMSNorm of rows times a weight");
  m.def("rope_rows", &kvk::rope_rows, "RoPE (rotate-half) of rows from cos/sin tables");
  m.def("split_heads", &kvk::split_heads,
        "q, k, v of a fused projection's rows: per-head norms (optional) and RoPE");
  m.def("put_rows", &kvk::put_rows, "rows copied into slots of a float32/float16 buffer");
  m.def("dense_attention", &kvk::dense_attention, "unmasked attention over dense windows");
  m.def("query_steps16", &kvk::query_steps16, "queries rounded to int16 steps (4-bit, 8-bit keys)",
        py::arg("q"), py::arg("nibble_order") = true);
  m.def("turbo_steps16", &kvk::turbo_steps16, "queries as turbo keys score them (int16 steps)");
  m.def("encode_int8", &kvk::encode_int8, "int8 codes and scales of rows, into their cells");
  m.def("encode_affine", &kvk::encode_affine, "affine codes, scales, minimums, into cells");
  m.def("range_channels", &kvk::range_channels, "a record's channel ranges over its rows");
  m.def("encode_channels", &kvk::encode_channels, "codes of rows against their records' ranges");
  m.def("encode_turbo", &kvk::encode_turbo, "turbo codes and flagged scales of rows, into cells");
  m.def("parallel_threads", &kvk::parallel_threads, "threads an at::parallel_for ran on");
  m.def("isa", &kvk::isa, "the vector paths of this build: avx512, avx2 or none");
}
