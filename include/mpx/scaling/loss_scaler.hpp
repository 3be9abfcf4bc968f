// mpx::dynamic_loss_scaler and mpx::static_loss_scaler: keep the loss scale where the
// executor computes, unscale and check a gradient list with it, and update it after
// each step, all in stream order: a CUDA training step never waits for the host. A
// scale stuck at its minimum (the gradients overflow even unscaled) is reported through
// a callback or an mpx::loss_scale_error, never left to skip every step in silence.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/transform.hpp>
#include <mpx/scaling/loss_scale_rules.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mpx {

//! Training is stuck: the loss scale is at its minimum and steps still overflow.
class loss_scale_error : public error {
 public:
  using error::error;
};

//! What a scaler tells its on_stuck callback. Every field describes the step at which
//! the run of overflows reached the rule's report_after, whenever the report is
//! delivered (on a GPU it may be delivered a few steps later): the values are final.
struct loss_scale_report {
  float scale;                 //!< the scale the overflowing steps ran at (the minimum)
  std::uint32_t consecutive;   //!< non-finite steps in a row at that scale: report_after (more only
                               //!< when a restored state was already past it)
  std::int32_t first_nonfinite;  //!< index of the first non-finite gradient of that step (-1: unknown)
  std::int32_t last_nonfinite;   //!< index of the last one: with a model's parameters, the first the
                                 //!< backward pass wrote non-finite, nearest the cause (-1: unknown)
  std::string gradient;        //!< the name of the last one in the list of the latest update, when known
  std::string message;         //!< all of the above in words, and how to find the layer
};

namespace detail {

//! Where a signal_slot keeps its stuck_signal: plain memory for the host executor; for
//! the GPU, mapped pinned memory (signal_memory<device_space>, below), which the device
//! writes through its own pointer.
template <class Space>
struct signal_memory {
  std::unique_ptr<stuck_signal> memory = std::make_unique<stuck_signal>();
  [[nodiscard]] stuck_signal* host() const noexcept { return memory.get(); }
  [[nodiscard]] stuck_signal* device() const noexcept { return memory.get(); }
};

//! A stuck_signal the device writes and the host reads without synchronising.
template <class Space>
class signal_slot {
 public:
  template <class Exec>
  explicit signal_slot(Exec const&) {
    *memory_.host() = stuck_signal{};
  }
  [[nodiscard]] stuck_signal* device() const noexcept { return memory_.device(); }
  //! The latest signal the device has written; it may lag the stream by a few steps.
  //! The device's 16-byte store need not reach host memory as one piece, so a read
  //! could mix two signals: read until two reads in a row agree (the device writes once
  //! per run of overflows, so this ends at once in practice).
  [[nodiscard]] stuck_signal read() const noexcept {
    auto once = [signal = memory_.host()] {
      std::array<std::uint32_t, 4> words;
      auto const* src = reinterpret_cast<std::uint32_t const volatile*>(signal);
      for (std::size_t i = 0; i < 4; ++i) words[i] = src[i];
      return words;
    };
    auto last = once();
    for (auto next = once(); next != last; next = once()) last = next;
    stuck_signal s;
    std::memcpy(&s, last.data(), sizeof s);
    return s;
  }

 private:
  signal_memory<Space> memory_;
};

#if MPX_HAS_CUDA_RUNTIME
template <>
struct signal_memory<device_space> {
  pinned_buffer<stuck_signal> memory{1, pinned_mapping::mapped};
  stuck_signal* device_pointer = memory.device_pointer();
  [[nodiscard]] stuck_signal* host() const noexcept { return memory.data(); }
  [[nodiscard]] stuck_signal* device() const noexcept { return device_pointer; }
};
#endif

}  // namespace detail

namespace ops {
//! x * (*factor), the factor read where the executor computes (a loss scale).
template <class T>
struct multiply_by_resident {
  float const* factor;
  MPX_HD T operator()(T x) const noexcept { return cast<T>(cast<float>(x) * *factor); }
};
}  // namespace ops

//! A loss scaler following Rule (dynamic_scale_rule or static_scale_rule) on Exec.
//! Use dynamic_loss_scaler or static_loss_scaler; this is what they share.
template <executor Exec, class Rule>
class loss_scaler {
 public:
  using space = memory_space_t<Exec>;
  using rule_type = Rule;

