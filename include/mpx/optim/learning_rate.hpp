// Learning-rate schedules: MPX_HD functors from the number of steps applied so far to a
// learning rate. The optimizer's kernel evaluates them on the device with the step count
// kept there, so a skipped step (a gradient overflowed) does not advance the schedule.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>

namespace mpx {

//! The same rate at every step.
struct constant_learning_rate {
  constexpr constant_learning_rate(float r = 1e-3f) noexcept : rate(r) {}  // NOLINT: a float is a constant rate
  float rate;
  MPX_HD float operator()(std::uint64_t /*applied_steps*/) const noexcept { return rate; }
};

//! Keras's ExponentialDecay: rate * decay_rate^(step / decay_steps), the exponent floored
//! when `staircase`.
struct exponential_decay {
  float initial_rate = 1e-3f;
  float decay_steps = 1000;
  float decay_rate = 0.96f;
  bool staircase = false;
  MPX_HD float operator()(std::uint64_t applied_steps) const noexcept {
    double e = static_cast<double>(applied_steps) / decay_steps;
    if (staircase) e = floor(e);
    return static_cast<float>(initial_rate * pow(static_cast<double>(decay_rate), e));
  }
};

//! Linear warm-up over `warmup_steps`, then Keras's CosineDecay from peak_rate down to
//! alpha * peak_rate over `decay_steps`, constant after.
struct cosine_decay {
  float peak_rate = 1e-3f;
  std::uint64_t decay_steps = 10000;
  float alpha = 0;
  std::uint64_t warmup_steps = 0;
  MPX_HD float operator()(std::uint64_t applied_steps) const noexcept {
    if (applied_steps < warmup_steps)
      return static_cast<float>(peak_rate * (static_cast<double>(applied_steps) + 1) / static_cast<double>(warmup_steps));
    double const t = static_cast<double>(applied_steps - warmup_steps);
    double const progress = decay_steps ? (t < static_cast<double>(decay_steps) ? t / static_cast<double>(decay_steps) : 1.0) : 1.0;
    double const cosine = 0.5 * (1 + cos(3.14159265358979323846 * progress));
    return static_cast<float>(peak_rate * ((1 - alpha) * cosine + alpha));
  }
};

//! Any callable that maps the applied-step count (std::uint64_t) to a float rate; MPX_HD
//! (and trivially copyable) to be usable on a cuda_executor.
template <class S>
concept learning_rate_schedule = requires(S const& s, std::uint64_t step) {
  { s(step) } -> std::convertible_to<float>;
};

namespace detail {
//! Refuses a schedule whose rate is negative, NaN or infinite at a sample of steps
//! (a negative rate climbs the loss; a NaN one poisons every weight on the first step).
//! The optimizers call it when they are built, on the host.
template <learning_rate_schedule Schedule>
void validate_learning_rate(std::string_view op, Schedule const& schedule) {
  for (std::uint64_t step : {0ull, 1ull, 2ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull}) {
    double const rate = static_cast<float>(schedule(step));
    if (!(rate >= 0) || !std::isfinite(rate))
      fail<invalid_argument>(op, "the learning rate must be finite and >= 0; at step " + std::to_string(step) +
                                     " the schedule gives " + to_text(rate));
  }
}
}  // namespace detail

}  // namespace mpx
