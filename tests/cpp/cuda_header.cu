// nvcc compiles refattn.hpp into a CUDA translation unit (host code; no GPU needed): a test
// suite of a CUDA kernel includes the header beside its kernels. Compiled, not run, by
// tests/cpp/test_cpp.py (nvcc -std=c++17 -c).
#include "refattn.hpp"

__global__ void scale_rows(double* x, double s, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}

bool check_case(const char* bundle, const char* case_id) {
  refattn::Bundle b = refattn::Bundle::open(bundle);
  refattn::Case c = b.load(case_id);
  const refattn::Tensor& out = c.tensor("output");
  return refattn::compare(c, "output", out.values, "float64").passed;
}
