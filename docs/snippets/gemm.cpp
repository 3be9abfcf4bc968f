// docs/gemm.md: a dense layer's forward and backward products with mpx::gemm under
// mixed_float16 (half operands, float sums), checked against float64 with the documented
// error bound; a batch; a refused shape.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using mpx::half;

// The bound docs/gemm.md promises for half operands and a half C, for one element:
// |C - exact| <= (2^-11 + (K + 4) * 2^-23) * sum_k |a||b| + 2^-24.
bool within_bound(float got, double exact, double abs_sum, long k) {
  double const bound = (std::ldexp(1.0, -11) + static_cast<double>(k + 4) * std::ldexp(1.0, -23)) * abs_sum;
  return std::abs(static_cast<double>(got) - exact) <= bound + std::ldexp(1.0, -24);
}

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  using P = mpx::mixed_float16;
  constexpr long batch = 32, in = 100, out = 24;

  // A dense layer y = x W, x [batch, in], W [in, out], all in half.
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  auto x = mpx::make_tensor<half>(exec, {batch, in});
  auto w = mpx::make_tensor<half>(exec, {in, out});
  for (half& v : x) v = mpx::cast<half>(dist(gen));
  for (half& v : w) v = mpx::cast<half>(dist(gen));
  auto y = mpx::make_tensor<half>(exec, {batch, out});
  mpx::gemm<P>(exec, x, w, y);  // y = x W, summed in float

  for (long i = 0; i < batch; ++i)
    for (long j = 0; j < out; ++j) {
      double exact = 0, abs_sum = 0;
      for (long k = 0; k < in; ++k) {
        double const p = mpx::cast<double>(x[i * in + k]) * mpx::cast<double>(w[k * out + j]);
        exact += p;
        abs_sum += std::abs(p);
      }
      ok &= within_bound(mpx::cast<float>(y[i * out + j]), exact, abs_sum, in);
    }

  // Backward: dx = dy W^T (transpose_b), and the weight gradient dW = x^T dy in float,
  // accumulated over two micro-batches with beta = 1.
  auto dy = mpx::make_tensor<half>(exec, {batch, out});
  mpx::fill(exec, dy, mpx::cast<half>(0.5f));
  auto dx = mpx::make_tensor<half>(exec, {batch, in});
  mpx::gemm<P>(exec, dy, w, dx, {.transpose_b = true});
  auto dw = mpx::make_tensor<float>(exec, {in, out});  // C may be float under a 16-bit policy
  mpx::gemm<P>(exec, x, dy, dw, {.transpose_a = true});              // dW  = x^T dy
  mpx::gemm<P>(exec, x, dy, dw, {.transpose_a = true, .beta = 1});   // dW += x^T dy
  double dw00 = 0;
  for (long b = 0; b < batch; ++b) dw00 += 2 * 0.5 * mpx::cast<double>(x[b * in]);
  ok &= std::abs(dw[0] - dw00) <= 1e-5 * (1 + std::abs(dw00));
  double dx00 = 0;
  for (long j = 0; j < out; ++j) dx00 += 0.5 * mpx::cast<double>(w[j]);
  ok &= std::abs(mpx::cast<double>(dx[0]) - dx00) <= 1e-3 * (1 + std::abs(dx00));

  // A batch of products sharing W: [4, 8, in] x [in, out] -> [4, 8, out].
  auto xs = mpx::make_tensor<half>(exec, {4, 8, in});
  mpx::copy(exec, mpx::view(x).reshape({4, 8, in}), xs);
  auto ys = mpx::make_tensor<half>(exec, {4, 8, out});
  mpx::gemm<P>(exec, xs, w, ys);
  for (std::size_t i = 0; i < ys.size(); ++i) ok &= mpx::bits(ys[i]) == mpx::bits(y[i]);  // same rows, same sums

  // Shapes that do not agree are named in the error.
  try {
    mpx::gemm<P>(exec, x, x, y);
    ok = false;
  } catch (mpx::shape_error const& e) {
    std::printf("%s\n", e.what());  // mpx::gemm: shapes do not agree: A [32, 100], B [32, 100], C [32, 24]: ...
  }

  std::printf("y[0][0] = %g, dW[0][0] = %g (float64: %g); host path: %s\n", mpx::cast<float>(y[0]), dw[0], dw00,
              mpx::gemm_host_library);
  return ok ? 0 : 1;
}
