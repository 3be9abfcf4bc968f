// conv2d (forward, input gradient, weight gradient) and max_pool2d (forward, backward)
// for every dtype on each executor, on seeded random inputs of awkward shapes (N = 1,
// prime extents, 1x1 / 3x3 / 2x3 kernels, strides, padding, Keras 'same', dilation, a
// workspace smaller than the batch), outputs and workspace poisoned with NaN first.
//
// Convolution, against a float64 direct convolution of the same (storage-rounded)
// operands, whose gradients are checked by finite differences. Per element, with u_T
// the storage type's unit roundoff, u_acc the float sums' (2^-24 for float operands,
// 2^-23 for 16-bit ones, as docs/gemm.md), S the sum of |terms| of the exact sum:
//   y   |y - ref|  <= u_T |ref| + (K + 5) u_acc S_y,                    K = KH*KW*Cin
//   dx  |dx - ref| <= u_T |ref| + (u_T + (Cout + KH*KW + 6) u_acc)(1 + u_T) S_dx
//   dw  |dw - ref| <= u_D |ref| + ((c - 1) u_D + (R + 4 + c) u_acc) S_dw
// (+ a few of the type's smallest subnormals for underflow), where dw holds type D,
// R = images per chunk * OH*OW and c the number of chunks (1 for a whole-batch
// workspace). dx carries one more u_T than a product: the column gradients are rounded
// to storage before the float col2im sum.
//
// Max pooling is a selection: compared for exact (bitwise, NaN = NaN) equality with a
// reference written differently (the maximum first, then its first position; the first
// NaN if any); the gradient too, summed in float in window order where windows overlap.
#include "../support/nn_reference.hpp"
#include "../support/reference/conv2d.hpp"

#include <mpx/exec/launch.hpp>
#include <mpx/kernels/conv2d.hpp>
#include <mpx/kernels/max_pool.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using mpx_test::to_d;
using mpx_test::uf;
using mpx_test::poisoned;
using mpx_test::widen;


template <class T>
double u_acc() {
  return std::is_same_v<T, float> ? std::ldexp(1.0, -24) : std::ldexp(1.0, -23);
}



// ---- the cases, and the float64 reference convolution (tests/support/reference/conv2d.hpp) ----

struct conv_case {
  std::int64_t n, h, w, cin, kh, kw, cout;
  mpx::conv2d_options o{};
  bool same = false;           // Keras 'same' padding from conv2d_padding_same (strides, dilations from o)
  std::int64_t chunk = 0;      // images per workspace chunk; 0: the whole batch
  bool reuse = false;          // backward weights reuses the forward's columns
  bool combined = false;       // conv2d_backward instead of the two calls
};

std::string describe(conv_case const& c, mpx::conv2d_options const& o) {
  std::ostringstream os;
  os << "x [" << c.n << ", " << c.h << ", " << c.w << ", " << c.cin << "] w [" << c.kh << ", " << c.kw << ", "
     << c.cin << ", " << c.cout << "] stride (" << o.stride_h << ", " << o.stride_w << ") pad (" << o.pad_h << "+"
     << o.extra_pad_h << ", " << o.pad_w << "+" << o.extra_pad_w << ") dilation (" << o.dilation_h << ", "
     << o.dilation_w << ") chunk " << c.chunk << (c.reuse ? " reuse" : "") << (c.combined ? " combined" : "");
  return os.str();
}

mpx_test::reference::conv2d_geometry conv_geometry(conv_case const& c, mpx::conv2d_options const& o) {
  return {c.n, c.h, c.w, c.cin, c.kh, c.kw, c.cout, o};
}
mpx_test::reference::conv2d_extent output_dims(conv_case const& c, mpx::conv2d_options const& o) {
  return mpx_test::reference::conv2d_output_extent(conv_geometry(c, o));
}
mpx_test::reference::conv2d_result reference_conv(conv_case const& c, mpx::conv2d_options const& o,
                                                  std::vector<double> const& x, std::vector<double> const& w,
                                                  std::vector<double> const& dy) {
  return mpx_test::reference::conv2d(conv_geometry(c, o), x, w, dy);
}

