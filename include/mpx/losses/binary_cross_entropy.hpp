// Binary cross-entropy from logits (Keras BinaryCrossentropy(from_logits=True)): the
// mean over every element, in float, in the form that stays finite for any logit.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/losses/loss_value.hpp>

#include <cmath>

namespace mpx {

namespace ops {
//! loss(x, z) = max(x, 0) - x z + log1p(exp(-|x|)), the logistic loss of logit x and
//! target z in [0, 1]; d/dx = sigmoid(x) - z, sigmoid in the form that cannot overflow.
struct binary_cross_entropy_from_logits {
  MPX_HD float value(float x, float z) const noexcept {
    return (x > 0.0f ? x : 0.0f) - x * z + ::log1pf(exp_float(-::fabsf(x)));
  }
  MPX_HD float gradient(float x, float z) const noexcept {
    float const e = exp_float(-::fabsf(x));  // in (0, 1]: no overflow for any x
    float const s = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    return s - z;
  }
};
}  // namespace ops

//! Binary cross-entropy of `logits` against `targets` (same shape, any rank; targets in
//! [0, 1], any dtype), averaged over every element (Keras's default reduction for equal
//! rows). Writes the mean to `loss` and d(mean)/d(logits), times *scale when `scale` is
//! given (a float in the executor's memory, e.g. loss_scale_optimizer::scale_data()),
//! to `gradient`. Float arithmetic; Policy must accumulate in float. Shapes must match
//! (mpx::shape_error). Asynchronous on a cuda_executor: read the loss with loss.read(exec).
template <class Policy = float32, executor Exec, tensor_like Logits, tensor_like Targets, tensor_like Gradient,
          memory_space Space>
void binary_cross_entropy(Exec const& exec, Logits&& logits, Targets&& targets, Gradient&& gradient,
                          loss_value<Space>& loss, float const* scale = nullptr) {
  detail::pointwise_loss<Policy>("binary_cross_entropy", exec, ops::binary_cross_entropy_from_logits{}, logits,
                                 targets, gradient, loss, scale);
}

}  // namespace mpx
