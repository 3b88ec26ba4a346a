// Python bindings of the weights unit (kernels/qlinear.py calls them).
#include "weights.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_rows", &kvk::dequantize_rows,
        "rows of a GGUF block part as float32 (gguf's values; all rows if ids is empty)",
        py::arg("kind"), py::arg("data"), py::arg("ids"), py::arg("K"));
  m.def("qlinear_rows", &kvk::qlinear_rows,
        "f(x) @ W^T (+ residual) for a few rows of x over GGUF block parts; f: RMSNorm by "
        "`norm`, SwiGLU (glu), or none",
        py::arg("x"), py::arg("kinds"), py::arg("parts"), py::arg("residual"), py::arg("norm"),
        py::arg("eps"), py::arg("glu"));
  m.def("quantize_activations", &kvk::quantize_activations,
        "rows quantized to int8 per block of `group` (codes, scales, sums per 32)");
  m.def("isa", &kvk::weights_isa, "the int8 dot product paths of this build: vnni, avx2, none");
}
