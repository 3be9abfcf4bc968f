// The executor's dispatch (exec/for_each.hpp, exec/lanes.hpp, exec/reduce_items.hpp,
// exec/columns.hpp): every index and every column of a row visited once, the lanes'
// reductions exact where the arithmetic is, and the promise that makes one body serve
// both executors: the host adds in the GPU's order, so an op whose body is plain
// arithmetic gives the same bits on the host and on a GPU. Under nvcc these cases
// compare the CUDA executor with the host executor; on the host the comparison is with
// itself, and the element bodies are checked against the host's own faster loops.
#include "../support/testing.hpp"

#include <mpx/exec/for_each.hpp>
#include <mpx/exec/reduce.hpp>
#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/column_reduce.hpp>
#include <mpx/kernels/conv2d.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/layer_norm.hpp>
#include <mpx/kernels/max_pool.hpp>
#include <mpx/kernels/softmax.hpp>
#include <mpx/losses/mean_squared_error.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace test_dispatch {

//! Writes the row's sum, sum of squares and maximum once per row and, for every column,
//! its index plus the sum (so a column written twice, or not at all, shows).
struct row_probe {
  float const* x;
  float* y;
  float* sums;
  float* squares;
  float* maxima;
  std::size_t cols;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    float const* xr = x + r * cols;
    float const s = lanes.reduce(cols, mpx::lane_sum{}, [&](std::size_t c) { return xr[c]; });
    float const q = lanes.reduce(cols, mpx::lane_sum{}, [&](std::size_t c) { return xr[c] * xr[c]; });
    float const m = lanes.reduce(cols, mpx::lane_max{}, [&](std::size_t c) { return xr[c]; });
    lanes.once([&] {
      sums[r] = s;
      squares[r] = q;
      maxima[r] = m;
    });
    lanes.for_each(cols, [&](std::size_t c) { y[r * cols + c] = static_cast<float>(c) + s; });
  }
};

//! A sum and a count carried together, with default member initializers: an accumulator
//! a __shared__ array could not hold (the block reductions keep raw storage for it).
struct sum_count {
  float sum = 0.0f;
  unsigned count = 0;
};
struct add_sum_count {
  using value_type = sum_count;
  MPX_HD static sum_count identity() noexcept { return {}; }
  MPX_HD sum_count operator()(sum_count a, sum_count b) const noexcept {
    return {mpx::add_rn(a.sum, b.sum), a.count + b.count};
  }
};
//! The sum and the number of a value's positive elements (an element's own term).
struct positive_term {
  MPX_HD sum_count operator()(float v) const noexcept { return v > 0.0f ? sum_count{v, 1u} : sum_count{}; }
};
//! Three reductions per row, of two accumulator types (so a block row reuses its
//! scratch, and two types share the kernel): the positive elements' sum and count, all
//! elements' sum, the negative elements' sum and count.
struct row_mixed_terms {
  float const* x;
  float* out;  // 5 values a row
  std::size_t cols;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    float const* xr = x + r * cols;
    sum_count const pos = lanes.reduce(cols, add_sum_count{}, [&](std::size_t c) { return positive_term{}(xr[c]); });
    float const all = lanes.reduce(cols, mpx::lane_sum{}, [&](std::size_t c) { return xr[c]; });
    sum_count const neg = lanes.reduce(cols, add_sum_count{}, [&](std::size_t c) { return positive_term{}(-xr[c]); });
    lanes.once([&] {
      float* o = out + 5 * r;
      o[0] = pos.sum;
      o[1] = static_cast<float>(pos.count);
      o[2] = all;
      o[3] = neg.sum;
      o[4] = static_cast<float>(neg.count);
    });
  }
};

//! Restores host loops at the end of a scope.
struct element_bodies_on_host {
  element_bodies_on_host() { mpx::detail::host_loops_enabled() = false; }
  ~element_bodies_on_host() { mpx::detail::host_loops_enabled() = true; }
  element_bodies_on_host(element_bodies_on_host const&) = delete;
  element_bodies_on_host& operator=(element_bodies_on_host const&) = delete;
};

}  // namespace test_dispatch

