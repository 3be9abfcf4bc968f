// mpx's standalone checks as Thrust algorithms, for data that already lives in Thrust's
// containers or behind its iterators, under any of its execution policies (thrust::host,
// thrust::device, thrust::cuda::par_nosync.on(stream), thrust::cpp::par, ...):
// mpx::count_nonfinite, mpx::all_finite, mpx::stats and mpx::sum_of_squares over
// [first, last). Each element goes through the same functions as on an mpx executor
// (finite.hpp, stats.hpp, sum_of_squares.hpp), so counts, extremes and verdicts are the
// same, exactly; a sum of squares is summed in Thrust's order (on Thrust's default host
// system one element after another, so its error grows with the length, where mpx's host
// executor sums in chunks). Each is a reduction whose result comes back to the host: on
// the CUDA system it waits for the stream. thrust::device and thrust::cuda need nvcc.
//
// Not included by <mpx/mpx.hpp>, which has the same checks on its executors (they are
// Thrust algorithms too, under the executor's policy): this header adds the forms that
// take a Thrust policy and a range.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/numerics/finite.hpp>
#include <mpx/numerics/stats.hpp>
#include <mpx/numerics/sum_of_squares.hpp>

#include <thrust/execution_policy.h>
#include <thrust/transform_reduce.h>
#include <thrust/type_traits/is_execution_policy.h>

#include <cstddef>
#include <iterator>
#include <type_traits>

namespace mpx {

//! One of Thrust's execution policies (thrust::host, thrust::device, thrust::cuda::par...).
template <class P>
concept thrust_execution_policy = thrust::is_execution_policy_v<std::remove_cvref_t<P>>;

namespace detail {

//! The element type of a Thrust range, which must be one of mpx's dtypes.
template <class It>
using thrust_element_t = std::remove_cv_t<typename std::iterator_traits<It>::value_type>;

//! `f` of each element taken as a T: a device_vector's iterator yields a reference
//! wrapper, which the element functions must not see.
template <class T, class F>
struct as_element {
  F f;
  template <class R>
  MPX_HD auto operator()(R const& r) const {
    return f(static_cast<T>(r));
  }
};

//! Whether [first, last) holds one of mpx's dtypes, as the checks need.
template <class It>
inline constexpr bool holds_a_dtype = dtype<thrust_element_t<It>>;

}  // namespace detail

//! How many elements of [first, last) are NaN or ±inf.
template <thrust_execution_policy Policy, class It>
std::size_t count_nonfinite(Policy&& policy, It first, It last) {
  static_assert(detail::holds_a_dtype<It>,
                "mpx::count_nonfinite: the range must hold one of mpx's dtypes (half, bfloat16, float, fp8...)");
  using T = detail::thrust_element_t<It>;
  return static_cast<std::size_t>(thrust::transform_reduce(
      policy, first, last, detail::as_element<T, ops::nonfinite_indicator>{{}}, 0ull, ops::plus{}));
}

//! True when no element of [first, last) is NaN or ±inf (true for an empty range).
template <thrust_execution_policy Policy, class It>
bool all_finite(Policy&& policy, It first, It last) {
  return count_nonfinite(policy, first, last) == 0;
}

//! The numerics of [first, last) in one pass, as mpx::stats(exec, x).
template <thrust_execution_policy Policy, class It>
numerics_stats stats(Policy&& policy, It first, It last) {
  static_assert(detail::holds_a_dtype<It>,
                "mpx::stats: the range must hold one of mpx's dtypes (half, bfloat16, float, fp8...)");
  using T = detail::thrust_element_t<It>;
  return detail::to_numerics_stats(thrust::transform_reduce(policy, first, last,
                                                            detail::as_element<T, detail::stats_of_element>{{}},
                                                            detail::stats_identity, detail::combine_stats{}));
}

//! The sum of x^2 over [first, last) in P::accumulate_type (which must be float), as
//! mpx::sum_of_squares<P>(exec, x), summed in Thrust's order.
template <policy_type P, thrust_execution_policy Policy, class It>
typename P::accumulate_type sum_of_squares(Policy&& policy, It first, It last) {
  require_float_accumulation<P>();
  static_assert(detail::holds_a_dtype<It>,
                "mpx::sum_of_squares: the range must hold one of mpx's dtypes (half, bfloat16, float, fp8...)");
  using T = detail::thrust_element_t<It>;
  using acc = typename P::accumulate_type;
  return thrust::transform_reduce(policy, first, last, detail::as_element<T, ops::square_in<acc>>{{}}, acc{0},
                                  ops::plus{});
}

}  // namespace mpx
