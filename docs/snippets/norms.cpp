// docs/norms_and_dropout.md: layer normalisation forward and backward in half storage
// with float statistics, batch normalisation in training then inference mode over an
// NHWC tensor, and dropout with a stored mask, each checked against float64 or against
// its defining formula.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

using mpx::half;

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  using P = mpx::mixed_float16;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-1, 1);

  // ---- layer norm: x [rows, cols] in half, 100 + noise (a large common offset) ----
  constexpr long rows = 4, cols = 64;
  auto x = mpx::make_tensor<half>(exec, {rows, cols});
  auto dy = mpx::make_tensor<half>(exec, {rows, cols});
  for (half& v : x) v = mpx::cast<half>(100.0f + dist(gen));
  for (half& v : dy) v = mpx::cast<half>(dist(gen));
  auto gamma = mpx::make_tensor<float>(exec, {cols});   // scale and shift are float
  auto beta = mpx::make_tensor<float>(exec, {cols});
  for (long j = 0; j < cols; ++j) gamma[j] = 1.0f + 0.01f * static_cast<float>(j), beta[j] = 0.5f;
  auto y = mpx::make_tensor<half>(exec, {rows, cols});
  auto mean = mpx::make_tensor<float>(exec, {rows});   // saved for the backward pass
  auto rstd = mpx::make_tensor<float>(exec, {rows});
  mpx::layer_norm_forward<P>(exec, x, gamma, beta, y, mean, rstd);  // eps = 1e-5

  auto dx = mpx::make_tensor<half>(exec, {rows, cols});
  auto dgamma = mpx::make_tensor<float>(exec, {cols});
  auto dbeta = mpx::make_tensor<float>(exec, {cols});
  mpx::layer_norm_backward<P>(exec, x, dy, gamma, mean, rstd, dx, dgamma, dbeta);

  // Against float64 from the same stored halves.
  double worst_y = 0, worst_dx = 0, worst_db = 0;
  for (long r = 0; r < rows; ++r) {
    double m = 0, v = 0, sg = 0, sgx = 0;
    for (long c = 0; c < cols; ++c) m += mpx::cast<double>(x[r * cols + c]) / cols;
    for (long c = 0; c < cols; ++c) v += std::pow(mpx::cast<double>(x[r * cols + c]) - m, 2) / cols;
    double const rs = 1 / std::sqrt(v + 1e-5);
    ok &= std::abs(mean[r] - m) <= 1e-4 && std::abs(rstd[r] - rs) <= 1e-4 * rs;
    for (long c = 0; c < cols; ++c) {
      double const xh = (mpx::cast<double>(x[r * cols + c]) - m) * rs, g = mpx::cast<double>(dy[r * cols + c]) * gamma[c];
      double const ref = xh * gamma[c] + beta[c], err = std::abs(mpx::cast<double>(y[r * cols + c]) - ref);
      ok &= err <= std::ldexp(std::abs(ref), -11) + 1e-4;  // half's rounding, and float statistics
      worst_y = std::fmax(worst_y, err);
      sg += g / cols;
      sgx += g * xh / cols;
    }
    for (long c = 0; c < cols; ++c) {
      double const xh = (mpx::cast<double>(x[r * cols + c]) - m) * rs, g = mpx::cast<double>(dy[r * cols + c]) * gamma[c];
      double const ref = rs * (g - sg - xh * sgx), err = std::abs(mpx::cast<double>(dx[r * cols + c]) - ref);
      ok &= err <= std::ldexp(std::abs(ref), -11) + 1e-4;
      worst_dx = std::fmax(worst_dx, err);
    }
  }
  for (long c = 0; c < cols; ++c) {
    double db = 0;
    for (long r = 0; r < rows; ++r) db += mpx::cast<double>(dy[r * cols + c]);
    worst_db = std::fmax(worst_db, std::abs(dbeta[c] - db));
  }
  ok &= worst_db <= 1e-5;  // a float sum of 4 halves
  std::printf("layer norm: max |y - float64| = %.1e, |dx - float64| = %.1e, |dbeta - float64| = %.1e\n", worst_y,
              worst_dx, worst_db);

  // ---- batch norm over NHWC [2, 3, 3, 4]: per channel, over the 18 rows of [N*H*W, C] ----
  constexpr long n_rows = 2 * 3 * 3, channels = 4;
  auto bx = mpx::make_tensor<half>(exec, {2, 3, 3, channels});
  for (long i = 0; i < n_rows * channels; ++i) bx[i] = mpx::cast<half>(static_cast<float>(i % channels) + dist(gen));
  auto ones = mpx::make_tensor<float>(exec, {channels}), zeros = mpx::make_tensor<float>(exec, {channels});
  mpx::fill(exec, ones, 1.0f);
  mpx::fill(exec, zeros, 0.0f);
  auto running_mean = mpx::make_tensor<float>(exec, {channels}), running_var = mpx::make_tensor<float>(exec, {channels});
  mpx::fill(exec, running_mean, 0.0f);
  mpx::fill(exec, running_var, 1.0f);
  auto save_mean = mpx::make_tensor<float>(exec, {channels}), save_invstd = mpx::make_tensor<float>(exec, {channels});
  auto by = mpx::make_tensor<half>(exec, bx.shape());
  // momentum 0 replaces the running statistics by this batch's (Keras's default is 0.99).
  mpx::batch_norm_forward_training<P>(exec, bx, ones, zeros, by, running_mean, running_var, save_mean, save_invstd,
                                      {.momentum = 0.0f, .eps = 1e-3f});
  for (long c = 0; c < channels; ++c) {
    double m = 0, v = 0, ym = 0;
    for (long r = 0; r < n_rows; ++r) m += mpx::cast<double>(bx[r * channels + c]) / n_rows;
    for (long r = 0; r < n_rows; ++r) v += std::pow(mpx::cast<double>(bx[r * channels + c]) - m, 2);
    for (long r = 0; r < n_rows; ++r) ym += mpx::cast<double>(by[r * channels + c]) / n_rows;
    ok &= std::abs(save_mean[c] - m) <= 1e-5 && std::abs(running_mean[c] - m) <= 1e-5;
    ok &= std::abs(running_var[c] - v / (n_rows - 1)) <= 1e-5 * v;  // the unbiased variance, as PyTorch
    ok &= std::abs(ym) <= 2e-3;                                     // y has mean beta = 0 per channel
  }
  // Inference normalises with the running statistics and updates nothing.
  auto by_inf = mpx::make_tensor<half>(exec, bx.shape());
  mpx::batch_norm_forward_inference<P>(exec, bx, ones, zeros, running_mean, running_var, by_inf);
  double const expect0 = (mpx::cast<double>(bx[0]) - running_mean[0]) / std::sqrt(running_var[0] + 1e-3);
  ok &= std::abs(mpx::cast<double>(by_inf[0]) - expect0) <= 2e-3;
  // Backward from the saved statistics: dbeta is the column sum of dy, and dx sums to 0
  // over each channel.
  auto bdy = mpx::make_tensor<half>(exec, bx.shape()), bdx = mpx::make_tensor<half>(exec, bx.shape());
  for (half& v : bdy) v = mpx::cast<half>(dist(gen));
  auto bdgamma = mpx::make_tensor<float>(exec, {channels}), bdbeta = mpx::make_tensor<float>(exec, {channels});
  mpx::batch_norm_backward<P>(exec, bx, bdy, ones, save_mean, save_invstd, bdx, bdgamma, bdbeta);
  for (long c = 0; c < channels; ++c) {
    double db = 0, sdx = 0;
    for (long r = 0; r < n_rows; ++r) db += mpx::cast<double>(bdy[r * channels + c]);
    for (long r = 0; r < n_rows; ++r) sdx += mpx::cast<double>(bdx[r * channels + c]);
    ok &= std::abs(bdbeta[c] - db) <= 1e-5 && std::abs(sdx) <= 1e-2;
  }
  std::printf("batch norm: running_var[0] = %.5f (unbiased), inference y[0] = %.4f (float64: %.4f)\n",
              running_var[0], mpx::cast<float>(by_inf[0]), expect0);

  // ---- dropout with a stored mask: a new offset per step and per layer ----
  mpx::dropout_options const drop{.rate = 0.25f, .seed = 2024, .offset = 17};
  auto dy_drop = mpx::make_tensor<half>(exec, x.shape());
  auto mask = mpx::make_tensor<std::uint8_t>(exec, x.shape());
  mpx::dropout_forward(exec, drop, y, dy_drop, mask);  // dy_drop = y * mask / 0.75
  long kept = 0;
  for (long i = 0; i < rows * cols; ++i) {
    bool const keep = mask[i] != 0;
    kept += keep;
    ok &= keep == mpx::dropout_keeps(drop, static_cast<std::uint64_t>(i));  // host and GPU draw the same mask
    ok &= mpx::cast<float>(dy_drop[i]) ==
          mpx::cast<float>(mpx::cast<half>(mpx::cast<float>(y[i]) * (keep ? 1.0f / 0.75f : 0.0f)));
  }
  // Backward from the stored mask, and from the regenerated one: the same bits.
  auto g_stored = mpx::make_tensor<half>(exec, x.shape()), g_regen = mpx::make_tensor<half>(exec, x.shape());
  mpx::dropout_backward(exec, drop, dy, g_stored, mask);
  mpx::dropout_backward(exec, drop, dy, g_regen);
  for (long i = 0; i < rows * cols; ++i) ok &= mpx::cast<float>(g_stored[i]) == mpx::cast<float>(g_regen[i]);
  ok &= kept > 0 && kept < rows * cols;
  std::printf("dropout: kept %ld of %ld at rate 0.25\n", kept, rows * cols);

  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
