// Mixed-precision policies: which dtype a layer stores tensors in, computes in,
// accumulates sums in, and keeps its trainable parameters' master copy in. The presets
// are named as in tf.keras.mixed_precision. Looking them up by name (Boost.Hana, or a
// runtime string such as a --policy flag) is in core/policy_names.hpp, so a kernel that
// only needs a policy's dtypes does not compile Hana.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>

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
// compile time so every policy has a printable name that differs from every other
// policy's. Keras's rule names the policies that store and compute in one dtype and sum
// and keep master weights in float: "float32", and "mixed_" + the dtype's name
// ("mixed_float16", "mixed_bfloat16", "mixed_float8_e5m2"); the rest spell out all four.
template <class S, class C, class A, class P>
struct policy_name_builder {
  static constexpr auto chars = [] {
    std::array<char, 160> out{};
    std::size_t n = 0;
    auto put = [&](std::string_view s) {
      for (char c : s) out[n++] = c;
    };
    if constexpr (std::is_same_v<A, float> && std::is_same_v<P, float> && std::is_same_v<S, C>) {
      if constexpr (std::is_same_v<S, float>) {
        put("float32");
      } else {
        put("mixed_");
        put(dtype_name<S>);
      }
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
                "mpx::policy: every dtype of a policy must be mpx::half, mpx::bfloat16 or float, or an fp8 "
                "type (mpx::float8_e4m3, mpx::float8_e5m2): a member of mpx::dtype_list");
  using storage_type = Storage;
  using compute_type = Compute;
  using accumulate_type = Accumulate;
  using param_type = Param;
  //! "float32", "mixed_float16", "mixed_bfloat16" for the presets (and "mixed_" + the dtype's
  //! name for any dtype stored and computed in with float sums and master weights); the
  //! four dtypes otherwise. No two policies share a name.
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

}  // namespace mpx