// Runs the three passes of one case for storage T (dw in type D) and checks them.
template <class T, class D, class Exec>
void run_conv(Exec const& exec, conv_case const& c, std::uint64_t stream) {
  using P = mpx_test::preset_policy<T>;
  mpx::shape const xs{c.n, c.h, c.w, c.cin}, ws{c.kh, c.kw, c.cin, c.cout};
  mpx::conv2d_options const o = c.same ? mpx::conv2d_padding_same(xs, ws, c.o) : c.o;
  auto const [oh_n, ow_n] = output_dims(c, o);
  mpx::shape const ys{c.n, oh_n, ow_n, c.cout};
  INFO(mpx::dtype_name<T> << " dw " << mpx::dtype_name<D> << ": " << describe(c, o));
  REQUIRE(mpx::conv2d_output_shape(xs, ws, o) == ys);
  std::int64_t const patch = c.kh * c.kw * c.cin;
  REQUIRE(mpx::conv2d_workspace_shape(xs, ws, o) == mpx::shape{c.n * oh_n * ow_n, patch});
  std::int64_t const chunk = c.chunk ? c.chunk : c.n;
  std::int64_t const chunks = (c.n + chunk - 1) / chunk;

  auto const x = mpx_test::random_values<T>(xs.size(), -1, 1, stream);
  auto const w = mpx_test::random_values<T>(ws.size(), -1, 1, stream + 1);
  auto const dy = mpx_test::random_values<T>(ys.size(), -1, 1, stream + 2);
  auto const xd = mpx_test::upload(exec, x, xs);
  auto const wd = mpx_test::upload(exec, w, ws);
  auto const dyd = mpx_test::upload(exec, dy, ys);
  auto y = poisoned<T>(exec, ys);
  auto dx = poisoned<T>(exec, xs);
  auto dw = poisoned<D>(exec, ws);
  auto workspace = poisoned<T>(exec, mpx::shape{chunk * oh_n * ow_n, patch});

  mpx::conv2d_forward<P>(exec, xd, wd, y, workspace, o);
  auto const columns = c.reuse ? mpx::conv2d_columns::reuse_forward : mpx::conv2d_columns::recompute;
  if (c.combined) {
    mpx::conv2d_backward<P>(exec, xd, wd, dyd, dx, dw, workspace, o, columns);
  } else {
    if (!c.reuse) mpx::fill(exec, workspace, mpx_test::poison<T>());  // recompute must not need the forward's
    mpx::conv2d_backward_weights<P>(exec, xd, dyd, dw, workspace, o, columns);
    mpx::conv2d_backward_data<P>(exec, dyd, wd, dx, workspace, o);
  }
  auto const got_y = mpx_test::download(exec, y);
  auto const got_dx = mpx_test::download(exec, dx);
  auto const got_dw = mpx_test::download(exec, dw);

  auto const ref = reference_conv(c, o, widen(x), widen(w), widen(dy));
  double const uT = mpx_test::unit_roundoff<T>(), uD = mpx_test::unit_roundoff<D>(), ua = u_acc<T>();
  double const sub = mpx_test::min_subnormal<T>(), sub_d = mpx_test::min_subnormal<D>();
  double const k = static_cast<double>(patch), taps = static_cast<double>(c.kh * c.kw);
  double const rows = static_cast<double>(chunk * oh_n * ow_n), cc = static_cast<double>(chunks);
  mpx_test::bound_checker fy("y"), fdx("dx"), fdw("dw");
  double nonzero = 0;
  for (std::size_t i = 0; i < got_y.size(); ++i) {
    fy.check(i, to_d(got_y[i]), ref.y[i], uT * std::fabs(ref.y[i]) + (k + 5) * ua * ref.y_abs[i] + sub);
    nonzero += std::fabs(ref.y[i]);
  }
  for (std::size_t i = 0; i < got_dx.size(); ++i) {
    double const s = ref.dx_abs[i];
    fdx.check(i, to_d(got_dx[i]), ref.dx[i],
              uT * std::fabs(ref.dx[i]) + (uT + (static_cast<double>(c.cout) + taps + 6) * ua) * (1 + uT) * s +
                  (taps + 1) * sub);
    nonzero += std::fabs(ref.dx[i]);
  }
  for (std::size_t i = 0; i < got_dw.size(); ++i) {
    fdw.check(i, to_d(got_dw[i]), ref.dw[i],
              uD * std::fabs(ref.dw[i]) + ((cc - 1) * uD + (rows + 4 + cc) * ua) * ref.dw_abs[i] + cc * sub_d);
    nonzero += std::fabs(ref.dw[i]);
  }
  REQUIRE(nonzero > 0);  // the reference is not all zeros
  MPX_REQUIRE_WITHIN(fy);
  MPX_REQUIRE_WITHIN(fdx);
  MPX_REQUIRE_WITHIN(fdw);
}

