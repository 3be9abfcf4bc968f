// docs/lstm.md: a Keras LSTM layer's forward pass under mixed_float16 checked against a
// float64 LSTM, and its backward pass for a return_sequences = false loss checked
// against finite differences of the forward pass (under float32).
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using mpx::half;

// The float64 LSTM over the same (rounded) inputs: h of the last step, [N, U].
std::vector<double> last_h(long n_, long t_, long f_, long u_, std::vector<double> const& x,
                           std::vector<double> const& w, std::vector<double> const& r, std::vector<double> const& b) {
  auto sig = [](double z) { return 1 / (1 + std::exp(-z)); };
  std::vector<double> h(n_ * u_, 0.0), c(n_ * u_, 0.0), z(4 * u_);
  for (long t = 0; t < t_; ++t) {
    std::vector<double> next(n_ * u_);
    for (long n = 0; n < n_; ++n) {
      for (long col = 0; col < 4 * u_; ++col) {
        z[col] = b[col];
        for (long f = 0; f < f_; ++f) z[col] += x[(n * t_ + t) * f_ + f] * w[f * 4 * u_ + col];
        for (long k = 0; k < u_; ++k) z[col] += h[n * u_ + k] * r[k * 4 * u_ + col];
      }
      for (long j = 0; j < u_; ++j) {  // gates i, f, c, o
        double& cell = c[n * u_ + j];
        cell = sig(z[u_ + j]) * cell + sig(z[j]) * std::tanh(z[2 * u_ + j]);
        next[n * u_ + j] = sig(z[3 * u_ + j]) * std::tanh(cell);
      }
    }
    h = next;
  }
  return h;
}

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  constexpr long N = 4, T = 6, F = 3, U = 8;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-1, 1);

  // ---- forward under mixed_float16: x, W, R, h in half; bias and workspace float ----
  using P = mpx::mixed_float16;
  auto x = mpx::make_tensor<half>(exec, {N, T, F});
  auto w = mpx::make_tensor<half>(exec, {F, 4 * U});        // kernel, gates i, f, c, o
  auto r = mpx::make_tensor<half>(exec, {U, 4 * U});        // recurrent kernel
  auto b = mpx::make_tensor<float>(exec, {4 * U});
  for (half& v : x) v = mpx::cast<half>(dist(gen));
  for (half& v : w) v = mpx::cast<half>(0.5f * dist(gen));
  for (half& v : r) v = mpx::cast<half>(0.1f * dist(gen));
  for (long j = 0; j < 4 * U; ++j) b[j] = (j >= U && j < 2 * U) ? 1.0f : 0.0f;  // unit_forget_bias
  auto h = mpx::make_tensor<half>(exec, {N, T, U});  // every step's output
  auto workspace = mpx::make_tensor<float>(exec, {static_cast<long>(mpx::lstm_workspace_elements<P>(N, T, F, U))});
  mpx::lstm_forward<P>(exec, x, w, r, b, h, workspace);

  auto widen = [](auto& t) {
    std::vector<double> out;
    for (auto v : t) out.push_back(mpx::cast<double>(v));
    return out;
  };
  auto const ref = last_h(N, T, F, U, widen(x), widen(w), widen(r), widen(b));
  double worst = 0;
  for (long n = 0; n < N; ++n)
    for (long j = 0; j < U; ++j) {  // h[:, T - 1, :]: Keras's return_sequences = false output
      double const got = mpx::cast<double>(h[(n * T + T - 1) * U + j]);
      worst = std::fmax(worst, std::abs(got - ref[n * U + j]));
    }
  ok &= worst <= 2e-3;  // a few half roundings of h (2^-11 relative each), see docs/lstm.md
  std::printf("mixed_float16: max |h_T - float64| = %.2e\n", worst);

  // ---- backward under float32, for loss = sum_n,j g[n, j] h[n, T - 1, j] ----
  using F32 = mpx::float32;
  auto xf = mpx::make_tensor<float>(exec, {N, T, F});
  auto wf = mpx::make_tensor<float>(exec, {F, 4 * U});
  auto rf = mpx::make_tensor<float>(exec, {U, 4 * U});
  mpx::cast(exec, x, xf);
  mpx::cast(exec, w, wf);
  mpx::cast(exec, r, rf);
  auto hf = mpx::make_tensor<float>(exec, {N, T, U});
  auto ws = mpx::make_tensor<float>(exec, {static_cast<long>(mpx::lstm_workspace_elements<F32>(N, T, F, U))});
  auto dh = mpx::make_tensor<float>(exec, {N, T, U});  // zero but for the last step
  mpx::fill(exec, dh, 0.0f);
  for (long n = 0; n < N; ++n)
    for (long j = 0; j < U; ++j) dh[(n * T + T - 1) * U + j] = dist(gen);
  auto loss = [&] {
    mpx::lstm_forward<F32>(exec, xf, wf, rf, b, hf, ws);
    double l = 0;
    for (std::size_t i = 0; i < hf.size(); ++i) l += static_cast<double>(dh[i]) * hf[i];
    return l;
  };
  loss();
  auto dx = mpx::make_tensor<float>(exec, {N, T, F});
  auto dw = mpx::make_tensor<float>(exec, {F, 4 * U});
  auto dr = mpx::make_tensor<float>(exec, {U, 4 * U});
  auto db = mpx::make_tensor<float>(exec, {4 * U});
  mpx::lstm_backward<F32>(exec, dh, wf, rf, dx, dw, dr, db, ws);

  // Central differences of the float forward pass, step 1e-2: the bias gradient.
  double worst_db = 0;
  for (long j = 0; j < 4 * U; ++j) {
    float const keep = b[j];
    b[j] = keep + 1e-2f;
    double const up = loss();
    b[j] = keep - 1e-2f;
    double const down = loss();
    b[j] = keep;
    worst_db = std::fmax(worst_db, std::abs((up - down) / 2e-2 - db[j]));
  }
  ok &= worst_db <= 1e-3;
  std::printf("float32: max |dbias - finite difference| = %.2e\n", worst_db);

  // Shapes that do not agree are named in the error.
  try {
    mpx::lstm_forward<P>(exec, x, r, r, b, h, workspace);  // r where w belongs
    ok = false;
  } catch (mpx::shape_error const& e) {
    std::printf("%s\n", e.what());  // mpx::lstm_forward: kernel of shape [8, 32] does not match x of shape ...
  }
  return ok ? 0 : 1;
}
