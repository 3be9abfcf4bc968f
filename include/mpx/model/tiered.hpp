// mpx::tiered<Layer, P1, P2, ...>: one layer that can run under a chain of policies,
// cheapest first, with one parameter set. It starts in P1; a precision guard
// (model/precision_guard.hpp) moves it one tier up when the evidence says P1 fails it:
//
//   mpx::sequential<mpx::mixed_float16>(
//       ...,
//       mpx::tiered<mpx::causal_self_attention, mpx::model_policy, mpx::mixed_bfloat16>(heads),
//       ...)
//
// (mpx::model_policy as P1 takes the model's policy.) The layer reads and writes P1's
// storage dtype whatever its tier, so its neighbours and the model's buffers never
// change. Its parameters, the ones the optimizer holds master copies of, are P1's. Under
// a higher tier Pk, each forward casts them into Pk's copy of the layer, and the input
// into Pk's dtype; Pk computes; the output, the input gradient and the weight gradients
// are cast back into P1's. So a move changes how the layer computes (the range of its
// intermediate values, such as attention logits, and the dtypes its products read), not
// what the optimizer holds: the weights a higher tier computes with are P1's storage
// values. Every tier is built and reserved together (a move allocates nothing), and each
// keeps its own state (fp8 scales, counters), saved under "<layer>@<policy>".
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/model/sequential.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

//! A layer's tier state as the precision guard and save_training_state see it: its name,
//! the policies of its tiers and which one runs (a host value; a change takes effect at
//! the next forward).
struct layer_tiers_entry {
  std::string name;
  std::vector<std::string> policies;
  std::size_t* active = nullptr;
  //! The tier whose state (batch norm's running statistics) is current: a move carries it
  //! at the next forward; a load, which restores every tier's, sets it to `active`.
  std::size_t* state_tier = nullptr;
};

namespace detail {

template <class P, class... Rest>
constexpr bool all_distinct() {
  if constexpr (sizeof...(Rest) == 0) return true;
  else return (!std::is_same_v<P, Rest> && ...) && all_distinct<Rest...>();
}

//! from -> to, each float, half or bfloat16 (a tier's parameters and state are in its
//! storage dtype or float); another dtype is refused.
template <class Exec>
void cast_between_tiers(Exec const& exec, tensor_ref<memory_space_t<Exec>> const& from,
                        tensor_ref<memory_space_t<Exec>> const& to) {
  using Space = memory_space_t<Exec>;
  auto typed = [](tensor_ref<Space> const& r, auto f) {
    switch (r.dtype()) {
      case dtype_id::float32: return f(r.template as<float>());
      case dtype_id::float16: return f(r.template as<half>());
      case dtype_id::bfloat16: return f(r.template as<bfloat16>());
      default:
        fail<invalid_argument>("mpx::tiered", "a tiered layer's parameter or state is " +
                                                  std::string(to_string(r.dtype())) +
                                                  ", not float, float16 or bfloat16: it cannot move between tiers");
    }
  };
  typed(from, [&](auto src) {
    typed(to, [&](auto dst) { cast(exec, tensor_view<typename decltype(src)::value_type const, Space>(src), dst); });
  });
}

//! The buffers a higher tier reads and writes in its own dtypes.
template <class T>
struct tier_buffers {
  layer_tensor<typename T::input_type> x, dx;
  layer_tensor<typename T::output_type> y, dy;
};


}  // namespace detail

template <template <class> class Layer, class... Policies>
class tiered : public layer_base {
  static_assert(sizeof...(Policies) >= 2,
                "mpx::tiered<Layer, P1, P2, ...> needs at least two policies: the one the layer starts in and one "
                "to move to (e.g. mpx::tiered<mpx::causal_self_attention, mpx::mixed_float16, mpx::mixed_bfloat16>)");
  static_assert(detail::all_distinct<Policies...>(),
                "mpx::tiered: two tiers have the same policy (mpx::model_policy as the first tier takes the "
                "model's: is the next tier the model's policy too?)");
  using tiers_type = std::tuple<Layer<Policies>...>;
  static constexpr std::size_t count = sizeof...(Policies);
  using first = std::tuple_element_t<0, tiers_type>;
  using storage_type = typename first::policy::storage_type;  // of the parameters

