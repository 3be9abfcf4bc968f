// Dense and conv2d layers under mpx::mixed_fp8, on each executor: the forward product and
// both gradients against a float64 reference that quantises exactly as Transformer
// Engine's recipe says (activations and weights to e4m3, output gradients to e5m2,
// each times its tensor's scale, saturating), with float64 sums of the exact fp8
// products times the inverse scales. The second step runs with the scales the first
// step's amaxes set (not 1), so a scale the layer forgets to apply fails. Ragged sizes
// (a batch of 13 rows, the K of the weight gradient) run on both executors: the layer
// pads K with zeros. Shapes the GPU's fp8 kernels cannot take (N not a multiple of 16)
// are refused on both executors alike.
//
// Bound per element: the sum of exact products on this executor (mpx_test::fp8_sum_bound
// of the padded K: float on the host, about 14 bits per fp8 instruction on Hopper) times
// S, plus the bfloat16 output's rounding, 2^-8 |ref|, plus bfloat16's smallest
// subnormal; conv's dx adds 2^-8 S for its column gradients, rounded to bfloat16 before
// col2im sums them.
#include "../support/reference/conv2d.hpp"
#include "../support/reference/fp8_blocks.hpp"
#include "../support/reference/fp8_tensorwise.hpp"
#include "../support/reference/nvfp4.hpp"
#include "../support/reference/matmul.hpp"
#include "../support/testing.hpp"

#include <mpx/layers/attention.hpp>
#include <mpx/layers/conv2d.hpp>
#include <mpx/layers/dense.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using fp8_storage = mpx::bfloat16;
using mpx::operand_role;

//! What one role's scale was when the layer cast with it.
using fp8_scales = mpx_test::reference::fp8_role_scales;
using mpx_test::reference::dequantised;

template <class Layer, class Exec>
fp8_scales scales_of(Layer const& layer, Exec const& exec) {
  return mpx_test::reference::role_scales_of(layer, exec);
}

template <class Format>
std::vector<double> dequantise(std::vector<fp8_storage> const& v, float scale) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = dequantised<Format>(v[i], scale);
  return out;
}

//! The operands of a layer's three products as fp8_gemm reads them: x and W in e4m3, dy
//! in e5m2, each under its role's scale, in float64.
struct fp8_operands {
  std::vector<double> x, w, dy;
};
fp8_operands dequantised_operands(std::vector<fp8_storage> const& x, std::vector<fp8_storage> const& w,
                                  std::vector<fp8_storage> const& dy, fp8_scales const& s) {
  return {dequantise<mpx::float8_e4m3>(x, s.activation), dequantise<mpx::float8_e4m3>(w, s.weight),
          dequantise<mpx::float8_e5m2>(dy, s.gradient)};
}

//! Counts elements of got outside the bound around ref (S: sums of |terms|), for the
//! executor whose sums `sum_bound` describes (mpx_test::fp8_sum_bound<Exec>).
struct fp8_bound {
  std::string what;
  double (*sum_bound)(std::int64_t);
  std::size_t bad = 0, checked = 0;
  double worst = 0;
  //! k: the terms of the product (padded to the K the GPU multiplies); extra: a further
  //! relative error on s (a rounding of partial sums to bfloat16).
  void check(double got, double ref, double s, std::int64_t k, double extra = 0) {
    double const allowed = sum_bound(mpx::fp8_gemm_padded_extent(k)) * s + extra * s +
                           std::ldexp(1.0, -8) * std::fabs(ref) + std::ldexp(1.0, -133);
    double const err = std::fabs(got - ref);
    ++checked;
    if (!(err <= allowed)) {
      ++bad;
      worst = std::isnan(err) ? err : std::max(worst, err / allowed);
    }
  }
  void require() const {
    INFO(what << ": " << bad << " of " << checked << " outside the bound (worst " << worst << " x)");
    CHECK(checked > 0);
    CHECK(bad == 0);
  }
};

//! check(i, j, sum over k of a(i, k) b(k, j), sum of the terms' magnitudes), in float64
//! (tests/support/reference/matmul.hpp), for every i < m, j < n.
template <class A, class B, class Check>
void for_each_product(std::int64_t m, std::int64_t n, std::int64_t k, A a, B b, Check check) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      auto const e = mpx_test::reference::dot(a, b, i, j, k);
      check(i, j, e.exact, e.magnitude);
    }
}

// ---- dense ----

//! The largest |v| of a tensor, in float.
float amax_of(std::vector<fp8_storage> const& v) {
  float m = 0;
  for (auto x : v) m = std::max(m, std::fabs(mpx::cast<float>(x)));
  return m;
}