TEMPLATE_LIST_TEST_CASE("for_each_row visits every column once, with exact sums and maxima, warp and block rows",
                        "[dispatch]", mpx_test::executors) {
  TestType exec;
  // Up to 1024 columns a warp serves a row; beyond, a block of 512 lanes.
  for (std::size_t cols : {std::size_t{1}, std::size_t{31}, std::size_t{33}, std::size_t{1024}, std::size_t{1025},
                           std::size_t{5000}}) {
    std::size_t const rows = 37;
    std::vector<float> x(rows * cols);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7919) % 61) - 30.0f;  // small integers
    auto xd = mpx_test::upload(exec, x);
    auto y = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(rows * cols)});
    auto sums = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(rows)});
    auto squares = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(rows)});
    auto maxima = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(rows)});
    mpx::for_each_row(exec, rows, cols,
                      test_dispatch::row_probe{xd.data(), y.data(), sums.data(), squares.data(), maxima.data(), cols});
    auto const got_y = mpx_test::download(exec, y);
    auto const got_sums = mpx_test::download(exec, sums);
    auto const got_squares = mpx_test::download(exec, squares);
    auto const got_maxima = mpx_test::download(exec, maxima);
    INFO("cols=" << cols);
    for (std::size_t r = 0; r < rows; ++r) {
      double s = 0.0, q = 0.0, m = -1e30;
      for (std::size_t c = 0; c < cols; ++c) {
        s += x[r * cols + c];
        q += static_cast<double>(x[r * cols + c]) * x[r * cols + c];
        m = std::max(m, static_cast<double>(x[r * cols + c]));
      }
      REQUIRE(got_sums[r] == s);  // integers: every order of addition is exact
      REQUIRE(got_squares[r] == q);
      REQUIRE(got_maxima[r] == m);
      for (std::size_t c = 0; c < cols; ++c) REQUIRE(got_y[r * cols + c] == static_cast<float>(c) + got_sums[r]);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("an accumulator with default member initializers reduces over rows and over a tensor",
                        "[dispatch]", mpx_test::executors) {
  TestType exec;
  mpx::host_executor host;
  // Each row's five results (row_mixed_terms) and the tensor's positive sum and count.
  auto const run = [](auto const& e, std::vector<float> const& x, std::size_t rows, std::size_t cols) {
    auto xd = mpx_test::upload(e, x);
    auto out = mpx_test::poisoned<float>(e, {static_cast<std::int64_t>(5 * rows)});
    mpx::for_each_row(e, rows, cols, test_dispatch::row_mixed_terms{xd.data(), out.data(), cols});
    auto got = mpx_test::download(e, out);
    auto const total = mpx::transform_reduce(e, xd, test_dispatch::sum_count{}, test_dispatch::positive_term{},
                                             test_dispatch::add_sum_count{});
    got.push_back(total.sum);
    got.push_back(static_cast<float>(total.count));
    return got;
  };
  for (std::size_t cols : {std::size_t{5}, std::size_t{1000}, std::size_t{3001}}) {  // warp and block rows
    INFO("cols=" << cols);
    std::size_t const rows = 7;
    // Small integers: every order of addition is exact, so the float64 sums are the answer.
    std::vector<float> x(rows * cols);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7919) % 61) - 30.0f;
    auto const got = run(exec, x, rows, cols);
    double all_sum = 0.0;
    unsigned all_count = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      double pos = 0.0, sum = 0.0, neg = 0.0;
      unsigned np = 0, nn = 0;
      for (std::size_t c = 0; c < cols; ++c) {
        float const v = x[r * cols + c];
        sum += v;
        if (v > 0.0f) pos += v, ++np;
        if (v < 0.0f) neg -= v, ++nn;
      }
      REQUIRE(got[5 * r] == pos);
      REQUIRE(got[5 * r + 1] == static_cast<float>(np));
      REQUIRE(got[5 * r + 2] == sum);
      REQUIRE(got[5 * r + 3] == neg);
      REQUIRE(got[5 * r + 4] == static_cast<float>(nn));
      all_sum += pos;
      all_count += np;
    }
    REQUIRE(got[5 * rows] == all_sum);
    REQUIRE(got[5 * rows + 1] == static_cast<float>(all_count));
    // Values of many magnitudes: another order of addition changes the bits, so the GPU
    // must add as the host does.
    auto y = mpx_test::random_values<float>(rows * cols, -1.0, 1.0, 5);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::ldexp(y[i], static_cast<int>(i % 23) - 11);
    CHECK(mpx_test::first_mismatch(run(exec, y, rows, cols), run(host, y, rows, cols)).empty());
  }
}

