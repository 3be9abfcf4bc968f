// mpx::sum_of_squares<Policy>: the squared L2 norm of a tensor, accumulated in the
// policy's accumulate type: the building block of global-norm gradient clipping.
// A policy that accumulates in 16 bits is refused at compile time: a sum of squares
// in half overflows once the norm passes 256.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/numerics/finite.hpp>

namespace mpx {

namespace ops {
template <class Acc>
struct square_in {
  template <class T>
  MPX_HD Acc operator()(T x) const noexcept {
    Acc const v = cast<Acc>(x);
    return v * v;
  }
};
}  // namespace ops

//! sum of x[i]^2, in Policy::accumulate_type (which must be float). NaN or inf in x
//! gives a non-finite result. Synchronises a cuda_executor's stream.
template <policy_type Policy, executor Exec, tensor_like X>
typename Policy::accumulate_type sum_of_squares(Exec const& exec, X&& x) {
  require_float_accumulation<Policy>();
  using acc = typename Policy::accumulate_type;
  return transform_reduce(exec, x, acc{0}, ops::square_in<acc>{}, ops::plus{});
}

}  // namespace mpx