std::vector<conv_case> conv_cases() {
  auto opts = [](std::int64_t sh, std::int64_t sw, std::int64_t ph, std::int64_t pw, std::int64_t dh = 1,
                 std::int64_t dw = 1) {
    mpx::conv2d_options o;
    o.stride_h = sh;
    o.stride_w = sw;
    o.pad_h = ph;
    o.pad_w = pw;
    o.dilation_h = dh;
    o.dilation_w = dw;
    return o;
  };
  std::vector<conv_case> cases = {
      {1, 7, 5, 3, 3, 3, 5},                                     // N = 1, primes, 'valid'
      {2, 7, 5, 3, 3, 3, 5, opts(1, 1, 1, 1)},                   // padding 1 ('same' for 3x3)
      {3, 4, 6, 7, 1, 1, 2},                                     // 1x1 kernel: a plain product
      {2, 9, 8, 2, 2, 3, 3, opts(2, 2, 1, 1)},                   // 2x3 kernel, stride 2, padding 1
      {2, 11, 10, 4, 3, 3, 6, opts(1, 1, 2, 2, 2, 2)},           // dilation 2
      {1, 8, 9, 3, 3, 2, 4, opts(2, 1, 0, 1, 1, 2)},             // mixed strides and dilations
      {2, 7, 6, 3, 2, 2, 5, opts(1, 1, 0, 0), true},             // Keras 'same' with an even kernel (extra pad)
      {3, 9, 7, 2, 3, 3, 4, opts(2, 2, 0, 0), true},             // 'same' with stride 2
      {1, 5, 5, 2, 1, 1, 3, opts(1, 1, 3, 2)},                   // padding wider than the kernel: zero rows
      {5, 6, 5, 3, 3, 3, 4, opts(1, 1, 1, 1), false, 2},         // workspace for 2 of 5 images: 3 chunks
      {4, 7, 7, 3, 3, 3, 5, opts(1, 1, 1, 1), false, 0, true},   // backward weights reuses the columns
      {2, 6, 7, 3, 3, 2, 4, opts(1, 2, 1, 0), false, 0, true, true},  // conv2d_backward, reusing
      {2, 12, 12, 1, 3, 3, 8, opts(1, 1, 1, 1)},                 // the first layer of a small CNN (Cin = 1)
      {2, 13, 13, 32, 3, 3, 16},                                 // a second layer (K = 288)
  };
  // And seeded random geometries.
  std::mt19937_64 gen(mpx_test::seed + 7);
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen); };
  for (int i = 0; i < 6; ++i) {
    conv_case c{pick(1, 3), pick(3, 12), pick(3, 12), pick(1, 6), pick(1, 4), pick(1, 4), pick(1, 7),
                opts(pick(1, 3), pick(1, 3), pick(0, 2), pick(0, 2), pick(1, 2), pick(1, 2))};
    if ((c.kh - 1) * c.o.dilation_h + 1 > c.h + 2 * c.o.pad_h || (c.kw - 1) * c.o.dilation_w + 1 > c.w + 2 * c.o.pad_w)
      continue;
    cases.push_back(c);
  }
  return cases;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("conv2d forward, input and weight gradients are within the bound of float64", "[conv]",
                        mpx_test::executors) {
  TestType exec;
  auto const cases = conv_cases();
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::uint64_t stream = 100;
    for (auto const& c : cases) run_conv<T, T>(exec, c, stream += 10);
    // A float weight gradient from 16-bit operands (a float master gradient).
    run_conv<T, float>(exec, conv_cases()[3], 7);
    run_conv<T, float>(exec, conv_cases()[9], 8);
  };
  mpx_test::for_each_dtype(for_type);
}

TEST_CASE("the float64 conv2d reference's gradients agree with finite differences", "[conv]") {
  // L(x, w) = sum(dy * conv2d(x, w)); dL/dx and dL/dw are the reference's dx and dw.
  conv_case const c{1, 4, 3, 2, 2, 2, 2};
  mpx::conv2d_options o;
  o.pad_h = 1;
  o.stride_w = 2;
  o.dilation_h = 2;
  o.pad_w = 1;
  auto const [oh_n, ow_n] = output_dims(c, o);
  auto x = mpx_test::random_values<double>(static_cast<std::size_t>(c.n * c.h * c.w * c.cin), -1, 1, 1);
  auto w = mpx_test::random_values<double>(static_cast<std::size_t>(c.kh * c.kw * c.cin * c.cout), -1, 1, 2);
  auto const dy = mpx_test::random_values<double>(static_cast<std::size_t>(c.n * oh_n * ow_n * c.cout), -1, 1, 3);
  auto const ref = reference_conv(c, o, x, w, dy);
  auto loss = [&] {
    auto const y = reference_conv(c, o, x, w, dy).y;
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
    return l;
  };
  double const h = 1e-6;
  auto check = [&](std::vector<double>& v, std::vector<double> const& grad) {
    double nonzero = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      double const keep = v[i];
      v[i] = keep + h;
      double const up = loss();
      v[i] = keep - h;
      double const down = loss();
      v[i] = keep;
      double const fd = (up - down) / (2 * h);
      INFO("element " << i);
      REQUIRE(std::fabs(fd - grad[i]) <= 1e-7 * (1 + std::fabs(grad[i])));
      nonzero += std::fabs(grad[i]);
    }
    REQUIRE(nonzero > 0);
  };
  check(x, ref.dx);
  check(w, ref.dw);
}