TEMPLATE_LIST_TEST_CASE("one body, the same bits: row, item and column reductions add in one order on every executor",
                        "[dispatch]", mpx_test::executors) {
  TestType exec;
  mpx::host_executor host;
  // Values of many magnitudes, so that a different order of addition changes the bits.
  auto const values = [](std::size_t n, std::uint64_t stream) {
    auto v = mpx_test::random_values<float>(n, -1.0, 1.0, stream);
    for (std::size_t i = 0; i < n; ++i) v[i] = std::ldexp(v[i], static_cast<int>(i % 23) - 11);
    return v;
  };
  // Rows longer than a warp and a block; more items than the GPU's 1024 x 256 threads
  // (so each thread folds several: 600 x 500); sums of products (a fused multiply-add
  // would change their bits).
  for (auto [rows, cols] : {std::pair<std::size_t, std::size_t>{1, 1}, {3, 1000}, {200, 37}, {5, 1500},
                            {4099, 3}, {9, 20000}, {600, 500}}) {
    INFO("rows=" << rows << " cols=" << cols);
    std::size_t const n = rows * cols;
    auto const x = values(n, 1);
    auto const t = values(n, 2);
    mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};

    // Rows: the lanes' sums, of values and of their squares.
    auto run_rows = [&](auto const& e) {
      auto xd = mpx_test::upload(e, x);
      auto y = mpx_test::poisoned<float>(e, {static_cast<std::int64_t>(n)});
      auto sums = mpx_test::poisoned<float>(e, {static_cast<std::int64_t>(rows)});
      auto squares = mpx_test::poisoned<float>(e, {static_cast<std::int64_t>(rows)});
      auto maxima = mpx_test::poisoned<float>(e, {static_cast<std::int64_t>(rows)});
      mpx::for_each_row(e, rows, cols,
                        test_dispatch::row_probe{xd.data(), y.data(), sums.data(), squares.data(), maxima.data(), cols});
      auto out = mpx_test::download(e, sums);
      auto const q = mpx_test::download(e, squares);
      out.insert(out.end(), q.begin(), q.end());
      return out;
    };
    CHECK(mpx_test::first_mismatch(run_rows(exec), run_rows(host)).empty());

    // Items: a pointwise loss's mean ((p - t)^2 summed) and gradient (no exp or log).
    auto run_loss = [&](auto const& e) {
      auto p = mpx_test::upload(e, x, s);
      auto q = mpx_test::upload(e, t, s);
      auto g = mpx_test::poisoned<float>(e, s);
      mpx::loss_value loss(e);
      mpx::mean_squared_error(e, p, q, g, loss);
      auto grad = mpx_test::download(e, g);
      grad.push_back(loss.read(e));
      return grad;
    };
    CHECK(mpx_test::first_mismatch(run_loss(exec), run_loss(host)).empty());

    // Columns: column_sum, and layer norm's parameter gradients (sums of dy * xhat).
    auto run_columns = [&](auto const& e) {
      auto xd = mpx_test::upload(e, x, s);
      auto dy = mpx_test::upload(e, t, s);
      auto const c = static_cast<std::int64_t>(cols);
      auto const r = static_cast<std::int64_t>(rows);
      auto y = mpx_test::poisoned<float>(e, {c});
      mpx::column_sum(e, xd, y);
      auto gamma = mpx_test::upload(e, values(cols, 3));
      auto beta = mpx_test::upload(e, values(cols, 4));
      auto normed = mpx_test::poisoned<float>(e, s);
      auto mean = mpx_test::poisoned<float>(e, {r});
      auto rstd = mpx_test::poisoned<float>(e, {r});
      mpx::layer_norm_forward(e, xd, gamma, beta, normed, mean, rstd);
      auto dx = mpx_test::poisoned<float>(e, s);
      auto dgamma = mpx_test::poisoned<float>(e, {c});
      auto dbeta = mpx_test::poisoned<float>(e, {c});
      mpx::layer_norm_backward(e, xd, dy, gamma, mean, rstd, dx, dgamma, dbeta);
      auto out = mpx_test::download(e, y);  // then the row statistics and the column sums of products
      for (auto const& part : {mpx_test::download(e, mean), mpx_test::download(e, rstd), mpx_test::download(e, dgamma),
                               mpx_test::download(e, dbeta)})
        out.insert(out.end(), part.begin(), part.end());
      return out;
    };
    CHECK(mpx_test::first_mismatch(run_columns(exec), run_columns(host)).empty());
  }
}

