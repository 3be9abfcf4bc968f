// mpx::loss_scale_optimizer: Keras's LossScaleOptimizer for C++/CUDA. It wraps any mpx
// optimizer and any loss scaler: the loss gradient is multiplied by the scale, the
// gradients are unscaled and checked in one pass (clipped by global norm in unscaled
// units, if asked), the optimizer's fused step reads the verdict on the device and
// skips an overflowed step, and the scale is updated. Two passes over the gradients,
// no host synchronisation, so a whole step can be captured in a CUDA graph.
#pragma once

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <filesystem>
#include <string>
#include <type_traits>
#include <utility>

namespace mpx {

namespace detail {

//! Why `s` cannot be a state that the scaler rule `r` reached from its initial state
//! (empty when it can): what a loaded checkpoint is held to. The scale is positive,
//! finite and within the rule's bounds; the counters stay in their ranges and add up.
inline std::string impossible_counters(loss_scale_state const& s) {
  if (s.applied_steps > max_checkpoint_steps || s.skipped_steps > max_checkpoint_steps)
    return "step counts " + std::to_string(s.applied_steps) + " applied, " + std::to_string(s.skipped_steps) +
           " skipped (more than 2^53)";
  if (s.overflows_at_minimum > s.skipped_steps)
    return std::to_string(s.overflows_at_minimum) + " overflows at the minimum scale but only " +
           std::to_string(s.skipped_steps) + " skipped steps";
  if (s.last_step_skipped > 1 || (s.last_step_skipped == 1 && s.skipped_steps == 0))
    return "last_step_skipped is " + std::to_string(s.last_step_skipped) + " with " +
           std::to_string(s.skipped_steps) + " skipped steps";
  return {};
}

inline std::string impossible_scaler_state(dynamic_scale_rule const& r, loss_scale_state const& s) {
  if (!(r.min_scale > 0 && r.min_scale <= r.max_scale && is_finite(r.min_scale)) || r.growth_interval < 1 ||
      r.hysteresis < 1)
    return "its saved rule is not one a scaler accepts (min_scale " + to_text(r.min_scale) + ", max_scale " +
           to_text(r.max_scale) + ", growth_interval " + std::to_string(r.growth_interval) + ", hysteresis " +
           std::to_string(r.hysteresis) + ")";
  if (!(s.scale >= r.min_scale && s.scale <= r.max_scale) || !is_finite(s.scale))
    return "scale " + to_text(s.scale) + " (a scale is finite and within [" + to_text(r.min_scale) + ", " +
           to_text(r.max_scale) + "])";
  if (s.good_steps < 0 || s.good_steps >= r.growth_interval)
    return "good_steps " + std::to_string(s.good_steps) + " (within [0, growth_interval " +
           std::to_string(r.growth_interval) + "))";
  if (s.overflows_left < 0 || s.overflows_left > r.hysteresis)
    return "overflows_left " + std::to_string(s.overflows_left) + " (within [0, hysteresis " +
           std::to_string(r.hysteresis) + "])";
  return impossible_counters(s);
}

inline std::string impossible_scaler_state(static_scale_rule const& r, loss_scale_state const& s) {
  if (!(s.scale > 0) || !is_finite(s.scale) || s.scale != r.scale)
    return "scale " + to_text(s.scale) + " (a static scaler keeps its positive, finite scale, here " +
           to_text(r.scale) + ")";
  if (s.good_steps != 0 || s.overflows_left != loss_scale_state{}.overflows_left)
    return "good_steps " + std::to_string(s.good_steps) + ", overflows_left " + std::to_string(s.overflows_left) +
           " (a static scaler never changes them)";
  return impossible_counters(s);
}

}  // namespace detail

struct loss_scale_optimizer_options {
  //! Clip the gradients' global L2 norm to this (<= 0: no clipping). Measured after
  //! unscaling: the wrapper offers no way to clip still-scaled gradients.
  float clip_global_norm = 0;
};

namespace detail {
template <class O>
concept optimizer_like = requires(O& o) {
  o.gradients();
  o.steps_data();
  o.require_current_parameters();
  typename O::rule_type;
};
template <class S>
concept loss_scaler_like = requires(S& s) {
  s.scale_data();
  s.state_data();
  s.poll();
};
}  // namespace detail

template <class Optimizer, class Scaler>
class loss_scale_optimizer {
  static_assert(detail::optimizer_like<Optimizer>,
                "mpx::loss_scale_optimizer(optimizer, scaler, options): the first argument must be an mpx "
                "optimizer (mpx::sgd, mpx::adam, mpx::adamw)");
  static_assert(detail::loss_scaler_like<Scaler>,
                "mpx::loss_scale_optimizer(optimizer, scaler, options): the second argument must be an mpx loss "
                "scaler (mpx::dynamic_loss_scaler, mpx::static_loss_scaler)");
  static_assert(std::is_same_v<typename Optimizer::space, typename Scaler::space>,
                "mpx::loss_scale_optimizer: the optimizer and the loss scaler must run on the same executor (both "
                "host_executor, or both cuda_executor)");

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
    scaler_.scale_loss_gradient(exec, loss_gradient);
  }

  //! After backpropagation filled the (scaled) gradients: unscale and check them, clip
  //! if asked, step the optimizer unless a gradient was NaN or inf, update the scale.
  //! Enqueued only on a cuda_executor; a stuck scale is reported (see loss_scaler).
  template <class Exec>
  void step(Exec const& exec) {
    optimizer_.require_current_parameters();  // before the check reads gradients a new build freed
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
    out.add("scaler/kind", detail::text_bytes(Scaler::kind));
    out.add_value("scaler/state", scaler_.state(exec));
    out.add_value("scaler/rule", scaler_.rule());
    out.commit(path);
  }

  //! Restores a checkpoint written by save(). A missing, corrupt or mismatched file, or
  //! one holding a state its saver could not have written (a scale that is not positive
  //! and finite, counters out of range, an unknown or repeated section), is refused with
  //! mpx::checkpoint_error naming the file, before anything is changed. Synchronises.
  template <class Exec>
  void load(Exec const& exec, std::filesystem::path const& path) {
    detail::checkpoint_reader in(path, "mpx::loss_scale_optimizer");
    if (std::string const kind = in.text("scaler/kind"); kind != Scaler::kind)
      in.refuse("the checkpoint's loss scaler is a " + kind + ", this one is a " + std::string(Scaler::kind) +
                "; nothing was loaded");
    // The state is restored; the rule (growth interval, bounds) stays this scaler's, so
    // a resumed run may change it. The saved rule is what the state must agree with.
    auto state = in.value<loss_scale_state>("scaler/state");
    state.unused = 0;  // files saved before the padding had a name hold whatever it held
    auto const saved_rule = in.value<typename Scaler::rule_type>("scaler/rule");
    if (std::string const why = detail::impossible_scaler_state(saved_rule, state); !why.empty())
      in.refuse("its loss scaler state is impossible: " + why + "; the file is corrupt, nothing was loaded");
    // checks everything of its own, then that no section was left unread, before writing
    optimizer_.load(exec, in, [&] { in.refuse_unread_sections(); });
    scaler_.set_state(exec, state);
    exec.synchronize();
  }

 private:
  Optimizer optimizer_;
  Scaler scaler_;
  loss_scale_optimizer_options options_;
};

}  // namespace mpx
