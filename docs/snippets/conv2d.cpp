// docs/conv_and_pooling.md: a Conv2D + bias + relu + MaxPool2D block, forward and
// backward, under mixed_float16 (half tensors, float sums), checked against a float64
// direct convolution with the documented bounds; Keras 'same' padding; a refused shape.
#include <mpx/kernels/conv2d.hpp>
#include <mpx/kernels/max_pool.hpp>
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using mpx::half;

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  using P = mpx::mixed_float16;

  // 8 images of 28 x 28 x 1 -> 3x3 conv, 16 filters, 'same' padding -> relu -> 2x2 pool.
  mpx::shape const xs{8, 28, 28, 1}, ws{3, 3, 1, 16};
  auto const options = mpx::conv2d_padding_same(xs, ws);          // pad 1 on each side
  auto const ys = mpx::conv2d_output_shape(xs, ws, options);      // [8, 28, 28, 16]
  auto x = mpx::make_tensor<half>(exec, xs);
  auto w = mpx::make_tensor<half>(exec, ws);
  auto bias = mpx::make_tensor<float>(exec, {16});
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (half& v : x) v = mpx::cast<half>(dist(gen));
  for (half& v : w) v = mpx::cast<half>(dist(gen));
  for (float& v : bias) v = 0.1f * dist(gen);

  // One workspace (im2col columns) for the whole batch, allocated once, reused every step.
  auto columns = mpx::make_tensor<half>(exec, mpx::conv2d_workspace_shape(xs, ws, options));  // [6272, 9]
  auto y = mpx::make_tensor<half>(exec, ys);
  mpx::conv2d_forward<P>(exec, x, w, y, columns, options);
  std::int64_t const rows = ys[0] * ys[1] * ys[2];  // the bias and activation see y as [N*OH*OW, Cout]
  auto a = mpx::make_tensor<half>(exec, ys);
  mpx::bias_activation_forward(exec, mpx::act::relu{}, mpx::view(y).reshape({rows, 16}), bias,
                               mpx::view(a).reshape({rows, 16}));
  auto const ps = mpx::max_pool2d_output_shape(ys);               // [8, 14, 14, 16]
  auto p = mpx::make_tensor<half>(exec, ps);
  mpx::max_pool2d_forward(exec, a, p);

  // y[n, oh, ow, co] against float64, with the bound u_half |exact| + (K + 5) 2^-23 sum|x w|.
  auto const at = [&](long n, long oh, long ow, long co) {
    double exact = 0, abs_sum = 0;
    for (long kh = 0; kh < 3; ++kh)
      for (long kw = 0; kw < 3; ++kw) {
        long const ih = oh - 1 + kh, iw = ow - 1 + kw;  // stride 1, pad 1
        if (ih < 0 || ih >= 28 || iw < 0 || iw >= 28) continue;
        double const t = mpx::cast<double>(x[static_cast<std::size_t>((n * 28 + ih) * 28 + iw)]) *
                         mpx::cast<double>(w[static_cast<std::size_t>((kh * 3 + kw) * 16 + co)]);
        exact += t;
        abs_sum += std::abs(t);
      }
    double const got = mpx::cast<double>(y[static_cast<std::size_t>(((n * 28 + oh) * 28 + ow) * 16 + co)]);
    return std::abs(got - exact) <= std::ldexp(1.0, -11) * std::abs(exact) + 14 * std::ldexp(1.0, -23) * abs_sum;
  };
  for (long n : {0L, 7L})
    for (long oh : {0L, 13L, 27L})
      for (long ow : {0L, 5L, 27L})
        for (long co : {0L, 15L}) ok &= at(n, oh, ow, co);

  // Backward: pool, relu and bias, then both convolution gradients. The weight gradient
  // goes first and reuses the forward pass's columns; the input gradient then overwrites
  // the workspace. dW in float, as a float master weight wants it.
  auto dp = mpx::make_tensor<half>(exec, ps);
  mpx::fill(exec, dp, mpx::cast<half>(1.0f));
  auto da = mpx::make_tensor<half>(exec, ys);
  mpx::max_pool2d_backward(exec, a, p, dp, da);
  auto dy = mpx::make_tensor<half>(exec, ys);
  auto dbias = mpx::make_tensor<float>(exec, {16});
  mpx::bias_activation_backward(exec, mpx::act::relu{}, mpx::view(y).reshape({rows, 16}), bias,
                                mpx::view(da).reshape({rows, 16}), mpx::view(dy).reshape({rows, 16}), dbias);
  auto dw = mpx::make_tensor<float>(exec, ws);
  auto dx = mpx::make_tensor<half>(exec, xs);
  mpx::conv2d_backward<P>(exec, x, w, dy, dx, dw, columns, options, mpx::conv2d_columns::reuse_forward);

  // dW[1, 1, 0, co] (the centre tap) = sum over pixels of x * dy, in float64.
  for (long co : {0L, 9L}) {
    double exact = 0, abs_sum = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      double const t = mpx::cast<double>(x[i]) * mpx::cast<double>(dy[i * 16 + static_cast<std::size_t>(co)]);
      exact += t;
      abs_sum += std::abs(t);
    }
    double const got = dw[static_cast<std::size_t>((1 * 3 + 1) * 16 + co)];
    ok &= abs_sum > 0 && std::abs(got - exact) <= std::ldexp(1.0, -24) * std::abs(exact) +
                                                      (static_cast<double>(rows) + 5) * std::ldexp(1.0, -23) * abs_sum;
  }

  // Shapes that do not convolve are named in the error.
  try {
    auto w_rgb = mpx::make_tensor<half>(exec, {3, 3, 3, 16});
    mpx::conv2d_forward<P>(exec, x, w_rgb, y, columns, options);
    ok = false;
  } catch (mpx::shape_error const& e) {
    std::printf("%s\n", e.what());  // mpx::conv2d_forward: x [8, 28, 28, 1] [N, H, W, Cin] and w [3, 3, 3, 16] ...
  }

  std::printf("y %s, pooled %s, dW[1][1][0][0] = %g\n", ys.to_string().c_str(), ps.to_string().c_str(), dw[64]);
  return ok ? 0 : 1;
}