 public:
  using policy = typename first::policy;
  using config_type = std::remove_cvref_t<decltype(std::declval<first const&>().config())>;
  using input_type = typename first::input_type;
  using output_type = typename first::output_type;
  static constexpr std::string_view kind = first::kind;

  //! The arguments of Layer's constructor (the same for every tier).
  template <class... Args>
    requires std::is_constructible_v<first, Args...>
  explicit tiered(Args&&... args) : tiered(first(std::forward<Args>(args)...)) {}
  explicit tiered(first tier0) : tiers_(make_tiers(std::move(tier0), std::make_index_sequence<count - 1>{})) {}

  [[nodiscard]] config_type config() const { return std::get<0>(tiers_).config(); }

  //! The tiered layer with P1 = the model's policy P (when it was mpx::model_policy).
  template <class P>
  auto with_policy() && {
    using resolved = tiered<Layer, std::conditional_t<std::is_same_v<Policies, model_policy>, P, Policies>...>;
    return resolved(std::get<0>(tiers_).config());
  }

  static constexpr std::size_t tier_count() noexcept { return count; }
  [[nodiscard]] std::size_t active_tier() const noexcept { return active_; }
  [[nodiscard]] std::string_view active_policy() const noexcept { return policy_names()[active_]; }
  static constexpr std::array<std::string_view, count> policy_names() noexcept { return {Policies::name...}; }
  //! Runs the layer in tier t from the next forward on (0: P1). Between steps only: a
  //! backward must follow the forward of the same tier.
  void set_active_tier(std::size_t t) {
    if (t >= count)
      detail::fail<invalid_argument>(name(), "tier " + std::to_string(t) + " does not exist: this layer has " +
                                                 std::to_string(count) + " tiers");
    active_ = t;
  }

  //! Tier I's layer, to inspect (its weights are copies, refreshed at each of its forwards).
  template <std::size_t I>
  [[nodiscard]] auto& tier() noexcept {
    return std::get<I>(tiers_);
  }

  [[nodiscard]] shape compute_output_shape(shape const& in) const { return std::get<0>(tiers_).compute_output_shape(in); }