  loss_scaler(Exec const& exec, Rule rule) : rule_(rule), state_(exec, rule.initial_state()), signal_(exec) {
    if (!(rule.initial_state().scale > 0) || !is_finite(rule.initial_state().scale))
      detail::fail<invalid_argument>("loss_scaler", "the loss scale must be positive and finite, got " +
                                                        detail::to_text(rule.initial_state().scale));
    if (rule.report_after < 1) detail::fail<invalid_argument>("loss_scaler", "report_after must be at least 1");
  }

  [[nodiscard]] Rule const& rule() const noexcept { return rule_; }
  //! Where kernels find the current scale (to scale a loss gradient on the device).
  [[nodiscard]] float const* scale_data() const noexcept { return &state_.get()->scale; }
  [[nodiscard]] loss_scale_state* state_data() const noexcept { return state_.get(); }

  //! The current scale. Synchronises a cuda_executor.
  [[nodiscard]] float scale(Exec const& exec) const { return state(exec).scale; }
  //! The whole state (scale, counters). Synchronises a cuda_executor.
  [[nodiscard]] loss_scale_state state(Exec const& exec) const { return state_.read(exec); }
  //! Replaces the state (restoring a checkpoint), in stream order.
  void set_state(Exec const& exec, loss_scale_state const& s) { state_.write(exec, s); }

  //! Multiplies the loss's gradient (where backpropagation starts) by the current scale,
  //! in place, reading the scale where the executor computes: no synchronisation.
  template <tensor_like G>
  void scale_loss_gradient(Exec const& exec, G&& loss_gradient) const {
    transform(exec, loss_gradient, ops::multiply_by_resident<value_t<G>>{scale_data()}, loss_gradient);
  }

  //! Divides the gradients by the current scale (or defers it) and checks them (see
  //! mpx::unscale_and_check).
  void unscale_and_check(Exec const& exec, gradient_list<Exec>& gradients, float max_norm = 0,
                         unscaling mode = unscaling::in_place) const {
    mpx::unscale_and_check(exec, gradients, scale_data(), max_norm, mode);
  }

  //! Ends a step: applies the rule to the verdict of gradients' last check, and advances
  //! *optimizer_steps (in this space) when the step was applied. Enqueued only; then
  //! reports a stuck scale if the device has signalled one (see poll): on the host
  //! executor at the very step that reached report_after, on a GPU possibly some steps
  //! later, with the same report.
  void update(Exec const& exec, gradient_list<Exec> const& gradients, std::uint64_t* optimizer_steps = nullptr) {
    if (&gradients.names() != names_source_) {  // a copy: poll() may run after the list moved
      names_ = gradients.names();
      names_source_ = &gradients.names();
    }
    detail::finish_step_pass(exec, rule_, state_.get(), gradients.summary_data(), optimizer_steps, signal_.device());
    poll();
  }

  //! What to do when the scale is stuck at its minimum and still overflows (by default
  //! update() throws mpx::loss_scale_error).
  void on_stuck(std::function<void(loss_scale_report const&)> callback) { on_stuck_ = std::move(callback); }

  //! Reports a stuck scale that the device has signalled, without waiting for the GPU.
  //! update() calls it; call it between replays of a captured CUDA graph.
  //! Guarantees: each run of overflows at the minimum is reported at most once, and its
  //! report (loss_scale_report) describes the step at which the run reached
  //! report_after, however late it is read. On a GPU the signal may not have arrived
  //! yet: after exec.synchronize(), poll() reports every run that had reached
  //! report_after (only the latest, if several did since the previous poll).
  void poll() {
    detail::stuck_signal const s = signal_.read();
    if (s.consecutive < rule_.report_after || (reported_ && s.streak == reported_streak_)) return;
    reported_ = true;
    reported_streak_ = s.streak;
    loss_scale_report report{s.scale, s.consecutive, s.first_nonfinite, s.last_nonfinite, {}, {}};
    if (s.last_nonfinite >= 0 && static_cast<std::size_t>(s.last_nonfinite) < names_.size())
      report.gradient = names_[static_cast<std::size_t>(s.last_nonfinite)];
    report.message = "the loss scale is at its minimum (" + detail::to_text(s.scale) + ") and " +
                     std::to_string(s.consecutive) +
                     " step(s) in a row still produced NaN or inf gradients" +
                     (report.gradient.empty() ? std::string()
                                              : " (the first the backward pass wrote: '" + report.gradient + "')") +
                     ": they are not finite even unscaled, so the batches hold NaN or inf or the model itself "
                     "diverged. To find which, and the layer and the operation, run mpx::find_nonfinite(exec, model) "
                     "after a forward and backward on such a batch (it names \"(model input)\" when the input "
                     "already was). Then clean the inputs, lower the learning rate, keep softmax, norms and losses in "
                     "float32";
    if (on_stuck_) on_stuck_(report);
    else detail::fail<loss_scale_error>("loss_scaler", report.message);
  }

