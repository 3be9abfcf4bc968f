// Standalone finite checks over one tensor: mpx::all_finite and mpx::count_nonfinite,
// on any executor (CUB on the GPU). For many gradient tensors at once, fused with
// unscaling, use the loss scaler's multi-tensor check instead.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/exec/reduce.hpp>

#include <cstddef>

namespace mpx {

namespace ops {
//! 1 for NaN or ±inf, else 0.
struct nonfinite_indicator {
  template <class T>
  MPX_HD unsigned long long operator()(T x) const noexcept {
    return is_finite(x) ? 0ull : 1ull;
  }
};
//! a + b.
struct plus {
  template <class T>
  MPX_HD T operator()(T a, T b) const noexcept {
    return a + b;
  }
};
}  // namespace ops

//! How many elements of x are NaN or ±inf. Synchronises a cuda_executor's stream.
template <executor Exec, tensor_like X>
std::size_t count_nonfinite(Exec const& exec, X&& x) {
  return static_cast<std::size_t>(transform_reduce(exec, x, 0ull, ops::nonfinite_indicator{}, ops::plus{}));
}

//! True when no element of x is NaN or ±inf (true for an empty tensor).
//! Synchronises a cuda_executor's stream.
template <executor Exec, tensor_like X>
bool all_finite(Exec const& exec, X&& x) {
  return count_nonfinite(exec, x) == 0;
}

}  // namespace mpx
