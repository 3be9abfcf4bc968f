// mpx::loss_scale_optimizer: Keras's LossScaleOptimizer for C++/CUDA. It wraps any mpx
// optimizer and any loss scaler: the loss gradient is multiplied by the scale, the
// gradients are unscaled and checked in one pass (clipped by global norm in unscaled
// units, if asked), the optimizer's fused step reads the verdict on the device and
// skips an overflowed step, and the scale is updated. Two passes over the gradients,
// no host synchronisation, so a whole step can be captured in a CUDA graph.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/optim/checkpoint_file.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>

namespace mpx {

namespace ops {
//! x * (*factor), the factor read where the executor computes (a loss scale).
template <class T>
struct multiply_by_resident {
  float const* factor;
  MPX_HD T operator()(T x) const noexcept { return cast<T>(cast<float>(x) * *factor); }
};
}  // namespace ops

struct loss_scale_optimizer_options {
  //! Clip the gradients' global L2 norm to this (<= 0: no clipping). Measured after
  //! unscaling: the wrapper offers no way to clip still-scaled gradients.
  float clip_global_norm = 0;
};

template <class Optimizer, class Scaler>
class loss_scale_optimizer {
 public:
  //! Takes over the optimizer and the scaler (reach them with optimizer() and scaler()).
  loss_scale_optimizer(Optimizer optimizer, Scaler scaler, loss_scale_optimizer_options options = {})
      : optimizer_(std::move(optimizer)), scaler_(std::move(scaler)), options_(options) {}

  //! The current loss scale, where the executor computes: pass it to a loss that scales
  //! its gradient itself.
  [[nodiscard]] float const* scale_data() const noexcept { return scaler_.scale_data(); }

  //! Multiplies the gradient of the loss (the start of backpropagation) by the scale,
  //! in place, on the executor.
  template <class Exec, tensor_like G>
  void scale_loss_gradient(Exec const& exec, G&& loss_gradient) const {
    transform(exec, loss_gradient, ops::multiply_by_resident<value_t<G>>{scaler_.scale_data()}, loss_gradient);
  }

  //! After backpropagation filled the (scaled) gradients: unscale and check them, clip
  //! if asked, step the optimizer unless a gradient was NaN or inf, update the scale.
  //! Enqueued only on a cuda_executor; a stuck scale is reported (see loss_scaler).
  template <class Exec>
  void step(Exec const& exec) {
    auto& gradients = optimizer_.gradients();
    // Deferred: the optimizer unscales as it reads, in float, so a 16-bit gradient
    // never underflows on the way back (and this pass only reads).
    scaler_.unscale_and_check(exec, gradients, options_.clip_global_norm, unscaling::deferred);
    optimizer_.apply(exec, gradients.summary_data());
    scaler_.update(exec, gradients, optimizer_.steps_data());
  }

  [[nodiscard]] Optimizer& optimizer() noexcept { return optimizer_; }
  [[nodiscard]] Optimizer const& optimizer() const noexcept { return optimizer_; }
  [[nodiscard]] Scaler& scaler() noexcept { return scaler_; }
  [[nodiscard]] Scaler const& scaler() const noexcept { return scaler_; }

  //! The verdict of the latest step (skipped?, which gradient, the norm). Synchronises.
  template <class Exec>
  [[nodiscard]] gradient_summary last_check(Exec const& exec) const {
    return optimizer_.gradients().summary(exec);
  }

  //! Writes optimizer, master weights and scaler state to `path` atomically (see
  //! checkpoint_file.hpp). Synchronises.
  template <class Exec>
  void save(Exec const& exec, std::filesystem::path const& path) const {
    detail::checkpoint_writer out("mpx::loss_scale_optimizer");
    optimizer_.save(exec, out);
    out.add_value("scaler/state", scaler_.state(exec));
    out.add_value("scaler/rule", scaler_.rule());
    out.commit(path);
  }

  //! Restores a checkpoint written by save(). A missing, corrupt or mismatched file is
  //! refused with mpx::checkpoint_error before anything is changed. Synchronises.
  template <class Exec>
  void load(Exec const& exec, std::filesystem::path const& path) {
    detail::checkpoint_reader in(path, "mpx::loss_scale_optimizer");
    auto const state = in.value<loss_scale_state>("scaler/state");
    static_cast<void>(in.section("scaler/rule", sizeof(typename Scaler::rule_type)));
    optimizer_.load(exec, in);  // checks everything of its own before writing
    scaler_.set_state(exec, state);
    exec.synchronize();
  }

 private:
  Optimizer optimizer_;
  Scaler scaler_;
  loss_scale_optimizer_options options_;
};

}  // namespace mpx