TEMPLATE_LIST_TEST_CASE("conv2d is deterministic and its output feeds the bias and activation kernels", "[conv]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    using P = mpx_test::preset_policy<T>;
    mpx::shape const xs{3, 9, 8, 4}, ws{3, 3, 4, 6};
    auto const o = mpx::conv2d_padding_same(xs, ws);
    auto const ys = mpx::conv2d_output_shape(xs, ws, o);
    REQUIRE(ys == mpx::shape{3, 9, 8, 6});
    auto const xd = mpx_test::upload(exec, mpx_test::random_values<T>(xs.size(), -1, 1, 71), xs);
    auto const wd = mpx_test::upload(exec, mpx_test::random_values<T>(ws.size(), -1, 1, 72), ws);
    auto const dyd = mpx_test::upload(exec, mpx_test::random_values<T>(ys.size(), -1, 1, 73), ys);
    auto const bias = mpx_test::random_values<float>(6, -1, 1, 74);
    auto const bd = mpx_test::upload(exec, bias);
    auto workspace = poisoned<T>(exec, mpx::conv2d_workspace_shape(xs, ws, o));
    auto y = poisoned<T>(exec, ys);
    auto dx1 = poisoned<T>(exec, xs);
    auto dx2 = poisoned<T>(exec, xs);
    mpx::conv2d_forward<P>(exec, xd, wd, y, workspace, o);
    mpx::conv2d_backward_data<P>(exec, dyd, wd, dx1, workspace, o);
    mpx::fill(exec, workspace, mpx_test::poison<T>());
    mpx::conv2d_backward_data<P>(exec, dyd, wd, dx2, workspace, o);
    auto const a = mpx_test::download(exec, dx1);
    REQUIRE(mpx_test::first_mismatch(a, mpx_test::download(exec, dx2)).empty());

    // A Conv2D layer's bias and activation: y viewed as [N*OH*OW, Cout].
    std::int64_t const rows = ys[0] * ys[1] * ys[2];
    auto z = poisoned<T>(exec, ys);
    mpx::bias_activation_forward(exec, mpx::act::relu{}, mpx::view(y).reshape({rows, 6}), bd,
                                 mpx::view(z).reshape({rows, 6}));
    auto const yh = mpx_test::download(exec, y);
    auto const zh = mpx_test::download(exec, z);
    std::vector<T> expected(yh.size());
    for (std::size_t i = 0; i < yh.size(); ++i)
      expected[i] = mpx::cast<T>(std::max(mpx::cast<float>(yh[i]) + bias[i % 6], 0.0f));
    REQUIRE(mpx_test::first_mismatch(zh, expected).empty());
    auto db = poisoned<float>(exec, mpx::shape{6});
    mpx::bias_gradient(exec, mpx::view(dyd).reshape({rows, 6}), db);
    auto const dbh = mpx_test::download(exec, db);
    auto const dyh = mpx_test::download(exec, dyd);
    for (std::size_t j = 0; j < 6; ++j) {
      double s = 0, sa = 0;
      for (std::int64_t r = 0; r < rows; ++r) {
        s += to_d(dyh[static_cast<std::size_t>(r) * 6 + j]);
        sa += std::fabs(to_d(dyh[static_cast<std::size_t>(r) * 6 + j]));
      }
      REQUIRE(std::fabs(dbh[j] - s) <= static_cast<double>(rows) * uf * sa);
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("conv2d refuses shapes that do not convolve, naming them", "[conv]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  using P = mpx::float32;
  TestType exec;
  auto x = mpx::make_tensor<float>(exec, {2, 7, 5, 3});
  auto w = mpx::make_tensor<float>(exec, {3, 3, 3, 4});
  auto y = mpx::make_tensor<float>(exec, {2, 5, 3, 4});
  auto ws = mpx::make_tensor<float>(exec, {30, 27});
  mpx::shape const xs{2, 7, 5, 3}, wsh{3, 3, 3, 4};
  REQUIRE(mpx::conv2d_output_shape(xs, wsh) == mpx::shape{2, 5, 3, 4});
  REQUIRE(mpx::conv2d_workspace_shape(xs, wsh) == mpx::shape{30, 27});

  auto x3 = mpx::make_tensor<float>(exec, {7, 5, 3});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x3, w, y, ws), mpx::shape_error,
                         Contains("mpx::conv2d_forward") && Contains("[7, 5, 3]") && Contains("[3, 3, 3, 4]") &&
                             Contains("rank 4"));
  auto w5 = mpx::make_tensor<float>(exec, {3, 3, 5, 4});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w5, y, ws), mpx::shape_error,
                         Contains("mpx::conv2d_forward") && Contains("[2, 7, 5, 3]") && Contains("[3, 3, 5, 4]") &&
                             Contains("3 input channels but w expects 5"));
  auto bad_y = mpx::make_tensor<float>(exec, {2, 5, 3, 5});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w, bad_y, ws), mpx::shape_error,
                         Contains("y has shape [2, 5, 3, 5]") && Contains("[2, 7, 5, 3]") &&
                             Contains("[3, 3, 3, 4]") && Contains("need [2, 5, 3, 4]"));
  auto x0 = mpx::make_tensor<float>(exec, {0, 7, 5, 3});
  auto y0 = mpx::make_tensor<float>(exec, {0, 5, 3, 4});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x0, w, y0, ws), mpx::shape_error,
                         Contains("[0, 7, 5, 3]") && Contains("the batch is empty"));
  auto w_big = mpx::make_tensor<float>(exec, {3, 6, 3, 4});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w_big, y, ws), mpx::shape_error,
                         Contains("[2, 7, 5, 3]") && Contains("[3, 6, 3, 4]") && Contains("the kernel spans 3 x 6"));
  mpx::conv2d_options dilated;
  dilated.dilation_w = 3;  // 3 taps 3 apart span 7 > 5
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_output_shape(xs, wsh, dilated), mpx::shape_error,
                         Contains("mpx::conv2d_output_shape") && Contains("spans 3 x 7"));
  auto bad_ws = mpx::make_tensor<float>(exec, {30, 26});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w, y, bad_ws), mpx::shape_error,
                         Contains("workspace has shape [30, 26]") && Contains("[rows, 27]"));
  auto small_ws = mpx::make_tensor<float>(exec, {14, 27});  // less than one image's 15 rows
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w, y, small_ws), mpx::shape_error,
                         Contains("workspace has shape [14, 27]"));
  mpx::conv2d_options zero_stride;
  zero_stride.stride_h = 0;
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w, y, ws, zero_stride), mpx::invalid_argument,
                         Contains("mpx::conv2d_forward") && Contains("strides (0, 1)"));
  mpx::conv2d_options negative_pad;
  negative_pad.pad_w = -1;
  CHECK_THROWS_AS(mpx::conv2d_output_shape(xs, wsh, negative_pad), mpx::invalid_argument);

  auto dx = mpx::make_tensor<float>(exec, {2, 7, 5, 3});
  auto dw = mpx::make_tensor<float>(exec, {3, 3, 3, 4});
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_backward_data<P>(exec, bad_y, w, dx, ws), mpx::shape_error,
                         Contains("mpx::conv2d_backward_data") && Contains("dy has shape [2, 5, 3, 5]") &&
                             Contains("dx [2, 7, 5, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_backward_weights<P>(exec, x, y, w5, ws), mpx::shape_error,
                         Contains("mpx::conv2d_backward_weights") && Contains("dw [3, 3, 5, 4]"));
  auto half_ws = mpx::make_tensor<float>(exec, {15, 27});  // one image of two
  CHECK_THROWS_TYPE_WITH(
      mpx::conv2d_backward_weights<P>(exec, x, y, dw, half_ws, {}, mpx::conv2d_columns::reuse_forward),
      mpx::invalid_argument, Contains("reuse_forward") && Contains("[15, 27]"));
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_backward<P>(exec, x, w, bad_y, dx, dw, ws), mpx::shape_error,
                         Contains("dy has shape [2, 5, 3, 5]"));
}

