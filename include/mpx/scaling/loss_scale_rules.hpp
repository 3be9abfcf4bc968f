// The rules that update a loss scaler's state (mpx::loss_scale_state, defined in
// kernels/loss_scale_update.hpp beside the pass that applies them) after each step.
// Plain data and MPX_HD functions, so the host and the GPU run the same code and make
// the same decision at every step. Presets reproduce Keras's LossScaleOptimizer and
// PyTorch's GradScaler (docs/loss_scaling.md states both rules).
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/kernels/loss_scale_update.hpp>

#include <cstdint>
#include <limits>

namespace mpx {

namespace detail {
//! The counts every rule keeps: the step skipped or applied, and the run of non-finite
//! steps at the rule's floor (`at_floor`: the scale can go no lower), which the scaler
//! reports after report_after of them.
MPX_HD constexpr void count_step(loss_scale_state& s, bool found_nonfinite, bool at_floor) noexcept {
  s.last_step_skipped = found_nonfinite ? 1u : 0u;
  if (found_nonfinite) {
    ++s.skipped_steps;
    s.overflows_at_minimum = at_floor ? s.overflows_at_minimum + 1 : 0u;
  } else {
    ++s.applied_steps;
    s.overflows_at_minimum = 0;
  }
}
}  // namespace detail

//! A dynamic scale: grow after `growth_interval` finite steps in a row, back off when a
//! step overflows, skip that step, stay within [min_scale, max_scale].
struct dynamic_scale_rule {
  float initial_scale = 32768.0f;  //!< 2^15, Keras's default
  float growth_factor = 2.0f;      //!< applied after growth_interval consecutive finite steps
  float backoff_factor = 0.5f;     //!< applied on a non-finite step (once hysteresis is used up)
  std::int32_t growth_interval = 2000;
  float min_scale = 1.0f;  //!< the scale never backs off below this; overflowing here is reported
  float max_scale = std::numeric_limits<float>::max();
  //! Non-finite steps tolerated before backing off; 1 backs off at once. The allowance
  //! is restored when the scale grows (Megatron-LM's rule).
  std::int32_t hysteresis = 1;
  //! Consecutive non-finite steps at min_scale after which the scaler reports that
  //! training is stuck (see loss_scaler::on_stuck). One overflow at the floor can be a
  //! spike; ten in a row means the gradients are not finite even unscaled.
  std::uint32_t report_after = 10;

  [[nodiscard]] MPX_HD constexpr loss_scale_state initial_state() const noexcept {
    loss_scale_state s;
    s.scale = initial_scale;
    s.overflows_left = hysteresis;
    return s;
  }

  MPX_HD constexpr void update(loss_scale_state& s, bool found_nonfinite) const noexcept {
    detail::count_step(s, found_nonfinite, s.scale <= min_scale);
    if (found_nonfinite) {
      s.good_steps = 0;
      if (s.overflows_left > 0) --s.overflows_left;
      if (s.overflows_left == 0) {
        float const reduced = s.scale * backoff_factor;
        s.scale = reduced > min_scale ? reduced : min_scale;
      }
      return;
    }
    if (++s.good_steps < growth_interval) return;
    s.good_steps = 0;
    s.overflows_left = hysteresis;
    // Grow only to a finite scale (both references do), and never past max_scale.
    float const grown = s.scale * growth_factor;
    if (is_finite(grown)) s.scale = grown < max_scale ? grown : max_scale;
  }
};

//! A fixed scale. Non-finite steps are still detected and skipped, and a run of
//! `report_after` of them in a row is reported: a fixed scale cannot adapt.
struct static_scale_rule {
  float scale = 1.0f;
  std::uint32_t report_after = 10;

  [[nodiscard]] MPX_HD constexpr loss_scale_state initial_state() const noexcept {
    loss_scale_state s;
    s.scale = scale;
    return s;
  }
  MPX_HD constexpr void update(loss_scale_state& s, bool found_nonfinite) const noexcept {
    detail::count_step(s, found_nonfinite, true);  // a fixed scale is always at its floor
  }
};

//! Keras's tf.keras.mixed_precision.LossScaleOptimizer (dynamic): start at 2^15,
//! double after 2000 finite steps in a row, halve (not below 1) and skip on a
//! non-finite step.
constexpr dynamic_scale_rule keras_loss_scale() noexcept { return {}; }

//! PyTorch's torch.amp.GradScaler defaults: start at 2^16, double after 2000 finite
//! steps in a row, halve and skip on a non-finite step. PyTorch sets no floor; this
//! preset stops at the smallest normal float (2^-126) and reports there, where
//! training stopped long before.
constexpr dynamic_scale_rule pytorch_grad_scaler() noexcept {
  dynamic_scale_rule r;
  r.initial_scale = 65536.0f;
  r.min_scale = std::numeric_limits<float>::min();
  return r;
}

}  // namespace mpx
