// docs/activations_softmax_losses.md: softmax and log_softmax over the last axis, in
// float whatever the storage, with a masked entry, and the backward pass.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

using mpx::bfloat16;

int main() {
  bool ok = true;
  mpx::host_executor exec;

  // Two rows of four logits in bfloat16; the second row masks its last entry with -inf.
  std::vector<float> const values = {1.0f, 2.0f, 3.0f, 4.0f, 1e4f, 1e4f, 0.0f, -INFINITY};
  auto x = mpx::make_tensor<bfloat16>(exec, {2, 4});
  for (std::size_t i = 0; i < values.size(); ++i) x[i] = mpx::cast<bfloat16>(values[i]);

  // The policy says where sums are kept; mixed_bfloat16 keeps them in float. A policy
  // with a 16-bit accumulate_type does not compile.
  auto p = mpx::make_tensor<float>(exec, x.shape());  // probabilities in float
  mpx::softmax<mpx::mixed_bfloat16>(exec, x, p);
  double const s = std::exp(-3.0) + std::exp(-2.0) + std::exp(-1.0) + 1.0;
  ok &= std::fabs(p[3] - 1.0 / s) < 1e-6;
  ok &= p[4] == 0.5f && p[5] == 0.5f && p[6] == 0.0f && p[7] == 0.0f;  // 1e4 does not overflow
  std::printf("softmax row 0: %.6f %.6f %.6f %.6f\n", p[0], p[1], p[2], p[3]);

  auto lp = mpx::make_tensor<float>(exec, x.shape());
  mpx::log_softmax<mpx::mixed_bfloat16>(exec, x, lp);
  ok &= std::fabs(lp[3] + std::log(s)) < 1e-6 && lp[7] == -INFINITY;

  // Backward from the output: dx = p * (dy - sum(dy * p)).
  auto dy = mpx::make_tensor<float>(exec, x.shape());
  mpx::fill(exec, dy, 0.0f);
  dy[3] = 1.0f;  // the gradient of p[3] alone
  auto dx = mpx::make_tensor<float>(exec, x.shape());
  mpx::softmax_backward(exec, p, dy, dx);
  ok &= std::fabs(dx[3] - p[3] * (1 - p[3])) < 1e-7 && std::fabs(dx[0] + p[0] * p[3]) < 1e-7;

  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
