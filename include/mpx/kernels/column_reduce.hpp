// mpx::column_sum: the sum over the rows of every column, on any executor, through the
// executor's column reduction (exec/columns.hpp).
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/columns.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>

#include <cstddef>
#include <type_traits>

namespace mpx {

//! y[j] = sum over the rows of x[..., j]: x of shape [..., cols] (row-major; every axis
//! but the last is a row), y of shape [cols]. Summed in Policy's accumulate type (which
//! must be float: a 16-bit running sum loses its small terms), rounded once to y's dtype.
//! Deterministic: the same bits run after run (see the note at the top of this header).
//! Asynchronous on a cuda_executor. Shape mismatches throw mpx::shape_error.
template <class Policy = float32, executor Exec, tensor_like X, tensor_like Y>
void column_sum(Exec const& exec, X&& x, Y&& y) {
  require_float_accumulation<Policy>();
  using acc_t = typename Policy::accumulate_type;
  auto [xv, yv] = detail::views_for<Exec>(x, y);
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::column_sum: y is an output");
  shape const& xs = xv.shape();
  if (xs.rank() < 1 || yv.shape().rank() != 1 || yv.shape()[0] != xs[xs.rank() - 1])
    detail::fail<shape_error>("column_sum", "y of shape " + yv.shape().to_string() +
                                                " does not match the last axis of x of shape " + xs.to_string() +
                                                " (y must be rank 1, as long as x's last axis)");
  auto const cols = static_cast<std::size_t>(xs[xs.rank() - 1]);
  std::size_t const rows = cols ? xs.size() / cols : 0;
  using x_t = value_t<X>;
  using y_t = value_t<Y>;
  detail::column_reduce<1, acc_t>(exec, detail::column_values_of<acc_t, x_t>{xv.data(), cols},
                                  detail::store_sum_as<acc_t, y_t>{yv.data()}, rows, cols);
}

}  // namespace mpx