//! A dense layer under P (mixed_fp8: delayed scales; mixed_fp8_current: each tensor's
//! scale from itself), two steps, the second's three products against float64.
template <class P, class Exec>
void check_fp8_dense(Exec const& exec, std::int64_t rows, std::int64_t in, std::int64_t units) {
  using Space = mpx::memory_space_t<Exec>;
  constexpr bool current = mpx_test::reference::current_scaling_v<P>;
  INFO(P::name << " dense rows=" << rows << " in=" << in << " units=" << units);
  mpx::dense<P> layer(units);
  layer.set_name("dense");
  layer.build(exec, mpx::shape{in}, mpx_test::seed);
  layer.reserve(exec, rows);
  fp8_scales first_scales;
  for (int step = 0; step < 2; ++step) {
    std::uint64_t const stream = 40 + 10 * static_cast<std::uint64_t>(step);
    // Under current scaling the first step's tensors are 8 times larger: a scale that
    // remembered them would show in the second.
    double const range = current && step == 0 ? 8.0 : 1.0;
    auto const xs = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * in), -3 * range, 3 * range, stream);
    auto const dys = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * units), -1e-3 * range,
                                                          1e-3 * range, stream + 1);
    auto const x = mpx_test::upload(exec, xs, mpx::shape{rows, in});
    auto const dy = mpx_test::upload(exec, dys, mpx::shape{rows, units});
    auto y = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{rows, units});
    auto dx = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{rows, in});
    fp8_scales s = scales_of(layer, exec);  // delayed scaling casts with the scales from before the step
    if (step == 0) first_scales = s;
    layer.forward(exec, mpx::view(std::as_const(x)), mpx::view(y), true);
    layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)), mpx::view(std::as_const(dy)),
                   mpx::view(dx));
    auto const w = mpx_test::download(exec, layer.template kernel<Space>());
    if constexpr (current) {
      // Current scaling set each scale from the tensor it cast, in this step: fp8 max /
      // amax of x, W and dy (each role casts the same tensor twice, so the state holds it).
      s = scales_of(layer, exec);
      CHECK(s.activation == 448.0f / amax_of(xs));
      CHECK(s.weight == 448.0f / amax_of(w));
      CHECK(s.gradient == 57344.0f / amax_of(dys));
    } else {
      if (step == 0) continue;  // the first step only sets the scales from its amaxes
      // The scales moved from their start (1) to fp8 max / amax: the products must apply them.
      CHECK(s.activation != first_scales.activation);
      CHECK(s.weight != first_scales.weight);
      CHECK(s.gradient != first_scales.gradient);
    }

    auto const b = mpx_test::download(exec, layer.template bias<Space>());
    auto const q = dequantised_operands(xs, w, dys, s);
    auto const &qx = q.x, &qw = q.w, &qdy = q.dy;
    auto const got_y = mpx_test::download(exec, y), got_dx = mpx_test::download(exec, dx);
    auto const got_dw = mpx_test::download(exec, layer.template kernel_gradient<Space>());
    auto* const sum_bound = &mpx_test::fp8_sum_bound<Exec>;
    fp8_bound fy{"dense y", sum_bound}, fdx{"dense dx", sum_bound}, fdw{"dense dW", sum_bound};
    auto const at = [](std::int64_t i, std::int64_t j, std::int64_t cols) { return static_cast<std::size_t>(i * cols + j); };
    // y = x W: the product rounded to bfloat16, then the bias added in float and rounded.
    for_each_product(rows, units, in, [&](auto i, auto k) { return qx[at(i, k, in)]; },
                     [&](auto k, auto j) { return qw[at(k, j, units)]; }, [&](auto i, auto j, double ref, double sum) {
                       double const product = mpx::detail::to_double(mpx::cast<fp8_storage>(static_cast<float>(ref)));
                       fy.check(mpx::detail::to_double(got_y[at(i, j, units)]),
                                product + mpx::detail::to_double(b[static_cast<std::size_t>(j)]), sum + std::fabs(product),
                                in);
                     });
    // dx = dy Wᵀ and dW = xᵀ dy.
    for_each_product(rows, in, units, [&](auto i, auto j) { return qdy[at(i, j, units)]; },
                     [&](auto j, auto k) { return qw[at(k, j, units)]; }, [&](auto i, auto k, double ref, double sum) {
                       fdx.check(mpx::detail::to_double(got_dx[at(i, k, in)]), ref, sum, units);
                     });
    for_each_product(in, units, rows, [&](auto k, auto i) { return qx[at(i, k, in)]; },
                     [&](auto i, auto j) { return qdy[at(i, j, units)]; }, [&](auto k, auto j, double ref, double sum) {
                       fdw.check(mpx::detail::to_double(got_dw[at(k, j, units)]), ref, sum, rows);
                     });
    fy.require();
    fdx.require();
    fdw.require();
  }
}

// ---- conv2d ('valid', stride 1) ----

template <class Exec>
void check_fp8_conv(Exec const& exec, std::int64_t n, std::int64_t h, std::int64_t wd, std::int64_t cin,
                    std::int64_t cout) {
  using Space = mpx::memory_space_t<Exec>;
  constexpr std::int64_t kh = 3, kw = 3;
  std::int64_t const oh = h - kh + 1, ow = wd - kw + 1;
  INFO("conv2d n=" << n << " h=" << h << " w=" << wd << " cin=" << cin << " cout=" << cout);
  mpx::conv2d<mpx::mixed_fp8> layer(mpx::conv2d_config{.filters = cout});
  layer.set_name("conv");
  layer.build(exec, mpx::shape{h, wd, cin}, mpx_test::seed + 1);
  layer.reserve(exec, n);
  for (int step = 0; step < 2; ++step) {
    std::uint64_t const stream = 60 + 10 * static_cast<std::uint64_t>(step);
    auto const xs = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(n * h * wd * cin), -2, 2, stream);
    auto const dys =
        mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(n * oh * ow * cout), -1e-2, 1e-2, stream + 1);
    auto const x = mpx_test::upload(exec, xs, mpx::shape{n, h, wd, cin});
    auto const dy = mpx_test::upload(exec, dys, mpx::shape{n, oh, ow, cout});
    auto y = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{n, oh, ow, cout});
    auto dx = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{n, h, wd, cin});
    fp8_scales const s = scales_of(layer, exec);
    layer.forward(exec, mpx::view(std::as_const(x)), mpx::view(y), true);
    layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)), mpx::view(std::as_const(dy)),
                   mpx::view(dx));
    if (step == 0) continue;
    CHECK(s.activation != 1.0f);
    CHECK(s.gradient != 1.0f);
    auto const w = mpx_test::download(exec, layer.template kernel<Space>());
    auto const b = mpx_test::download(exec, layer.template bias<Space>());
    auto const q = dequantised_operands(xs, w, dys, s);
    auto const &qx = q.x, &qw = q.w, &qdy = q.dy;
    auto const got_y = mpx_test::download(exec, y), got_dx = mpx_test::download(exec, dx);
    auto const got_dw = mpx_test::download(exec, layer.template kernel_gradient<Space>());
    std::int64_t const patch = kh * kw * cin, pixels = n * oh * ow;
    auto* const sum_bound = &mpx_test::fp8_sum_bound<Exec>;
    fp8_bound fy{"conv y", sum_bound}, fdx{"conv dx", sum_bound}, fdw{"conv dW", sum_bound};
    auto const ref = mpx_test::reference::conv2d({n, h, wd, cin, kh, kw, cout}, qx, qw, qdy);
    for (std::size_t i = 0; i < ref.y.size(); ++i) {
      double const product = mpx::detail::to_double(mpx::cast<fp8_storage>(static_cast<float>(ref.y[i])));
      double const bias = mpx::detail::to_double(b[i % static_cast<std::size_t>(cout)]);
      fy.check(mpx::detail::to_double(got_y[i]), product + bias, ref.y_abs[i] + std::fabs(product), patch);
    }
    // dx: the column gradients are rounded to bfloat16 before col2im sums them (one more
    // 2^-8 per term): allowed as a bfloat16 rounding of the sum of |terms|.
    for (std::size_t i = 0; i < ref.dx.size(); ++i)
      fdx.check(mpx::detail::to_double(got_dx[i]), ref.dx[i], ref.dx_abs[i], mpx::fp8_gemm_padded_extent(cout) + kh * kw,
                std::ldexp(1.0, -8));
    for (std::size_t i = 0; i < ref.dw.size(); ++i)
      fdw.check(mpx::detail::to_double(got_dw[i]), ref.dw[i], ref.dw_abs[i], pixels);
    fy.require();
    fdx.require();
    fdw.require();
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("dense under mixed_fp8 matches the float64 fp8 recipe, forward and backward",
                        "[layers][fp8]", mpx_test::executors) {
  TestType const exec;
  check_fp8_dense<mpx::mixed_fp8>(exec, 32, 48, 32);
  // Ragged batches (a short last batch; 64 rows over 3 data-parallel ranks): the weight
  // gradient's K is the rows, padded with zeros to the GPU's multiple of 16.
  check_fp8_dense<mpx::mixed_fp8>(exec, 13, 48, 32);
  check_fp8_dense<mpx::mixed_fp8>(exec, 22, 32, 16);
  check_fp8_dense<mpx::mixed_fp8>(exec, 1, 16, 16);
}

