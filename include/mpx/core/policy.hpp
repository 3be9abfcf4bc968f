// Mixed-precision policies: which dtype a layer stores tensors in, computes in,
// accumulates sums in, and keeps its trainable parameters' master copy in. The presets
// are named as in tf.keras.mixed_precision; they can be looked up by name at compile
// time (Boost.Hana) or dispatched from a runtime string such as a --policy flag.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>

#include <boost/hana/at.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/pair.hpp>
#include <boost/hana/equal.hpp>
#include <boost/hana/find_if.hpp>
#include <boost/hana/optional.hpp>
#include <boost/hana/string.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/type.hpp>

#include <array>
#include <concepts>
#include <cstddef>
#include <utility>
#include <string>
#include <string_view>
#include <functional>
#include <type_traits>

namespace mpx {

namespace detail {
// "policy<storage=float16, compute=float32, accumulate=float32, param=float32>", built at
// compile time so every policy has a printable name, the presets their Keras names.
template <class S, class C, class A, class P>
struct policy_name_builder {
  static constexpr auto chars = [] {
    std::array<char, 128> out{};
    std::size_t n = 0;
    auto put = [&](std::string_view s) {
      for (char c : s) out[n++] = c;
    };
    if constexpr (std::is_same_v<A, float> && std::is_same_v<P, float> && std::is_same_v<S, C>) {
      if constexpr (std::is_same_v<S, float>) put("float32");
      else if constexpr (std::is_same_v<S, half>) put("mixed_float16");
      else put("mixed_bfloat16");
    } else {
      put("policy<storage=");
      put(dtype_name<S>);
      put(", compute=");
      put(dtype_name<C>);
      put(", accumulate=");
      put(dtype_name<A>);
      put(", param=");
      put(dtype_name<P>);
      put(">");
    }
    return std::pair{out, n};
  }();
  static constexpr std::string_view value{chars.first.data(), chars.second};
};
}  // namespace detail

//! A mixed-precision policy. Storage: the dtype activations and gradients are stored
//! in. Compute: the dtype elementwise arithmetic runs in. Accumulate: the dtype of sums
//! (matrix products, reductions, norms). Param: the dtype of the optimizer's master copy
//! of trainable parameters.
template <class Storage, class Compute = Storage, class Accumulate = float, class Param = float>
struct policy {
  static_assert(dtype<Storage> && dtype<Compute> && dtype<Accumulate> && dtype<Param>,
                "mpx::policy: every dtype of a policy must be mpx::half, mpx::bfloat16 or float");
  using storage_type = Storage;
  using compute_type = Compute;
  using accumulate_type = Accumulate;
  using param_type = Param;
  //! "float32", "mixed_float16", "mixed_bfloat16" for the presets; the four dtypes otherwise.
  static constexpr std::string_view name = detail::policy_name_builder<Storage, Compute, Accumulate, Param>::value;
};

//! Everything in float32: the reference every mixed policy is compared with.
using float32 = policy<float, float, float, float>;
//! Keras's "mixed_float16": half storage and compute, float sums and master weights.
//! Needs loss scaling (half's smallest subnormal is 6e-8).
using mixed_float16 = policy<half, half, float, float>;
//! Keras's "mixed_bfloat16": bfloat16 storage and compute, float sums and master weights.
//! Float's range, so loss scaling is rarely needed; 8 bits of precision.
using mixed_bfloat16 = policy<bfloat16, bfloat16, float, float>;

//! Anything shaped like mpx::policy.
template <class P>
concept policy_type = requires {
  typename P::storage_type;
  typename P::compute_type;
  typename P::accumulate_type;
  typename P::param_type;
  { P::name } -> std::convertible_to<std::string_view>;
} && dtype<typename P::storage_type> && dtype<typename P::compute_type> &&
    dtype<typename P::accumulate_type> && dtype<typename P::param_type>;

//! A policy whose sums are kept in float: what softmax, norms, losses and gradient
//! norms require.
template <class P>
concept float_accumulating_policy = policy_type<P> && std::is_same_v<typename P::accumulate_type, float>;

//! Stops compilation with a readable message where an operation needs float sums.
//! Call as `mpx::require_float_accumulation<Policy>()` at the top of such an operation.
template <class P>
constexpr void require_float_accumulation() {
  static_assert(policy_type<P>, "mpx: expected a policy such as mpx::mixed_float16");
  static_assert(float_accumulating_policy<P>,
                "mpx: this operation accumulates in float32 (sums of squares, softmax, norms and "
                "losses overflow or lose their small terms in 16 bits), but the policy's "
                "accumulate_type is a 16-bit type; use mpx::mixed_float16, mpx::mixed_bfloat16, "
                "mpx::float32, or a policy<Storage, Compute, float>");
}

//! The presets, in the order they are listed to users.
inline constexpr auto preset_policies = boost::hana::make_tuple(
    boost::hana::make_pair(BOOST_HANA_STRING("float32"), boost::hana::type_c<float32>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_float16"), boost::hana::type_c<mixed_float16>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_bfloat16"), boost::hana::type_c<mixed_bfloat16>));

//! The preset named by a compile-time Hana string, as a hana::type:
//! `constexpr auto n = BOOST_HANA_STRING("mixed_float16"); using P = decltype(mpx::policy_by_name(n))::type;`
template <char... Cs>
constexpr auto policy_by_name(boost::hana::string<Cs...> name) {
  auto found = boost::hana::find_if(preset_policies, [&](auto const& entry) {
    return boost::hana::first(entry) == name;
  });
  static_assert(!decltype(found == boost::hana::nothing)::value,
                "mpx::policy_by_name: no preset policy has this name; the presets are "
                "\"float32\", \"mixed_float16\" and \"mixed_bfloat16\"");
  return boost::hana::second(*found);
}

//! The preset policy type named by a Hana string type.
template <class HanaString>
using policy_named = typename decltype(policy_by_name(HanaString{}))::type;

namespace detail {
[[noreturn]] inline void unknown_policy(std::string_view name) {
  fail<invalid_argument>("with_policy", "unknown policy \"" + std::string(name) +
                                            "\"; the presets are float32, mixed_float16 and mixed_bfloat16");
}

// Each step compares then calls; the last step throws instead of recursing. (An
// if-constexpr branch that only throws, the obvious form, crashes nvcc 13's front end.)
template <std::size_t I, class Result, class F>
Result dispatch_policy(std::string_view name, F& f) {
  constexpr std::size_t count = decltype(boost::hana::length(preset_policies))::value;
  if constexpr (I + 1 < count) {
    if (name != boost::hana::to<char const*>(boost::hana::first(boost::hana::at_c<I>(preset_policies))))
      return dispatch_policy<I + 1, Result>(name, f);
  } else {
    if (name != boost::hana::to<char const*>(boost::hana::first(boost::hana::at_c<I>(preset_policies))))
      unknown_policy(name);
  }
  return f(boost::hana::second(boost::hana::at_c<I>(preset_policies)));
}
}  // namespace detail

//! Calls f(hana::type_c<P>) for the preset named `name` (from a command line, a config
//! file) and returns what f returns; an unknown name throws mpx::invalid_argument that
//! lists the presets. This is how one binary runs a model under any of them.
template <class F, class Result = std::invoke_result_t<F&, boost::hana::basic_type<float32>>>
Result with_policy(std::string_view name, F&& f) {
  return detail::dispatch_policy<0, Result>(name, f);
}

}  // namespace mpx