 private:
  Rule rule_;
  resident<loss_scale_state, space> state_;
  detail::signal_slot<space> signal_;
  std::function<void(loss_scale_report const&)> on_stuck_;
  std::vector<std::string> names_;  // of the gradients of the latest update
  void const* names_source_ = nullptr;
  bool reported_ = false;
  std::uint32_t reported_streak_ = 0;
};

//! Finds the largest scale that does not overflow (Keras's defaults unless told;
//! pytorch_grad_scaler() for PyTorch's).
template <executor Exec>
class dynamic_loss_scaler : public loss_scaler<Exec, dynamic_scale_rule> {
 public:
  static constexpr std::string_view kind = "mpx::dynamic_loss_scaler";
  explicit dynamic_loss_scaler(Exec const& exec, dynamic_scale_rule rule = keras_loss_scale())
      : loss_scaler<Exec, dynamic_scale_rule>(exec, validated(rule)) {}

 private:
  static dynamic_scale_rule validated(dynamic_scale_rule const& r) {
    auto bad = [](std::string what) { detail::fail<invalid_argument>("dynamic_loss_scaler", what); };
    if (!(r.growth_factor >= 1)) bad("growth_factor must be >= 1, got " + detail::to_text(r.growth_factor));
    if (!(r.backoff_factor > 0 && r.backoff_factor <= 1))
      bad("backoff_factor must be in (0, 1], got " + detail::to_text(r.backoff_factor));
    if (r.growth_interval < 1) bad("growth_interval must be >= 1, got " + std::to_string(r.growth_interval));
    if (r.hysteresis < 1) bad("hysteresis must be >= 1, got " + std::to_string(r.hysteresis));
    if (!(r.min_scale > 0 && r.min_scale <= r.initial_scale && r.initial_scale <= r.max_scale))
      bad("need 0 < min_scale <= initial_scale <= max_scale, got " + detail::to_text(r.min_scale) + ", " +
          detail::to_text(r.initial_scale) + ", " + detail::to_text(r.max_scale));
    return r;
  }
};

//! A fixed scale; non-finite steps are still skipped and a long run of them reported.
template <executor Exec>
class static_loss_scaler : public loss_scaler<Exec, static_scale_rule> {
 public:
  static constexpr std::string_view kind = "mpx::static_loss_scaler";
  static_loss_scaler(Exec const& exec, float scale, std::uint32_t report_after = static_scale_rule{}.report_after)
      : loss_scaler<Exec, static_scale_rule>(exec, static_scale_rule{scale, report_after}) {}
};

//! Whether a policy's gradients need a loss scale: those stored in float16, whose
//! smallest normal value (6.1e-5) small gradients fall below. bfloat16 and float32
//! have float32's range, as Keras and PyTorch's autocast assume.
template <policy_type P>
inline constexpr bool needs_loss_scaling = std::is_same_v<typename P::storage_type, half>;

//! The scaler a policy calls for, so one training loop serves every policy (PyTorch's
//! GradScaler(enabled=...)): a dynamic_loss_scaler with `rule` where the policy needs
//! loss scaling, else a static_loss_scaler at 1, which scales nothing but still skips a
//! step whose gradients hold NaN or inf and reports a run of them.
template <policy_type P, executor Exec>
auto loss_scaler_for(Exec const& exec, dynamic_scale_rule rule = keras_loss_scale()) {
  if constexpr (needs_loss_scaling<P>) return dynamic_loss_scaler<Exec>(exec, rule);
  else return static_loss_scaler<Exec>(exec, 1.0f);
}

}  // namespace mpx
