// mpx::sgd: stochastic gradient descent with optional momentum (heavy-ball or Nesterov),
// dampening and L2 weight decay, exactly as PyTorch's torch.optim.SGD defines them,
// applied to float master weights (or to the 16-bit values themselves, see
// mpx::master_weight_options). See optim/optimizer.hpp for what all optimizers share.
#pragma once

#include <mpx/optim/learning_rate.hpp>
#include <mpx/optim/optimizer.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace mpx {

struct sgd_options {
  float momentum = 0;      //!< 0: plain SGD; the momentum buffer is only kept when > 0
  float dampening = 0;     //!< scales the new gradient's share of the momentum buffer by (1 - dampening)
  float weight_decay = 0;  //!< L2 penalty: g += weight_decay * w
  bool nesterov = false;   //!< g + momentum * buffer instead of the buffer (needs momentum > 0)
};

//! The SGD update of one element. Step t = 1, 2, ... counts applied steps.
template <learning_rate_schedule Schedule>
struct sgd_rule {
  static constexpr int slots = 1;
  static constexpr char const* slot_names[] = {"momentum buffer"};
  Schedule learning_rate;
  sgd_options options;

  struct constants {
    float lr;
    bool first;  // PyTorch starts the buffer at the first gradient, not at zero
  };
  [[nodiscard]] MPX_HD bool uses_slot(int) const noexcept { return options.momentum != 0; }
  [[nodiscard]] MPX_HD constants at(std::uint64_t step) const noexcept {
    return {static_cast<float>(learning_rate(step - 1)), step == 1};
  }
  MPX_HD void operator()(constants const& c, float& w, float g, float* slot) const noexcept {
    // Products through mul_rn: no FMA, so the host and the GPU agree bit for bit.
    if (options.weight_decay != 0) g += mul_rn(options.weight_decay, w);
    if (options.momentum != 0) {
      float& buffer = slot[0];
      buffer = c.first ? g : mul_rn(options.momentum, buffer) + mul_rn(1 - options.dampening, g);
      g = options.nesterov ? g + mul_rn(options.momentum, buffer) : buffer;
    }
    w -= mul_rn(c.lr, g);
  }
};

template <executor Exec, learning_rate_schedule Schedule = constant_learning_rate>
class sgd : public detail::optimizer_core<Exec, sgd_rule<Schedule>> {
  using core = detail::optimizer_core<Exec, sgd_rule<Schedule>>;

 public:
  sgd(Exec const& exec, std::vector<parameter<memory_space_t<Exec>>> params, Schedule learning_rate,
      sgd_options options = {}, master_weight_options masters = {})
      : core(exec, std::move(params), validated(learning_rate, options), "sgd", masters) {}

 private:
  static sgd_rule<Schedule> validated(Schedule s, sgd_options const& o) {
    if (o.nesterov && !(o.momentum > 0 && o.dampening == 0))
      detail::fail<invalid_argument>("sgd", "Nesterov momentum needs momentum > 0 and dampening 0");
    if (!(o.momentum >= 0)) detail::fail<invalid_argument>("sgd", "momentum must be >= 0");
    // Used in every step's arithmetic: a NaN or inf here poisons every weight at once,
    // as a NaN learning rate would (PyTorch refuses a negative weight_decay too).
    if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
      detail::fail<invalid_argument>("sgd", "weight_decay must be finite and >= 0, got " + detail::to_text(o.weight_decay));
    if (!std::isfinite(o.dampening))
      detail::fail<invalid_argument>("sgd", "dampening must be finite, got " + detail::to_text(o.dampening));
    return {s, o};
  }
};

template <executor Exec, class P>
sgd(Exec const&, P, float, sgd_options = {}, master_weight_options = {}) -> sgd<Exec, constant_learning_rate>;
template <executor Exec, class P, learning_rate_schedule S>
sgd(Exec const&, P, S, sgd_options = {}, master_weight_options = {}) -> sgd<Exec, S>;

}  // namespace mpx