TEMPLATE_LIST_TEST_CASE("dense under mixed_fp8_current scales each tensor by its own amax and matches the float64 "
                        "recipe, forward and backward",
                        "[layers][fp8]", mpx_test::executors) {
  TestType const exec;
  check_fp8_dense<mpx::mixed_fp8_current>(exec, 32, 48, 32);
  check_fp8_dense<mpx::mixed_fp8_current>(exec, 13, 48, 32);
  check_fp8_dense<mpx::mixed_fp8_current>(exec, 1, 16, 16);
}

TEMPLATE_LIST_TEST_CASE("conv2d under mixed_fp8 matches the float64 fp8 recipe, forward and backward",
                        "[layers][fp8]", mpx_test::executors) {
  TestType const exec;
  check_fp8_conv(exec, 2, 6, 6, 16, 16);
  check_fp8_conv(exec, 1, 5, 7, 16, 32);  // 15 output pixels: the weight gradient's K, padded
}

// What the GPU's fp8 kernels refuse, every executor refuses, with mpx's message naming
// the layer, before anything runs: N (the product's output columns: a layer's units or
// filters, when it is built, or its input width, before an input gradient) not a
// multiple of 16. K needs nothing (it is padded).
TEMPLATE_LIST_TEST_CASE("fp8 layers refuse on every executor the shapes the GPU's fp8 products cannot take",
                        "[layers][fp8]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  using Space = mpx::memory_space_t<TestType>;
  TestType const exec;
  std::int64_t const rows = 13;
  auto const x24 = mpx_test::upload(exec, mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * 24), -1, 1, 3), {rows, 24});
  for (std::string_view const policy : {"mixed_fp8", "mixed_mxfp8"}) {  // 24 units: N = 24 in the forward product
    INFO(policy);
    auto const build = [&](auto layer) {
      layer.set_name("hidden");
      layer.build(exec, mpx::shape{24}, 1);
    };
    std::string message = "built";
    try {
      if (policy == "mixed_fp8") build(mpx::dense<mpx::mixed_fp8>(24));
      else build(mpx::dense<mpx::mixed_mxfp8>(24));
    } catch (mpx::invalid_argument const& e) {
      message = e.what();
    }
    CHECK_THAT(message, Contains("mpx::hidden: under " + std::string(policy) + " N must be a multiple of 16") &&
                            Contains("N is this layer's unit count, got N = 24") && Contains("without_fp8"));
  }
  {  // 24 inputs, 16 units: the forward (K = 24, padded) and dW run; dx has N = 24.
    mpx::dense<mpx::mixed_fp8> layer(16);
    layer.build(exec, mpx::shape{24}, 1);
    auto y = mpx_test::poisoned<fp8_storage>(exec, {rows, 16});
    auto const dy = mpx_test::upload(exec, mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * 16), -1, 1, 4), {rows, 16});
    auto dx = mpx_test::poisoned<fp8_storage>(exec, {rows, 24});
    layer.forward(exec, mpx::view(std::as_const(x24)), mpx::view(y), true);
    CHECK_NOTHROW(layer.backward(exec, mpx::view(std::as_const(x24)), mpx::view(std::as_const(y)),
                                 mpx::view(std::as_const(dy)), mpx::tensor_view<fp8_storage, Space>{}));
    // Refused before anything runs: the gradient step's amax is the one dW recorded above.
    auto const& gradient_scale = layer.products().template scale<operand_role::gradient>(exec);
    auto const amax_before = gradient_scale.values(exec).step_amax_bits;
    CHECK_THROWS_TYPE_WITH(layer.backward(exec, mpx::view(std::as_const(x24)), mpx::view(std::as_const(y)),
                                          mpx::view(std::as_const(dy)), mpx::view(dx)),
                           mpx::invalid_argument, Contains("N is this layer's input width, in its input gradient's "
                                                           "product, got N = 24"));
    CHECK(gradient_scale.values(exec).step_amax_bits == amax_before);
  }
  {  // attention 24 wide: its projections' 72 and 24 units
    mpx::causal_self_attention<mpx::mixed_fp8> mixer(2);
    mixer.set_name("mixer");
    CHECK_THROWS_TYPE_WITH(mixer.build(exec, mpx::shape{4, 24}, 1), mpx::invalid_argument,
                           Contains("mpx::mixer: under mixed_fp8 N must be a multiple of 16") &&
                               Contains("N is this layer's width (its projections have 3 x width and width units), "
                                        "got N = 24"));
  }
  {  // 5 filters: refused when built
    mpx::conv2d<mpx::mixed_fp8> layer(mpx::conv2d_config{.filters = 5});
    CHECK_THROWS_TYPE_WITH(layer.build(exec, mpx::shape{5, 5, 16}, 1), mpx::invalid_argument,
                           Contains("mpx::conv2d: under mixed_fp8") && Contains("filter count, got N = 5"));
  }
  {  // 16 filters over 3x3 taps of 3 channels: dx's N is 27
    mpx::conv2d<mpx::mixed_fp8> layer(mpx::conv2d_config{.filters = 16});
    layer.build(exec, mpx::shape{5, 5, 3}, 1);
    auto const x = mpx_test::upload(exec, mpx_test::random_values<fp8_storage>(5 * 5 * 3, -1, 1, 5), {1, 5, 5, 3});
    auto y = mpx_test::poisoned<fp8_storage>(exec, {1, 3, 3, 16});
    auto dx = mpx_test::poisoned<fp8_storage>(exec, {1, 5, 5, 3});
    layer.forward(exec, mpx::view(std::as_const(x)), mpx::view(y), true);
    CHECK_NOTHROW(layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)),
                                 mpx::view(std::as_const(y)), mpx::tensor_view<fp8_storage, Space>{}));
    CHECK_THROWS_TYPE_WITH(layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)),
                                          mpx::view(std::as_const(y)), mpx::view(dx)),
                           mpx::invalid_argument, Contains("kernel taps x input channels, in its input gradient's "
                                                           "product, got N = 27"));
  }
}