TEST_CASE("the host's fast loops give the bits of the element bodies the GPU runs", "[dispatch]") {
  mpx::host_executor exec;
  mpx_test::for_each_dtype([&](auto zero) {
    using T = decltype(zero);
    INFO("dtype " << mpx::dtype_traits<T>::name);
    // bias + activation, row by row with whole-row conversions vs element by element.
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 33}, {64, 130}}) {
      auto x = mpx_test::upload(exec, mpx_test::random_values<T>(static_cast<std::size_t>(rows * cols), -4.0, 4.0, 3),
                                mpx::shape{rows, cols});
      auto b = mpx_test::upload(exec, mpx_test::random_values<T>(static_cast<std::size_t>(cols), -1.0, 1.0, 4));
      auto fast = mpx_test::poisoned<T>(exec, {rows, cols});
      auto slow = mpx_test::poisoned<T>(exec, {rows, cols});
      mpx::bias_activation_forward(exec, mpx::act::gelu{}, x, b, fast);
      {
        test_dispatch::element_bodies_on_host const bodies;
        mpx::bias_activation_forward(exec, mpx::act::gelu{}, x, b, slow);
      }
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, slow), mpx_test::download(exec, fast)).empty());
    }
    // casts between float and 16 bits: whole-array conversions (F16C) vs mpx::cast.
    if constexpr (!std::is_same_v<T, float>) {
      auto wide = mpx_test::random_values<float>(4099, -70000.0, 70000.0, 7);
      wide[5] = mpx::dtype_traits<float>::quiet_nan();
      wide[6] = 1e-30f;  // below every 16-bit subnormal
      auto w = mpx_test::upload(exec, wide);
      auto narrow_fast = mpx_test::poisoned<T>(exec, w.shape());
      auto narrow_slow = mpx_test::poisoned<T>(exec, w.shape());
      auto back_fast = mpx_test::poisoned<float>(exec, w.shape());
      auto back_slow = mpx_test::poisoned<float>(exec, w.shape());
      mpx::cast(exec, w, narrow_fast);
      mpx::cast(exec, narrow_fast, back_fast);
      {
        test_dispatch::element_bodies_on_host const bodies;
        mpx::cast(exec, w, narrow_slow);
        mpx::cast(exec, narrow_slow, back_slow);
      }
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, narrow_slow), mpx_test::download(exec, narrow_fast)).empty());
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, back_slow), mpx_test::download(exec, back_fast)).empty());
    }
    // im2col and col2im through conv2d: the host's blocked loops vs the GPU's gathers,
    // with strides, padding and dilation, and a workspace smaller than the batch (chunks
    // of images that start past image 0).
    {
      using P = mpx_test::preset_policy<T>;
      mpx::shape const xs{3, 7, 6, 5}, ws{3, 2, 5, 4};
      mpx::conv2d_options o;
      o.stride_h = 2;
      o.pad_h = 1;
      o.pad_w = 1;
      o.dilation_w = 2;
      auto const ys = mpx::conv2d_output_shape(xs, ws, o);
      auto const full = mpx::conv2d_workspace_shape(xs, ws, o);
      mpx::shape const chunk{full[0] / 3, full[1]};  // one image's rows
      auto x = mpx_test::upload(exec, mpx_test::random_values<T>(static_cast<std::size_t>(xs.size()), -1.0, 1.0, 8), xs);
      auto w = mpx_test::upload(exec, mpx_test::random_values<T>(static_cast<std::size_t>(ws.size()), -1.0, 1.0, 9), ws);
      auto dy = mpx_test::upload(exec, mpx_test::random_values<T>(static_cast<std::size_t>(ys.size()), -1.0, 1.0, 10), ys);
      auto run = [&] {
        auto workspace = mpx_test::poisoned<T>(exec, chunk);
        auto y = mpx_test::poisoned<T>(exec, ys);
        auto dx = mpx_test::poisoned<T>(exec, xs);
        mpx::conv2d_forward<P>(exec, x, w, y, workspace, o);
        mpx::conv2d_backward_data<P>(exec, dy, w, dx, workspace, o);
        auto out = mpx_test::download(exec, y);
        auto const d = mpx_test::download(exec, dx);
        out.insert(out.end(), d.begin(), d.end());
        return out;
      };
      auto const fast = run();
      test_dispatch::element_bodies_on_host const bodies;
      CHECK(mpx_test::first_mismatch(run(), fast).empty());
    }
    // max pooling forward and backward: the host's SSE scan and scatter vs the gather
    // bodies, overlapping and padded windows, with ties and a NaN.
    for (mpx::pool_options o : {mpx::pool_options{}, mpx::pool_options{3, 3, 2, 2, 1, 1}, mpx::pool_options{2, 3, 1, 1, 0, 2}}) {
      mpx::shape const xs{2, 9, 7, 5};
      auto xv = mpx_test::random_values<T>(static_cast<std::size_t>(xs.size()), -2.0, 2.0, 5);
      for (std::size_t i = 0; i < xv.size(); i += 11) xv[i] = mpx::cast<T>(1.0f);  // ties
      xv[17] = mpx::dtype_traits<T>::quiet_nan();
      auto x = mpx_test::upload(exec, xv, xs);
      mpx::shape const ys = mpx::max_pool2d_output_shape(xs, o);
      auto dy = mpx_test::upload(exec, mpx_test::random_values<T>(static_cast<std::size_t>(ys.size()), -1.0, 1.0, 6), ys);
      auto y_fast = mpx_test::poisoned<T>(exec, ys);
      auto y_slow = mpx_test::poisoned<T>(exec, ys);
      auto dx_fast = mpx_test::poisoned<T>(exec, xs);
      auto dx_slow = mpx_test::poisoned<T>(exec, xs);
      mpx::max_pool2d_forward(exec, x, y_fast, o);
      mpx::max_pool2d_backward(exec, x, y_fast, dy, dx_fast, o);
      {
        test_dispatch::element_bodies_on_host const bodies;
        mpx::max_pool2d_forward(exec, x, y_slow, o);
        mpx::max_pool2d_backward(exec, x, y_slow, dy, dx_slow, o);
      }
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, y_slow), mpx_test::download(exec, y_fast)).empty());
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dx_slow), mpx_test::download(exec, dx_fast)).empty());
    }
  });
}

TEST_CASE("a dispatch kernel's failure names the operation's body", "[dispatch]") {
  // check_dispatch_launch puts this name after the kernel's in its message.
  std::string const name = mpx::detail::type_name<mpx::detail::softmax_row<false, mpx::half, float>>();
  CHECK(name.find("softmax_row<false, __half, float>") != std::string::npos);
  CHECK(name.find('[') == std::string::npos);
}
