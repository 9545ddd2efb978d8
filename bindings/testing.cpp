// cpumoe._C_testing: entry points for the tests only, taking raw addresses with no way to check
// them. Built beside _C for the test stages (CPUMOE_BUILD_PYTHON_TESTING), never installed by
// `pip install .`, so the shipped module has no door that writes to an arbitrary address.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "cpumoe/moe.h"

namespace py = pybind11;
using namespace cpumoe;

PYBIND11_MODULE(_C_testing, m) {
  m.doc() = "cpumoe test-only entry points (raw addresses, unchecked): not part of the package";
  m.def(
      "quantize_rows",
      [](uintptr_t x, const std::string& dtype, int64_t rows, int64_t cols, int64_t x_stride,
         uintptr_t q, uintptr_t scales) {
        DType dt;
        if (dtype == "float32") dt = DType::f32;
        else if (dtype == "float16") dt = DType::f16;
        else if (dtype == "bfloat16") dt = DType::bf16;
        else throw py::type_error("x: dtype must be float32, float16 or bfloat16, got " + dtype);
        py::gil_scoped_release nogil;
        for (int64_t r = 0; r < rows; ++r)
          reinterpret_cast<float*>(scales)[r] =
              quantize_row(reinterpret_cast<const uint8_t*>(x) + r * x_stride * dtype_size(dt), dt,
                           cols, reinterpret_cast<int8_t*>(q) + r * cols);
      },
      "The op's per-token int8 quantization of rows (q contiguous [rows, cols], scales [rows]).");
}