#if !MPX_HAS_CUDA
#include <mpx/model/sequential.hpp>
#include <mpx/model/train_step.hpp>
#include <mpx/model/training_state.hpp>

#include <boost/hana/type.hpp>

#include <filesystem>
#include <unistd.h>

namespace {

// A small classifier under an fp8 policy P: fp8 hidden layers, the last layer kept out
// of fp8. With Attention, the 4 tokens of 8 features go through a dense layer and a
// causal self-attention (its projections in fp8) first; with_fp8_core: its core too.
enum attention_kind { without_attention, with_attention, with_fp8_core };
template <class P = mpx::mixed_fp8, int Attention = without_attention>
auto make_fp8_classifier() {
  if constexpr (Attention != without_attention)
    return mpx::sequential<P>(mpx::dense<>(32, mpx::activation::relu),
                              mpx::causal_self_attention<>({.heads = 2, .fp8_attention = Attention == with_fp8_core}),
                              mpx::flatten<>(), mpx::dense<mpx::without_fp8<P>>(3), mpx::softmax_layer<mpx::float32>());
  else
    return mpx::sequential<P>(mpx::flatten<>(), mpx::dense<>(32, mpx::activation::relu),
                              mpx::dense<>(16, mpx::activation::relu), mpx::dense<mpx::without_fp8<P>>(3),
                              mpx::softmax_layer<mpx::float32>());
}

template <class P = mpx::mixed_fp8, int Attention = without_attention>
struct fp8_run {
  mpx::host_executor exec;
  decltype(make_fp8_classifier<P, Attention>()) model = make_fp8_classifier<P, Attention>();
  std::vector<mpx::tensor<fp8_storage>> images;
  std::vector<mpx::tensor<std::int32_t>> labels;

  explicit fp8_run(std::uint64_t init_seed) {
    model.build(exec, {4, 8}, init_seed);
    for (std::uint64_t b = 0; b < 8; ++b) {
      auto const x = mpx_test::random_values<fp8_storage>(16 * 32, -4, 4, 500 + b);
      images.push_back(mpx_test::upload(exec, x, mpx::shape{16, 4, 8}));
      std::vector<std::int32_t> l(16);
      for (std::size_t i = 0; i < l.size(); ++i) l[i] = static_cast<std::int32_t>((i + b) % 3);
      labels.push_back(mpx_test::upload(exec, l, mpx::shape{16}));
    }
  }
  template <class Optimizer>
  std::vector<float> train(Optimizer& optimizer, std::size_t from, std::size_t count) {
    mpx::classifier_trainer trainer(exec, model, optimizer);
    for (std::size_t s = from; s < from + count; ++s)
      trainer.step(exec, mpx::view(std::as_const(images[s % images.size()])),
                   mpx::view(std::as_const(labels[s % labels.size()])));
    std::vector<float> losses;
    for (auto const& r : trainer.history(exec)) losses.push_back(r.loss);
    return losses;
  }
};

auto make_fp8_optimizer(mpx::host_executor const& exec, auto& model) {
  return mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f), mpx::static_loss_scaler(exec, 1.0f));
}

}  // namespace

