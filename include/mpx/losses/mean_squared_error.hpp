// Mean squared error (Keras MeanSquaredError): the mean of (prediction - target)^2 over
// every element, in float, with its gradient.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/losses/loss_value.hpp>

namespace mpx {

namespace ops {
//! (p - t)^2 and its derivative 2 (p - t).
struct squared_error {
  MPX_HD float value(float p, float t) const noexcept {
    float const d = p - t;
    return d * d;
  }
  MPX_HD float gradient(float p, float t) const noexcept { return 2.0f * (p - t); }
};
}  // namespace ops

//! Mean of (predictions - targets)^2 over every element (same shape, any rank and
//! dtypes). Writes the mean to `loss` and d(mean)/d(predictions) = 2 (p - t) / n, times
//! *scale when `scale` is given (a float in the executor's memory), to `gradient`.
//! Float arithmetic; Policy must accumulate in float. Shapes must match
//! (mpx::shape_error). Asynchronous on a cuda_executor: read the loss with loss.read(exec).
template <class Policy = float32, executor Exec, tensor_like Predictions, tensor_like Targets, tensor_like Gradient,
          memory_space Space>
void mean_squared_error(Exec const& exec, Predictions&& predictions, Targets&& targets, Gradient&& gradient,
                        loss_value<Space>& loss, float const* scale = nullptr) {
  detail::pointwise_loss<Policy>("mean_squared_error", exec, ops::squared_error{}, predictions, targets, gradient,
                                 loss, scale);
}

}  // namespace mpx