  //! Builds every tier from the same seed (only P1's weights are trained).
  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    for_each_tier([&](auto& t, auto) {
      t.build(exec, in, seed);
      if (!(t.output_shape() == std::get<0>(tiers_).output_shape()))
        detail::fail<shape_error>(name(), "its tiers disagree on the output shape");
    });
    mark_built(in, std::get<0>(tiers_).output_shape());
    for_each_tier([&](auto& t, auto k) {
      if constexpr (decltype(k)::value > 0) parameter_pairs<memory_space_t<Exec>>(t);
    });
  }

  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    shape const in = detail::with_batch(batch, input_shape_), out = detail::with_batch(batch, output_shape_);
    for_each_tier([&](auto& t, auto k) {
      t.reserve(exec, batch);
      if constexpr (decltype(k)::value > 0) {
        auto& b = std::get<decltype(k)::value>(buffers_);
        b.x.ensure(exec, in);
        b.dx.ensure(exec, in);
        b.y.ensure(exec, out);
        b.dy.ensure(exec, out);
      }
    });
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y,
               bool training) {
    check_input_and_reserve(*this, exec, x.shape(), y.shape());
    if (active_ != state_tier_) carry_state(exec);
    forward_tier_ = active_;
    with_active([&](auto& t, auto k) {
      constexpr std::size_t K = decltype(k)::value;
      if constexpr (K == 0) {
        t.forward(exec, x, y, training);
      } else {
        using In = typename std::remove_cvref_t<decltype(t)>::input_type;
        using Out = typename std::remove_cvref_t<decltype(t)>::output_type;
        auto& b = std::get<K>(buffers_);
        copy_between_tiers(exec, t, tier_copy::weights_into_tier);
        tensor_view<In const, Space> xk;
        if constexpr (std::is_same_v<In, input_type>) {
          xk = x;
        } else {
          auto const buffer = b.x.template view<Space>(x.shape());
          cast(exec, x, buffer);
          xk = buffer;
        }
        if constexpr (std::is_same_v<Out, output_type>) {
          t.forward(exec, xk, y, training);
        } else {
          auto const yk = b.y.template view<Space>(y.shape());
          t.forward(exec, xk, yk, training);
          cast(exec, tensor_view<Out const, Space>(yk), y);
        }
      }
    });
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type const, Space> y,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    if (forward_tier_ != active_)
      detail::fail<invalid_argument>(name(), "backward in another tier than the forward it follows (the tier "
                                             "was changed between them)");
    with_active([&](auto& t, auto k) {
      constexpr std::size_t K = decltype(k)::value;
      if constexpr (K == 0) {
        t.backward(exec, x, y, dy, dx);
      } else {
        using In = typename std::remove_cvref_t<decltype(t)>::input_type;
        using Out = typename std::remove_cvref_t<decltype(t)>::output_type;
        auto& b = std::get<K>(buffers_);
        // What the tier's forward read and wrote: the model's views, or the tier's buffers.
        tensor_view<In const, Space> xk;
        tensor_view<Out const, Space> yk, dyk;
        tensor_view<In, Space> dxk;
        if constexpr (std::is_same_v<In, input_type>) {
          xk = x;
          dxk = dx;
        } else {
          xk = b.x.template view<Space>(x.shape());
          if (dx.data() != nullptr) dxk = b.dx.template view<Space>(dx.shape());
        }
        if constexpr (std::is_same_v<Out, output_type>) {
          yk = y;
          dyk = dy;
        } else {
          yk = b.y.template view<Space>(y.shape());
          auto const buffer = b.dy.template view<Space>(dy.shape());
          cast(exec, dy, buffer);
          dyk = buffer;
        }
        t.backward(exec, xk, yk, dyk, dxk);
        if constexpr (!std::is_same_v<In, input_type>)
          if (dx.data() != nullptr) cast(exec, tensor_view<In const, Space>(dxk), dx);
        copy_between_tiers(exec, t, tier_copy::gradients_from_tier);
      }
    });
  }

  //! P1's parameters: the ones every tier computes with and the optimizer updates.
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    std::get<0>(tiers_).template append_parameters<Space>(out);
  }
  [[nodiscard]] std::size_t parameter_count() const { return std::get<0>(tiers_).parameter_count(); }

  void set_name(std::string n) {
    layer_base::set_name(n);
    for_each_tier([&](auto& t, auto k) {
      constexpr std::size_t K = decltype(k)::value;
      t.set_name(K == 0 ? n : n + "@" + std::string(policy_names()[K]));
    });
  }

  //! Whether the active tier draws random numbers in training (mpx::model_shadow asks).
  [[nodiscard]] bool draws_random_numbers_in_training() const {
    bool draws = false;
    with_active([&](auto const& t, auto) {
      if constexpr (requires { t.draws_random_numbers_in_training(); }) draws = t.draws_random_numbers_in_training();
    });
    return draws;
  }

  //! Every tier's training state, each under its own name ("<layer>@<policy>" beyond P1).
  template <executor Exec>
  void append_fp8_scales(std::vector<fp8_scales_entry<Exec>>& out) {
    for_each_tier([&](auto& t, auto) {
      if constexpr (requires { t.template append_fp8_scales<Exec>(out); }) t.template append_fp8_scales<Exec>(out);
    });
  }
  template <memory_space Space>
  void append_counters(std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out) {
    for_each_tier([&](auto& t, auto) {
      if constexpr (requires { t.template append_counters<Space>(out); }) t.template append_counters<Space>(out);
    });
  }
  void append_seeds(std::vector<std::pair<std::string, std::uint64_t*>>& out) {
    for_each_tier([&](auto& t, auto) {
      if constexpr (requires { t.append_seeds(out); }) t.append_seeds(out);
    });
  }
  template <memory_space Space>
  void append_state(std::vector<std::pair<std::string, tensor_ref<Space>>>& out) {
    for_each_tier([&](auto& t, auto) {
      if constexpr (requires { t.template append_state<Space>(out); }) t.template append_state<Space>(out);
    });
  }
  //! Its tiers, for the precision guard and save_training_state.
  void append_tiers(std::vector<layer_tiers_entry>& out) {
    layer_tiers_entry e{name(), {}, &active_, &state_tier_};
    for (auto p : policy_names()) e.policies.emplace_back(p);
    out.push_back(std::move(e));
  }

 private:
  template <std::size_t... I>
  static tiers_type make_tiers(first tier0, std::index_sequence<I...>) {
    auto const c = tier0.config();
    return tiers_type(std::move(tier0), std::tuple_element_t<I + 1, tiers_type>(c)...);
  }

  template <class F>
  void for_each_tier(F&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(std::get<I>(tiers_), std::integral_constant<std::size_t, I>{}), ...);
    }(std::make_index_sequence<count>{});
  }
  template <class F>
  void with_active(F&& f) {
    for_each_tier([&](auto& t, auto k) {
      if (decltype(k)::value == active_) f(t, k);
    });
  }
  template <class F>
  void with_active(F&& f) const {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((I == active_ ? f(std::get<I>(tiers_), std::integral_constant<std::size_t, I>{}) : void()), ...);
    }(std::make_index_sequence<count>{});
  }

  //! Both tiers' parameter lists, in the same order and shapes (checked at build).
  template <memory_space Space, class T>
  std::pair<std::vector<parameter<Space>>, std::vector<parameter<Space>>> parameter_pairs(T& t) {
    std::vector<parameter<Space>> p0, pk;
    std::get<0>(tiers_).template append_parameters<Space>(p0);
    t.template append_parameters<Space>(pk);
    bool ok = p0.size() == pk.size();
    for (std::size_t i = 0; ok && i < p0.size(); ++i) ok = p0[i].value.shape() == pk[i].value.shape();
    if (!ok)
      detail::fail<invalid_argument>(name(), "its tiers' parameters do not pair up (the same tensors, in the same "
                                             "shapes, under every policy)");
    return {std::move(p0), std::move(pk)};
  }
  // Tier 0 holds the trained parameters: its weights are cast into tier t's before t's
  // forward pass, and t's gradients back into tier 0's after its backward pass.
  enum class tier_copy { weights_into_tier, gradients_from_tier };
  template <class Exec, class T>
  void copy_between_tiers(Exec const& exec, T& t, tier_copy what) {
    auto const [p0, pk] = parameter_pairs<memory_space_t<Exec>>(t);
    for (std::size_t i = 0; i < p0.size(); ++i) {
      if (what == tier_copy::weights_into_tier) detail::cast_between_tiers(exec, p0[i].value, pk[i].value);
      else detail::cast_between_tiers(exec, pk[i].gradient, p0[i].gradient);
    }
  }

  //! A move's first forward: the state the layer keeps besides its parameters (batch
  //! norm's running statistics) goes from the tier that ran to the one that runs now.
  template <class Exec>
  void carry_state(Exec const& exec) {
    using Space = memory_space_t<Exec>;
    std::vector<std::pair<std::string, tensor_ref<Space>>> from, to;
    for_each_tier([&](auto& t, auto k) {
      if constexpr (requires { t.template append_state<Space>(from); }) {
        if (decltype(k)::value == state_tier_) t.template append_state<Space>(from);
        if (decltype(k)::value == active_) t.template append_state<Space>(to);
      }
    });
    if (from.size() != to.size())
      detail::fail<invalid_argument>(name(), "its tiers keep different state: it cannot move between them");
    for (std::size_t i = 0; i < from.size(); ++i) {
      if (!(from[i].second.shape() == to[i].second.shape()))
        detail::fail<invalid_argument>(name(), "its tiers keep state of different shapes: it cannot move between them");
      detail::cast_between_tiers(exec, from[i].second, to[i].second);
    }
    state_tier_ = active_;
  }

  tiers_type tiers_;
  std::tuple<detail::tier_buffers<Layer<Policies>>...> buffers_;
  std::size_t active_ = 0;
  std::size_t forward_tier_ = 0;
  std::size_t state_tier_ = 0;  // the tier whose state (running statistics) is current
};

namespace detail {

//! Every tiered layer of a model (inside residual blocks too, named "<block>/<layer>").
template <class Model>
std::vector<layer_tiers_entry> model_tiers(Model& model) {
  std::vector<layer_tiers_entry> out;
  model.for_each_layer([&](auto& layer) {
    if constexpr (requires { layer.append_tiers(out); }) layer.append_tiers(out);
  });
  return out;
}

template <template <class> class L, class... Ps, class P>
struct resolve_policy<tiered<L, Ps...>, P> {
  using type = tiered<L, std::conditional_t<std::is_same_v<Ps, model_policy>, P, Ps>...>;
};

}  // namespace detail

}  // namespace mpx