TEST_CASE("a mixed_fp8 run resumed from its training state continues bit for bit, scales included",
          "[layers][fp8][resume]") {
  auto const dir = std::filesystem::temp_directory_path() / ("mpx_test_fp8_resume_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<float> whole_tail;
  {
    fp8_run run(1);
    auto optimizer = make_fp8_optimizer(run.exec, run.model);
    run.train(optimizer, 0, 5);
    mpx::save_training_state(run.exec, run.model, optimizer, dir, {.steps = 5});
    whole_tail = run.train(optimizer, 5, 5);
    // The two fp8 layers' scales moved off 1 and are in the save.
    auto const& hidden = run.model.template layer<1>();
    CHECK(hidden.products().template scale<operand_role::activation>(run.exec).values(run.exec).scale != 1.0f);
  }
  fp8_run resumed(2);  // another initialisation: everything must come from the save
  auto optimizer = make_fp8_optimizer(resumed.exec, resumed.model);
  CHECK(mpx::load_training_state(resumed.exec, resumed.model, optimizer, dir).steps == 5);
  auto const tail = resumed.train(optimizer, 5, 5);
  REQUIRE(tail.size() == whole_tail.size());
  for (std::size_t i = 0; i < tail.size(); ++i) {
    INFO("step " << 5 + i);
    CHECK(mpx::detail::bit_cast<std::uint32_t>(tail[i]) == mpx::detail::bit_cast<std::uint32_t>(whole_tail[i]));
  }

  // A model whose fp8 layers differ (one fewer) is refused, and keeps its scales.
  auto other = mpx::sequential<mpx::mixed_fp8>(mpx::flatten<>(), mpx::dense<>(32, mpx::activation::relu),
                                               mpx::dense<mpx::without_fp8<mpx::mixed_fp8>>(16, mpx::activation::relu),
                                               mpx::dense<mpx::without_fp8<mpx::mixed_fp8>>(3),
                                               mpx::softmax_layer<mpx::float32>());
  mpx::host_executor exec;
  other.build(exec, {4, 8}, 3);
  auto other_optimizer = make_fp8_optimizer(exec, other);
  CHECK_THROWS_TYPE_WITH(mpx::load_training_state(exec, other, other_optimizer, dir), mpx::checkpoint_error,
                         Catch::Matchers::Contains("fp8 scales"));
  CHECK(other.template layer<1>().products().template scale<operand_role::activation>(exec).values(exec).scale ==
        1.0f);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a mixed_fp8_current, mixed_fp8_block, mixed_fp8_rowwise, mixed_mxfp8 or mixed_nvfp4 run resumed from its "
          "training state continues bit for bit",
          "[layers][fp8][fp8_block][resume]") {
  auto const check_resume = []<int Attention = without_attention>(auto policy,
                                                                   std::integral_constant<int, Attention> = {}) {
    using P = typename decltype(policy)::type;
    INFO(P::name << (Attention == with_fp8_core ? " with fp8 attention" : Attention ? " with attention" : ""));
    auto const dir = std::filesystem::temp_directory_path() /
                     ("mpx_test_fp8_block_resume_" + std::string(P::name) + "_" + std::to_string(Attention) + "_" +
                      std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::vector<float> whole_tail;
    {
      fp8_run<P, Attention> run(1);
      auto optimizer = make_fp8_optimizer(run.exec, run.model);
      run.train(optimizer, 0, 5);
      mpx::save_training_state(run.exec, run.model, optimizer, dir, {.steps = 5});
      whole_tail = run.train(optimizer, 5, 5);
      if constexpr (Attention != without_attention) {  // the attention's projections keep fp8 state, and it is saved
        std::size_t projections = 0, cores = 0;
        for (auto const& e : mpx::detail::model_fp8_scales<mpx::host_executor>(run.model)) {
          projections += e.name.find("query_key_value") != std::string::npos || e.name.find("/output") != std::string::npos;
          cores += e.name.find("/attention_core") != std::string::npos;
        }
        constexpr bool per_tensor = std::is_same_v<P, mpx::mixed_fp8> || std::is_same_v<P, mpx::mixed_fp8_current>;
        CHECK(projections == (per_tensor ? 2u : 0u));  // block recipes keep no scales between steps
        CHECK(cores == (Attention == with_fp8_core ? 1u : 0u));
        if constexpr (Attention == with_fp8_core) {  // the core's six scales moved off 1 (delayed: from their amaxes)
          auto const& attention = run.model.template layer<1>();
          auto const s = attention.template attention_core_scales<mpx::host_executor>();
          std::array<mpx::fp8_scale_values const*, 6> const all{s.qkv, s.s, s.o, s.d_o, s.dp, s.dqkv};
          for (auto const* v : all) CHECK(v->scale != 1.0f);
        }
      }
    }
    fp8_run<P, Attention> resumed(2);  // another initialisation: everything must come from the save
    auto optimizer = make_fp8_optimizer(resumed.exec, resumed.model);
    CHECK(mpx::load_training_state(resumed.exec, resumed.model, optimizer, dir).steps == 5);
    auto const tail = resumed.train(optimizer, 5, 5);
    REQUIRE(tail.size() == whole_tail.size());
    for (std::size_t i = 0; i < tail.size(); ++i) {
      INFO("step " << 5 + i);
      CHECK(std::isfinite(tail[i]));
      CHECK(mpx::detail::bit_cast<std::uint32_t>(tail[i]) == mpx::detail::bit_cast<std::uint32_t>(whole_tail[i]));
    }
    std::filesystem::remove_all(dir);
  };
  check_resume(boost::hana::type_c<mpx::mixed_fp8_current>);
  check_resume(boost::hana::type_c<mpx::mixed_fp8_block>);
  check_resume(boost::hana::type_c<mpx::mixed_fp8_rowwise>);
  check_resume(boost::hana::type_c<mpx::mixed_mxfp8>);
  check_resume(boost::hana::type_c<mpx::mixed_nvfp4>);  // its stochastic rounding's draw count included
  // The same with a causal self-attention whose projections run in the recipe.
  using attention = std::integral_constant<int, with_attention>;
  check_resume(boost::hana::type_c<mpx::mixed_fp8>, attention{});
  check_resume(boost::hana::type_c<mpx::mixed_fp8_current>, attention{});
  check_resume(boost::hana::type_c<mpx::mixed_fp8_block>, attention{});
  check_resume(boost::hana::type_c<mpx::mixed_mxfp8>, attention{});
  check_resume(boost::hana::type_c<mpx::mixed_nvfp4>, attention{});
  // And with the attention's core in fp8: its six scales saved and restored too.
  check_resume(boost::hana::type_c<mpx::mixed_fp8>, std::integral_constant<int, with_fp8_core>{});
  check_resume(boost::hana::type_c<mpx::mixed_fp8_current>, std::integral_constant<int, with_fp8_core>{});
}
#endif

// ---- dense under the block recipes (mixed_fp8_block, mixed_fp8_rowwise, mixed_mxfp8) ----

namespace fp8_block_layer_cases {

//! The operand [outer, k] of x [rows, cols] (x itself when k_contiguous, else its
//! transpose) quantized as Policy's recipe says for role R, dequantised in float64.
template <class Policy>
std::vector<double> block_operand(std::vector<fp8_storage> const& x, std::int64_t rows, std::int64_t cols,
                                  bool k_contiguous, mpx::operand_role role) {
  using recipe = std::remove_cvref_t<decltype(mpx::fp8_recipe_for<Policy>)>;
  mpx::fp8_block_kind const kind = std::is_same_v<recipe, mpx::rowwise_scaling> ? mpx::fp8_block_kind::row
                                   : std::is_same_v<recipe, mpx::mxfp8_scaling>  ? mpx::fp8_block_kind::vec32
                                   : role == mpx::operand_role::weight         ? mpx::fp8_block_kind::tile128
                                                                               : mpx::fp8_block_kind::vec128;
  std::vector<float> f(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) f[i] = mpx::cast<float>(x[i]);
  auto const q = mpx_test::reference::reference_quantize(f, rows, cols, k_contiguous, kind,
                                                         mpx::fp8_recipe_for<Policy>.power_of_two_scales);
  mpx::fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
  return mpx_test::reference::dequantised_blocks(q, layout);
}

//! Element (o, kk) of a dequantised operand [outer, padded k].
struct operand_at {
  std::vector<double> const* v;
  std::int64_t pitch;
  double operator()(std::int64_t o, std::int64_t kk) const { return (*v)[static_cast<std::size_t>(o * pitch + kk)]; }
};

template <class Policy, class Exec>
void check_block_dense(Exec const& exec, std::int64_t rows, std::int64_t in, std::int64_t units) {
  using Space = mpx::memory_space_t<Exec>;
  INFO(Policy::name << " dense rows=" << rows << " in=" << in << " units=" << units);
  mpx::dense<Policy> layer(units);
  layer.set_name("dense");
  layer.build(exec, mpx::shape{in}, mpx_test::seed);
  layer.reserve(exec, rows);
  {  // Weights whose magnitude varies within a 128x128 tile (by row and by column), so
     // 1x128 and 128x128 blocks, rows and columns all give different scales.
    auto w0 = mpx_test::download(exec, layer.template kernel<Space>());
    for (std::int64_t k = 0; k < in; ++k)
      for (std::int64_t j = 0; j < units; ++j) {
        auto& v = w0[static_cast<std::size_t>(k * units + j)];
        // Column 1 is 2^-14 of the rest: in a 128x128 tile its values fall among e4m3's
        // subnormals, in its own 1x128 blocks they do not (so the two kinds differ even
        // with power-of-two scales, which otherwise round alike).
        int const shift = static_cast<int>((k / 3) % 5 + j % 3) - 3 - (j == 1 ? 14 : 0);
        v = mpx::cast<fp8_storage>(std::ldexp(mpx::cast<float>(v), shift));
      }
    auto const wd = mpx_test::upload(exec, w0, mpx::shape{in, units});
    mpx::copy(exec, wd, layer.template kernel<Space>());
  }
  // Gradients far below the activations, and one row of x 2^12 larger than the rest:
  // per-tensor scaling would lose the small rows, blocks keep them.
  auto xs = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * in), -3, 3, 90);
  for (std::int64_t k = 0; k < in; ++k) xs[static_cast<std::size_t>(k)] = mpx::cast<fp8_storage>(mpx::cast<float>(xs[static_cast<std::size_t>(k)]) * 4096.0f);
  auto const dys = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * units), -1e-3, 1e-3, 91);
  auto const x = mpx_test::upload(exec, xs, mpx::shape{rows, in});
  auto const dy = mpx_test::upload(exec, dys, mpx::shape{rows, units});
  auto y = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{rows, units});
  auto dx = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{rows, in});
  layer.forward(exec, mpx::view(std::as_const(x)), mpx::view(y), true);
  layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)), mpx::view(std::as_const(dy)),
                 mpx::view(dx));
  auto const w = mpx_test::download(exec, layer.template kernel<Space>());
  auto const b = mpx_test::download(exec, layer.template bias<Space>());
  auto const got_y = mpx_test::download(exec, y), got_dx = mpx_test::download(exec, dx);
  auto const got_dw = mpx_test::download(exec, layer.template kernel_gradient<Space>());
  using mpx::operand_role;
  // y = x W: A = x [rows, in], B = W read as [units, in].
  auto const ya = block_operand<Policy>(xs, rows, in, true, operand_role::activation);
  auto const yb = block_operand<Policy>(w, in, units, false, operand_role::weight);
  // dx = dy Wᵀ: A = dy [rows, units], B = W [in, units].
  auto const xa = block_operand<Policy>(dys, rows, units, true, operand_role::gradient);
  auto const xb = block_operand<Policy>(w, in, units, true, operand_role::weight);
  // dW = xᵀ dy: A = x read as [in, rows], B = dy read as [units, rows].
  auto const wa = block_operand<Policy>(xs, rows, in, false, operand_role::activation);
  auto const wb = block_operand<Policy>(dys, rows, units, false, operand_role::gradient);
  using recipe = std::remove_cvref_t<decltype(mpx::fp8_recipe_for<Policy>)>;
  std::int64_t const block = std::is_same_v<recipe, mpx::mxfp8_scaling> ? 32 : 128;
  auto const padded = [&](std::int64_t k) {
    return std::is_same_v<recipe, mpx::rowwise_scaling> ? mpx::fp8_gemm_padded_extent(k) : (k + block - 1) / block * block;
  };
  auto* const sum_bound = &mpx_test::fp8_sum_bound<Exec>;
  fp8_bound fy{"dense y", sum_bound}, fdx{"dense dx", sum_bound}, fdw{"dense dW", sum_bound};
  auto const at = [](std::int64_t i, std::int64_t j, std::int64_t cols) { return static_cast<std::size_t>(i * cols + j); };
  // Scales that are not powers of two (rowwise's default) make each dequantised value a
  // float rounding of q / scale: 2^-24 per operand, 2^-23 per term.
  double const dequant = mpx::fp8_recipe_for<Policy>.power_of_two_scales ? 0.0 : std::ldexp(1.0, -23);
  auto const product = [&](std::vector<double> const& a, std::vector<double> const& bv, std::int64_t k, auto check,
                           std::int64_t m, std::int64_t n) {
    operand_at const A{&a, padded(k)}, B{&bv, padded(k)};
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double exact = 0, magnitude = 0;
        for (std::int64_t kk = 0; kk < padded(k); ++kk) {
          exact += A(i, kk) * B(j, kk);
          magnitude += std::fabs(A(i, kk) * B(j, kk));
        }
        check(i, j, exact, magnitude, padded(k));
      }
  };
  // y: the float product rounded to bfloat16 (2^-8 of its size: of the sum of |terms|),
  // then the bias added and rounded again (fp8_bound's 2^-8 |ref|).
  product(ya, yb, in, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
    fy.check(mpx::detail::to_double(got_y[at(i, j, units)]), ref + mpx::detail::to_double(b[static_cast<std::size_t>(j)]),
             sum, k, dequant + std::ldexp(1.0, -8));
  }, rows, units);
  product(xa, xb, units, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
    fdx.check(mpx::detail::to_double(got_dx[at(i, j, in)]), ref, sum, k, dequant);
  }, rows, in);
  product(wa, wb, rows, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
    fdw.check(mpx::detail::to_double(got_dw[at(i, j, units)]), ref, sum, k, dequant);
  }, in, units);
  fy.require();
  fdx.require();
  fdw.require();
}

}  // namespace fp8_block_layer_cases