// im2col and col2im count in 32 bits when they can. A full H100 grid is 132 SMs x 8
// blocks x 256 threads = 270,336: the last stride must not wrap past 2^32.
TEST_CASE("grid-stride loops count in 32 bits only where the last stride cannot wrap", "[conv]") {
  using mpx::detail::fits_32_bit_grid_stride;
  unsigned const h100_grid = 132 * 8;
  CHECK(fits_32_bit_grid_stride(1'000'000, 1'000'000, h100_grid));
  CHECK(fits_32_bit_grid_stride(0xFFFF'FFFFu - 270'336, 1'000, h100_grid));
  CHECK_FALSE(fits_32_bit_grid_stride(0xFFFF'FFFFu - 270'335, 1'000, h100_grid));
  // [2557, 54, 54, 64] under a 3x3 'same' conv: 4,294,778,112 columns, below 2^32 but
  // within a grid's stride of it.
  CHECK_FALSE(fits_32_bit_grid_stride(2557ull * 54 * 54 * 64 * 9, 2557ull * 54 * 54 * 64, h100_grid));
  CHECK_FALSE(fits_32_bit_grid_stride(1'000, 0x1'0000'0000ull, h100_grid));  // an index past 2^32
}

TEST_CASE("conv2d_padding_same reproduces Keras's 'same' extents", "[conv]") {
  // Keras: output = ceil(input / stride); the odd padding row/column goes at the end.
  for (std::int64_t h : {1, 2, 5, 7, 8})
    for (std::int64_t k : {1, 2, 3, 4})
      for (std::int64_t s : {1, 2, 3})
        for (std::int64_t d : {1, 2}) {
          mpx::shape const xs{1, h, h + 1, 2}, ws{k, k, 2, 3};
          mpx::conv2d_options o;
          o.stride_h = o.stride_w = s;
          o.dilation_h = o.dilation_w = d;
          if (s > 1 && d > 1) continue;  // TensorFlow refuses strides and dilations together
          auto const same = mpx::conv2d_padding_same(xs, ws, o);
          INFO("h=" << h << " k=" << k << " s=" << s << " d=" << d);
          REQUIRE(mpx::conv2d_output_shape(xs, ws, same) == mpx::shape{1, (h + s - 1) / s, (h + s) / s, 3});
          std::int64_t const total = std::max<std::int64_t>(((h + s - 1) / s - 1) * s + (k - 1) * d + 1 - h, 0);
          REQUIRE(same.pad_h == total / 2);
          REQUIRE(same.pad_h + same.extra_pad_h == total - total / 2);
          REQUIRE(same.stride_h == s);
          REQUIRE(same.dilation_w == d);
        }
}

// ---- max pooling ----

namespace {

struct pool_case {
  std::int64_t n, h, w, c;
  mpx::pool_options o;
};

std::string describe(pool_case const& p) {
  std::ostringstream os;
  os << "x [" << p.n << ", " << p.h << ", " << p.w << ", " << p.c << "] pool (" << p.o.pool_h << ", " << p.o.pool_w
     << ") stride (" << p.o.stride_h << ", " << p.o.stride_w << ") pad (" << p.o.pad_h << ", " << p.o.pad_w << ")";
  return os.str();
}

// The reference selection, written differently from the kernels: the first NaN of the
// window if there is one, else the first position holding the window's maximum.
template <class T>
std::vector<std::size_t> reference_selection(pool_case const& p, std::vector<T> const& x, std::int64_t& oh_n,
                                             std::int64_t& ow_n) {
  std::int64_t const sh = p.o.stride_h ? p.o.stride_h : p.o.pool_h, sw = p.o.stride_w ? p.o.stride_w : p.o.pool_w;
  oh_n = (p.h + 2 * p.o.pad_h - p.o.pool_h) / sh + 1;
  ow_n = (p.w + 2 * p.o.pad_w - p.o.pool_w) / sw + 1;
  std::vector<std::size_t> at;
  for (std::int64_t n = 0; n < p.n; ++n)
    for (std::int64_t oh = 0; oh < oh_n; ++oh)
      for (std::int64_t ow = 0; ow < ow_n; ++ow)
        for (std::int64_t c = 0; c < p.c; ++c) {
          std::vector<std::size_t> window;
          for (std::int64_t i = 0; i < p.o.pool_h; ++i)
            for (std::int64_t j = 0; j < p.o.pool_w; ++j) {
              std::int64_t const ih = oh * sh - p.o.pad_h + i, iw = ow * sw - p.o.pad_w + j;
              if (ih >= 0 && ih < p.h && iw >= 0 && iw < p.w)
                window.push_back(static_cast<std::size_t>(((n * p.h + ih) * p.w + iw) * p.c + c));
            }
          REQUIRE(!window.empty());
          auto const nan = std::find_if(window.begin(), window.end(), [&](std::size_t i) { return std::isnan(to_d(x[i])); });
          if (nan != window.end()) {
            at.push_back(*nan);
            continue;
          }
          double m = -std::numeric_limits<double>::infinity();
          for (std::size_t i : window) m = std::max(m, to_d(x[i]));
          at.push_back(*std::find_if(window.begin(), window.end(), [&](std::size_t i) { return to_d(x[i]) == m; }));
        }
  return at;
}

template <class T, class Exec>
void run_pool(Exec const& exec, pool_case const& p, std::vector<T> const& x, std::uint64_t stream) {
  INFO(mpx::dtype_name<T> << ": " << describe(p));
  mpx::shape const xs{p.n, p.h, p.w, p.c};
  std::int64_t oh_n = 0, ow_n = 0;
  auto const at = reference_selection(p, x, oh_n, ow_n);
  mpx::shape const ys{p.n, oh_n, ow_n, p.c};
  REQUIRE(mpx::max_pool2d_output_shape(xs, p.o) == ys);
  auto const dy = mpx_test::random_values<T>(ys.size(), -1, 1, stream);
  auto const xd = mpx_test::upload(exec, x, xs);
  auto const dyd = mpx_test::upload(exec, dy, ys);
  auto y = poisoned<T>(exec, ys);
  auto dx = poisoned<T>(exec, xs);
  mpx::max_pool2d_forward(exec, xd, y, p.o);
  mpx::max_pool2d_backward(exec, xd, y, dyd, dx, p.o);

  std::vector<T> want_y(ys.size());
  std::vector<float> acc(xs.size(), 0.0f);  // windows in order, float sums: the documented rounding
  for (std::size_t i = 0; i < at.size(); ++i) {
    want_y[i] = x[at[i]];
    acc[at[i]] += mpx::cast<float>(dy[i]);
  }
  std::vector<T> want_dx(xs.size());
  for (std::size_t i = 0; i < acc.size(); ++i) want_dx[i] = mpx::cast<T>(acc[i]);
  auto const got_y = mpx_test::download(exec, y);
  auto const got_dx = mpx_test::download(exec, dx);
  INFO("y: " << mpx_test::first_mismatch(got_y, want_y));
  REQUIRE(mpx_test::first_mismatch(got_y, want_y).empty());
  INFO("dx: " << mpx_test::first_mismatch(got_dx, want_dx));
  REQUIRE(mpx_test::first_mismatch(got_dx, want_dx).empty());
}

mpx::pool_options pool(std::int64_t ph, std::int64_t pw, std::int64_t sh = 0, std::int64_t sw = 0,
                       std::int64_t pad_h = 0, std::int64_t pad_w = 0) {
  mpx::pool_options o;
  o.pool_h = ph;
  o.pool_w = pw;
  o.stride_h = sh;
  o.stride_w = sw;
  o.pad_h = pad_h;
  o.pad_w = pad_w;
  return o;
}

std::vector<pool_case> pool_cases() {
  return {
      {2, 7, 5, 3, {}},                  // Keras's default 2x2, floor drops the last row and column
      {1, 2, 2, 1, {}},                  // one window
      {2, 9, 8, 5, pool(3, 3, 2, 2)},    // overlapping windows: float sums
      {1, 6, 7, 2, pool(3, 2, 1, 1)},    // stride 1, every element in several windows
      {2, 5, 5, 4, pool(2, 2, 2, 2, 1, 1)},  // padding, never selected
      {3, 4, 6, 7, pool(1, 1)},          // 1x1: a copy
      {2, 3, 11, 3, pool(1, 3, 1, 2)},   // a row window
      {2, 28, 28, 32, {}},               // a small CNN's first pooling
  };
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("max_pool2d selects exactly the first maximum, forward and backward", "[pool]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::uint64_t stream = 300;
    for (auto const& p : pool_cases()) {
      auto const size = static_cast<std::size_t>(p.n * p.h * p.w * p.c);
      stream += 10;
      run_pool<T>(exec, p, mpx_test::random_values<T>(size, -4, 4, stream), stream + 1);
      // Ties everywhere: integers in [-2, 2]; the first in scan order must win.
      auto ties = mpx_test::random_values<T>(size, -2.49, 2.49, stream + 2);
      for (auto& v : ties) v = mpx::cast<T>(std::nearbyint(to_d(v)));
      run_pool<T>(exec, p, ties, stream + 3);
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("max_pool2d propagates NaN and routes its gradient to the NaN", "[pool]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    T const nan = mpx::dtype_traits<T>::quiet_nan();
    T const inf = mpx::dtype_traits<T>::infinity();
    for (auto const& p : pool_cases()) {
      auto const size = static_cast<std::size_t>(p.n * p.h * p.w * p.c);
      auto x = mpx_test::random_values<T>(size, -4, 4, 400);
      auto const where = mpx_test::random_values<float>(size, 0, 1, 401);
      for (std::size_t i = 0; i < size; ++i) {
        if (where[i] < 0.08f) x[i] = nan;
        else if (where[i] < 0.12f) x[i] = inf;
        else if (where[i] < 0.16f) x[i] = mpx::cast<T>(-to_d(inf));
      }
      run_pool<T>(exec, p, x, 402);
    }
    // By hand, 2x2 windows over [1, 2, 8, 1]: a NaN after the maximum, a NaN before it,
    // a tie, and a window of -inf only.
    T const one = mpx::cast<T>(1.0f), ninf = mpx::cast<T>(-to_d(inf));
    auto const v = [](float f) { return mpx::cast<T>(f); };
    mpx::shape const xs{1, 2, 8, 1};
    std::vector<T> const x = {one,    v(5.0f), nan,     ninf, ninf, v(7.0f), ninf, ninf,   // row 0
                              v(3.0f), nan,    v(9.0f), ninf, ninf, v(7.0f), ninf, ninf};  // row 1
    auto const xd = mpx_test::upload(exec, x, xs);
    mpx::shape const ys{1, 1, 4, 1};
    auto y = poisoned<T>(exec, ys);
    auto dx = poisoned<T>(exec, xs);
    auto const dyd = mpx_test::upload(exec, std::vector<T>{one, v(2.0f), v(3.0f), v(4.0f)}, ys);
    mpx::max_pool2d_forward(exec, xd, y);
    mpx::max_pool2d_backward(exec, xd, y, dyd, dx);
    auto const yh = mpx_test::download(exec, y);
    auto const dxh = mpx_test::download(exec, dx);
    REQUIRE(std::isnan(to_d(yh[0])));             // [1, 5 / 3, NaN]: the NaN, x[9]
    REQUIRE(std::isnan(to_d(yh[1])));             // [NaN, -inf / 9, -inf]: the NaN, x[2]
    REQUIRE(to_d(yh[2]) == 7.0);                  // [-inf, 7 / -inf, 7]: the first 7, x[5]
    REQUIRE(to_d(yh[3]) == -to_d(inf));           // all -inf: the first, x[6]
    std::vector<double> const want = {0, 0, 2, 0, 0, 3, 4, 0, 0, 1, 0, 0, 0, 0, 0, 0};
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO("dx[" << i << "]");
      REQUIRE(to_d(dxh[i]) == want[i]);
    }
  };
  mpx_test::for_each_dtype(for_type);
}

// Found by the API fuzzer (fuzz/regressions/api_matmul/max_pool_dx_overlaps_x,
// conv2d_y_overlaps_x): outputs over their inputs' memory were accepted and written
// while windows and receptive fields of the input were still to be read.
TEMPLATE_LIST_TEST_CASE("conv2d and max_pool2d refuse outputs that overlap their inputs", "[conv][pool]",
                        mpx_test::executors) {
  using Catch::Matchers::Contains;
  using P = mpx::float32;
  TestType exec;
  auto buffer = mpx::make_tensor<float>(exec, {512});
  auto const whole = mpx::view(buffer);
  auto const at = [&](std::size_t offset, mpx::shape s) { return whole.flat(offset, s.size()).reshape(s); };
  auto const x = at(0, {1, 4, 4, 2});   // [0, 32)
  auto const w = at(100, {3, 3, 2, 2});  // [100, 136)
  auto const ws = at(200, {4, 18});      // [200, 272)
  auto const dy = at(300, {1, 2, 2, 2});  // [300, 308)
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w, at(8, {1, 2, 2, 2}), ws), mpx::invalid_argument,
                         Contains("mpx::conv2d_forward") && Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_forward<P>(exec, x, w, at(400, {1, 2, 2, 2}), at(20, {4, 18})),
                         mpx::invalid_argument, Contains("the workspace and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_backward_data<P>(exec, dy, w, at(120, {1, 4, 4, 2}), ws), mpx::invalid_argument,
                         Contains("dx and w overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::conv2d_backward_weights<P>(exec, x, dy, at(290, {3, 3, 2, 2}), ws),
                         mpx::invalid_argument, Contains("dw and dy overlap"));
  CHECK_NOTHROW(mpx::conv2d_forward<P>(exec, x, w, at(400, {1, 2, 2, 2}), ws));
  auto const y = at(400, {1, 2, 2, 2});
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_forward(exec, x, at(16, {1, 2, 2, 2})), mpx::invalid_argument,
                         Contains("mpx::max_pool2d_forward") && Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_backward(exec, at(40, {1, 4, 4, 2}), y, dy, at(30, {1, 4, 4, 2})),
                         mpx::invalid_argument, Contains("dx and x overlap"));
  CHECK_NOTHROW(mpx::max_pool2d_forward(exec, x, y));
}

TEMPLATE_LIST_TEST_CASE("max_pool2d refuses shapes it cannot pool, naming them", "[pool]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  auto x = mpx::make_tensor<float>(exec, {2, 7, 5, 3});
  auto y = mpx::make_tensor<float>(exec, {2, 3, 2, 3});
  auto bad_y = mpx::make_tensor<float>(exec, {2, 4, 2, 3});
  auto x3 = mpx::make_tensor<float>(exec, {7, 5, 3});
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_forward(exec, x3, y), mpx::shape_error,
                         Contains("mpx::max_pool2d_forward") && Contains("[7, 5, 3]") && Contains("rank 4"));
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_forward(exec, x, bad_y), mpx::shape_error,
                         Contains("y has shape [2, 4, 2, 3]") && Contains("[2, 7, 5, 3]") &&
                             Contains("needs [2, 3, 2, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_forward(exec, x, y, pool(8, 2)), mpx::shape_error,
                         Contains("[2, 7, 5, 3]") && Contains("smaller than the 8 x 2 window"));
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_forward(exec, x, y, pool(2, 2, 2, 2, 2, 0)), mpx::invalid_argument,
                         Contains("smaller than the pool"));
  CHECK_THROWS_AS(mpx::max_pool2d_output_shape(mpx::shape{2, 7, 5, 3}, pool(0, 2)), mpx::invalid_argument);
  auto x0 = mpx::make_tensor<float>(exec, {0, 7, 5, 3});
  auto y0 = mpx::make_tensor<float>(exec, {0, 3, 2, 3});
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_forward(exec, x0, y0), mpx::shape_error, Contains("empty"));
  auto dx = mpx::make_tensor<float>(exec, {2, 7, 5, 3});
  auto bad_dx = mpx::make_tensor<float>(exec, {2, 7, 5, 4});
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_backward(exec, x, y, bad_y, dx), mpx::shape_error,
                         Contains("mpx::max_pool2d_backward") && Contains("dy has shape [2, 4, 2, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::max_pool2d_backward(exec, x, y, y, bad_dx), mpx::shape_error,
                         Contains("dx has shape [2, 7, 5, 4]"));
}
