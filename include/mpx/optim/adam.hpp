// mpx::adam and mpx::adamw: Adam with bias correction, with L2 weight decay folded into
// the gradient (adam, as torch.optim.Adam) or decoupled from it (adamw, as
// torch.optim.AdamW: w -= lr * weight_decay * w before the Adam step), applied to float
// master weights (or to the 16-bit values themselves, see mpx::master_weight_options).
// See optim/optimizer.hpp for what all optimizers share.
#pragma once

#include <mpx/optim/learning_rate.hpp>
#include <mpx/optim/optimizer.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace mpx {

struct adam_options {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;  //!< added to sqrt(v_hat), as PyTorch does (Keras adds it to sqrt(v), default 1e-7)
  float weight_decay = 0;
};

//! AdamW's options: Adam's, with PyTorch's AdamW default decay of 0.01 (a separate type,
//! so that `{.beta2 = 0.99f}` keeps the 0.01 instead of silently dropping it to 0).
struct adamw_options {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.01f;  //!< decoupled: w -= lr * weight_decay * w before the Adam step
  [[nodiscard]] constexpr adam_options as_adam() const noexcept { return {beta1, beta2, epsilon, weight_decay}; }
};

//! The Adam update of one element; Decoupled selects AdamW's weight decay.
template <learning_rate_schedule Schedule, bool Decoupled>
struct adam_rule {
  static constexpr int slots = 2;
  static constexpr char const* slot_names[] = {"first moment", "second moment"};
  Schedule learning_rate;
  adam_options options;

  struct constants {
    float lr;
    float step_size;           // lr / (1 - beta1^t)
    float inverse_sqrt_bias2;  // 1 / sqrt(1 - beta2^t)
  };
  [[nodiscard]] MPX_HD bool uses_slot(int) const noexcept { return true; }
  [[nodiscard]] MPX_HD constants at(std::uint64_t step) const noexcept {
    double const t = static_cast<double>(step);
    double const bias1 = 1 - pow(static_cast<double>(options.beta1), t);
    double const bias2 = 1 - pow(static_cast<double>(options.beta2), t);
    float const lr = static_cast<float>(learning_rate(step - 1));
    return {lr, static_cast<float>(lr / bias1), static_cast<float>(1 / sqrt(bias2))};
  }
  MPX_HD void operator()(constants const& c, float& w, float g, float* slot) const noexcept {
    // Products through mul_rn: no FMA, so the host and the GPU agree bit for bit.
    if (options.weight_decay != 0) {
      if constexpr (Decoupled) w -= mul_rn(mul_rn(c.lr, options.weight_decay), w);
      else g += mul_rn(options.weight_decay, w);
    }
    float& m = slot[0];
    float& v = slot[1];
    m += mul_rn(1 - options.beta1, g - m);
    v = mul_rn(options.beta2, v) + mul_rn(mul_rn(1 - options.beta2, g), g);
    w -= mul_rn(c.step_size, m) / (mul_rn(sqrtf(v), c.inverse_sqrt_bias2) + options.epsilon);
  }
};

namespace detail {
inline void validate_adam(std::string_view op, adam_options const& o) {
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1))
    fail<invalid_argument>(op, "beta1 and beta2 must lie in [0, 1), got " + to_text(o.beta1) + " and " +
                                   to_text(o.beta2));
  if (!(o.epsilon > 0)) fail<invalid_argument>(op, "epsilon must be > 0, got " + to_text(o.epsilon));
  // A NaN or inf decay poisons every weight at the first step, as a NaN learning rate
  // would; PyTorch refuses a negative one.
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
    fail<invalid_argument>(op, "weight_decay must be finite and >= 0, got " + to_text(o.weight_decay));
}
}  // namespace detail

template <executor Exec, learning_rate_schedule Schedule = constant_learning_rate>
class adam : public detail::optimizer_core<Exec, adam_rule<Schedule, false>> {
  using core = detail::optimizer_core<Exec, adam_rule<Schedule, false>>;

 public:
  adam(Exec const& exec, std::vector<parameter<memory_space_t<Exec>>> params, Schedule learning_rate,
       adam_options options = {}, master_weight_options masters = {})
      : core(exec, std::move(params), (detail::validate_adam("adam", options), adam_rule<Schedule, false>{learning_rate, options}),
             "adam", masters) {}
};

template <executor Exec, learning_rate_schedule Schedule = constant_learning_rate>
class adamw : public detail::optimizer_core<Exec, adam_rule<Schedule, true>> {
  using core = detail::optimizer_core<Exec, adam_rule<Schedule, true>>;

 public:
  adamw(Exec const& exec, std::vector<parameter<memory_space_t<Exec>>> params, Schedule learning_rate,
        adamw_options options = {}, master_weight_options masters = {})
      : core(exec, std::move(params),
             (detail::validate_adam("adamw", options.as_adam()), adam_rule<Schedule, true>{learning_rate, options.as_adam()}),
             "adamw", masters) {}
};

template <executor Exec, class P>
adam(Exec const&, P, float, adam_options = {}, master_weight_options = {}) -> adam<Exec, constant_learning_rate>;
template <executor Exec, class P, learning_rate_schedule S>
adam(Exec const&, P, S, adam_options = {}, master_weight_options = {}) -> adam<Exec, S>;
template <executor Exec, class P>
adamw(Exec const&, P, float, adamw_options = {}, master_weight_options = {}) -> adamw<Exec, constant_learning_rate>;
template <executor Exec, class P, learning_rate_schedule S>
adamw(Exec const&, P, S, adamw_options = {}, master_weight_options = {}) -> adamw<Exec, S>;

}  // namespace mpx