TEMPLATE_LIST_TEST_CASE("dense under mixed_fp8_block, mixed_fp8_rowwise and mixed_mxfp8 matches the float64 block "
                        "recipe, forward and backward",
                        "[fp8][fp8_block][layers]", mpx_test::executors) {
  using namespace fp8_block_layer_cases;
  TestType exec;
  bool const hopper_blocks = mpx_test::block_fp8_products_here(exec), mx_blocks = mpx_test::block_fp8_products_here(exec, true);
  if (!hopper_blocks) WARN("mixed_fp8_block and mixed_fp8_rowwise need sm_90 (Hopper): skipped");
  if (!mx_blocks) WARN("mixed_mxfp8 needs Blackwell (sm_100) or newer: skipped");
  for (auto [rows, in, units] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{13, 48, 16}, {130, 208, 32},
                                 {5, 144, 144}, {33, 80, 16}}) {
    if (hopper_blocks) {
      check_block_dense<mpx::mixed_fp8_block>(exec, rows, in, units);
      check_block_dense<mpx::mixed_fp8_rowwise>(exec, rows, in, units);
    }
    if (mx_blocks) check_block_dense<mpx::mixed_mxfp8>(exec, rows, in, units);
  }
  // The block presets keep no scale state: nothing to save, nothing to restore.
  mpx::dense<mpx::mixed_fp8_block> layer(16);
  std::vector<mpx::fp8_scales_entry<TestType>> entries;
  layer.products().template append_to<TestType>(entries, "dense");
  CHECK(entries.empty());
  CHECK(mpx::mixed_fp8_block::name == "mixed_fp8_block");
  CHECK(std::is_same_v<mpx::without_fp8<mpx::mixed_fp8_block>, mpx::mixed_bfloat16>);
}

// ---- dense under NVFP4 (mixed_nvfp4, and its recipe without stochastic rounding) ----

//! mixed_nvfp4's dtypes with NVFP4 rounded to nearest everywhere: the layer's products
//! are then exactly the reference's.
struct nvfp4_nearest : mpx::policy<mpx::bfloat16, mpx::float8_e4m3, float, float> {
  static constexpr std::string_view name = "nvfp4_nearest";
};
namespace mpx {
template <>
inline constexpr auto fp8_recipe_for<nvfp4_nearest> = nvfp4_scaling{.stochastic_gradients = false};
}  // namespace mpx

namespace nvfp4_layer_cases {

//! The operand [outer, k] of x [rows, cols] quantized to NVFP4 as the recipe says for
//! its role (16x16 blocks for weights, the transform for a weight gradient's inputs),
//! dequantised in float64.
std::vector<double> nvfp4_operand(std::vector<fp8_storage> const& x, std::int64_t rows, std::int64_t cols,
                                  bool k_contiguous, bool square, bool hadamard) {
  std::vector<float> f(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) f[i] = mpx::cast<float>(x[i]);
  auto const q = mpx_test::reference::reference_nvfp4(
      f, rows, cols, k_contiguous, square, hadamard,
      mpx::detail::nvfp4_hadamard_signs(mpx::nvfp4_quantize_options{}.hadamard_seed));
  mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec16, k_contiguous ? rows : cols,
                                           k_contiguous ? cols : rows};
  return mpx_test::reference::dequantised_nvfp4(q.codes, q.scales, q.decode, layout);
}

//! dense under Policy (an NVFP4 recipe) against the reference: y always exactly as
//! rounded to nearest; dx and dW too without stochastic rounding, and with it within
//! the rounding's spread of the unquantized product (and not the nearest rounding's).
template <class Policy, class Exec>
void check_nvfp4_dense(Exec const& exec, std::int64_t rows, std::int64_t in, std::int64_t units) {
  using Space = mpx::memory_space_t<Exec>;
  constexpr auto recipe = mpx::fp8_recipe_for<Policy>;
  INFO(Policy::name << " dense rows=" << rows << " in=" << in << " units=" << units);
  mpx::dense<Policy> layer(units);
  layer.set_name("dense");
  layer.build(exec, mpx::shape{in}, mpx_test::seed);
  layer.reserve(exec, rows);
  auto xs = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * in), -3, 3, 92);
  for (std::int64_t k = 0; k < in; ++k)  // one row 2^12 larger: per-tensor scaling would lose the rest
    xs[static_cast<std::size_t>(k)] = mpx::cast<fp8_storage>(mpx::cast<float>(xs[static_cast<std::size_t>(k)]) * 4096.0f);
  auto const dys = mpx_test::random_values<fp8_storage>(static_cast<std::size_t>(rows * units), -1e-3, 1e-3, 93);
  auto const x = mpx_test::upload(exec, xs, mpx::shape{rows, in});
  auto const dy = mpx_test::upload(exec, dys, mpx::shape{rows, units});
  auto y = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{rows, units});
  auto dx = mpx_test::poisoned<fp8_storage>(exec, mpx::shape{rows, in});
  layer.forward(exec, mpx::view(std::as_const(x)), mpx::view(y), true);
  layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)), mpx::view(std::as_const(dy)),
                 mpx::view(dx));
  auto const w = mpx_test::download(exec, layer.template kernel<Space>());
  auto const b = mpx_test::download(exec, layer.template bias<Space>());
  auto const got_y = mpx_test::download(exec, y), got_dx = mpx_test::download(exec, dx);
  auto const got_dw = mpx_test::download(exec, layer.template kernel_gradient<Space>());
  bool const sq = recipe.square_weight_blocks, rht = recipe.hadamard_weight_gradients;
  auto const ya = nvfp4_operand(xs, rows, in, true, false, false), yb = nvfp4_operand(w, in, units, false, sq, false);
  auto const xa = nvfp4_operand(dys, rows, units, true, false, false), xb = nvfp4_operand(w, in, units, true, sq, false);
  auto const wa = nvfp4_operand(xs, rows, in, false, false, rht), wb = nvfp4_operand(dys, rows, units, false, false, rht);
  auto const padded = [](std::int64_t k) { return (k + 31) / 32 * 32; };
  auto* const sum_bound = &mpx_test::fp8_sum_bound<Exec>;
  fp8_bound fy{"dense y", sum_bound}, fdx{"dense dx", sum_bound}, fdw{"dense dW", sum_bound};
  // alpha carries the two decode factors, rounded to float: 2^-23 of each term.
  double const dequant = std::ldexp(1.0, -23);
  auto const product = [&](std::vector<double> const& a, std::vector<double> const& bv, std::int64_t k, auto check,
                           std::int64_t m, std::int64_t n) {
    std::int64_t const kp = padded(k);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double exact = 0, magnitude = 0;
        for (std::int64_t kk = 0; kk < kp; ++kk) {
          double const t = a[static_cast<std::size_t>(i * kp + kk)] * bv[static_cast<std::size_t>(j * kp + kk)];
          exact += t;
          magnitude += std::fabs(t);
        }
        check(i, j, exact, magnitude, kp);
      }
  };
  auto const at = [](std::int64_t i, std::int64_t j, std::int64_t cols) { return static_cast<std::size_t>(i * cols + j); };
  product(ya, yb, in, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
    fy.check(mpx::detail::to_double(got_y[at(i, j, units)]), ref + mpx::detail::to_double(b[static_cast<std::size_t>(j)]),
             sum, k, dequant + std::ldexp(1.0, -8));
  }, rows, units);
  fy.require();
  if constexpr (!recipe.stochastic_gradients) {
    product(xa, xb, units, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
      fdx.check(mpx::detail::to_double(got_dx[at(i, j, in)]), ref, sum, k, dequant);
    }, rows, in);
    product(wa, wb, rows, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
      fdw.check(mpx::detail::to_double(got_dw[at(i, j, units)]), ref, sum, k, dequant);
    }, in, units);
    fdx.require();
    fdw.require();
  } else {
    // Stochastic: the gradients are the unquantized products within what 4 bits allow,
    // and some differ from the nearest rounding's beyond the float-sum bound.
    double err = 0, norm = 0;
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < in; ++j) {
        double exact = 0;
        for (std::int64_t u = 0; u < units; ++u)
          exact += mpx::detail::to_double(dys[at(i, u, units)]) * mpx::detail::to_double(w[at(j, u, units)]);
        double const g = mpx::detail::to_double(got_dx[at(i, j, in)]);
        REQUIRE(std::isfinite(g));
        err += (g - exact) * (g - exact);
        norm += exact * exact;
      }
    CHECK(std::sqrt(err / norm) < 0.25);
    product(xa, xb, units, [&](auto i, auto j, double ref, double sum, std::int64_t k) {
      fdx.check(mpx::detail::to_double(got_dx[at(i, j, in)]), ref, sum, k, dequant);
    }, rows, in);
    CHECK(fdx.bad > 0);
  }
}

}  // namespace nvfp4_layer_cases

TEMPLATE_LIST_TEST_CASE("dense under NVFP4 matches the float64 recipe: 16x16 weights, the transformed weight "
                        "gradient, stochastically rounded gradients",
                        "[fp8][nvfp4][layers]", mpx_test::executors) {
  using namespace nvfp4_layer_cases;
  TestType exec;
  if (!mpx_test::block_fp8_products_here(exec, true)) {
    WARN("mixed_nvfp4 needs Blackwell (sm_100) or newer: skipped");
    return;
  }
  for (auto [rows, in, units] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{13, 48, 16}, {130, 208, 32},
                                 {5, 144, 144}, {33, 80, 16}}) {
    check_nvfp4_dense<nvfp4_nearest>(exec, rows, in, units);
    check_nvfp4_dense<mpx::mixed_nvfp4>(exec, rows, in, units);
  }
  // The draw count advances once per gradient cast (the input gradient's product and the
  // weight gradient's), and is training state with its seed.
  mpx::dense<mpx::mixed_nvfp4> layer(16);
  layer.set_name("d");
  layer.build(exec, mpx::shape{32}, 5);
  layer.reserve(exec, 4);
  auto const x = mpx_test::upload(exec, std::vector<fp8_storage>(4 * 32, mpx::cast<fp8_storage>(0.5f)), mpx::shape{4, 32});
  auto y = mpx::make_tensor<fp8_storage>(exec, mpx::shape{4, 16});
  auto dx = mpx::make_tensor<fp8_storage>(exec, mpx::shape{4, 32});
  layer.forward(exec, mpx::view(std::as_const(x)), mpx::view(y), true);
  layer.backward(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(y)), mpx::view(std::as_const(y)),
                 mpx::view(dx));
  using Space = mpx::memory_space_t<TestType>;
  std::vector<std::pair<std::string, mpx::tensor_view<std::uint64_t, Space>>> counters;
  layer.template append_counters<Space>(counters);
  REQUIRE(counters.size() == 1);
  CHECK(counters[0].first == "d/nvfp4_gradient_draws");
  CHECK(mpx_test::download(exec, counters[0].second)[0] == 2u);
  std::vector<std::pair<std::string, std::uint64_t*>> seeds;
  layer.append_seeds(seeds);
  REQUIRE(seeds.size() == 1);
  CHECK(seeds[0].first == "d/nvfp4_gradient_seed");
  // Other policies keep none.
  mpx::dense<mpx::mixed_mxfp8> other(16);
  std::vector<std::pair<std::string, mpx::tensor_view<std::uint64_t, Space>>> none;
  other.template append_counters<Space>(none);
  CHECK(none.empty());
}
