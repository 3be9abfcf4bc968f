// Mixed-precision policies: which dtype a layer stores tensors in, computes in,
// accumulates sums in, and keeps its trainable parameters' master copy in. The presets
// are named as in tf.keras.mixed_precision. Looking them up by name (Boost.Hana, or a
// runtime string such as a --policy flag) is in core/policy_names.hpp, so a kernel that
// only needs a policy's dtypes does not compile Hana.
#pragma once

#include <mpx/core/dtype.hpp>

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
// in float: with float master weights "float32", and "mixed_" + the dtype's name
// ("mixed_float16", "mixed_bfloat16", "mixed_float8_e5m2"); with master weights in that
// dtype too, the dtype's name ("bfloat16", "float16": Keras's policies whose variables
// are 16-bit). mpx::mixed_fp8 is "mixed_fp8", as Transformer Engine's users say it; the
// rest spell out all four.
template <class S, class C, class A, class P>
struct policy_name_builder {
  static constexpr auto chars = [] {
    std::array<char, 160> out{};
    std::size_t n = 0;
    auto put = [&](std::string_view s) {
      for (char c : s) out[n++] = c;
    };
    constexpr bool float_sums = std::is_same_v<A, float>;
    if constexpr (float_sums && std::is_same_v<P, float> && std::is_same_v<S, bfloat16> &&
                  std::is_same_v<C, float8_e4m3>) {
      put("mixed_fp8");
    } else if constexpr (float_sums && std::is_same_v<S, C> && std::is_same_v<P, S> && !std::is_same_v<S, float>) {
      put(dtype_name<S>);
    } else if constexpr (float_sums && std::is_same_v<P, float> && std::is_same_v<S, C>) {
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

//! A mixed-precision policy (docs/policies.md says what each member does, with numbers).
//! Storage: the dtype activations, gradients and parameters are stored in. Compute: the
//! dtype matrix products (dense, conv, LSTM gates, attention) read their operands in,
//! cast on the fly; an fp8 compute type runs dense and conv products in fp8 with
//! per-tensor scales (e4m3 forward, e5m2 gradients). Elementwise math (activations,
//! softmax, norms, losses, optimizer updates) always runs in float. Accumulate: the dtype
//! of sums (matrix products, reductions, norms). Param: the dtype of the optimizer's
//! master copy of trainable parameters (master_weights_for<Policy>).
template <class Storage, class Compute = Storage, class Accumulate = float, class Param = float>
struct policy {
  static_assert(dtype<Storage> && dtype<Compute> && dtype<Accumulate> && dtype<Param>,
                "mpx::policy: every dtype of a policy must be mpx::half, mpx::bfloat16 or float, or an fp8 "
                "type (mpx::float8_e4m3, mpx::float8_e5m2): a member of mpx::dtype_list");
  using storage_type = Storage;
  using compute_type = Compute;
  using accumulate_type = Accumulate;
  using param_type = Param;
  //! The presets' names ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16",
  //! "mixed_fp8"), "mixed_" + the dtype's name for any dtype stored and computed in with
  //! float sums and master weights; the four dtypes otherwise. No two policies share a
  //! name.
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

//! Keras's "bfloat16": everything in bfloat16 but sums, master weights included (no
//! float copy: half the optimizer's parameter memory). Updates smaller than half a
//! bfloat16 ulp of a weight are lost unless rounded stochastically:
//! mpx::master_weights_for<mpx::pure_bfloat16>(true, seed).
using pure_bfloat16 = policy<bfloat16, bfloat16, float, bfloat16>;
//! Transformer Engine's hybrid fp8 recipe: bfloat16 storage; dense and conv products
//! read e4m3 weights and activations and e5m2 gradients, each tensor with its own
//! delayed scale (amax history); float sums and master weights. Keep the first and last
//! layers out of fp8 (mpx::without_fp8<P>), as Transformer Engine advises.
using mixed_fp8 = policy<bfloat16, float8_e4m3, float, float>;

//! mixed_fp8 with Transformer Engine's current scaling (Float8CurrentScaling): each
//! tensor's scale from its own amax, found in a pass just before its cast, instead of an
//! amax history (no lag behind a tensor that grows; one more read of each operand).
struct mixed_fp8_current : policy<bfloat16, float8_e4m3, float, float> {
  static constexpr std::string_view name = "mixed_fp8_current";
};

//! mixed_fp8's dtypes with DeepSeek-V3's block recipe (Transformer Engine's
//! Float8BlockScaling): e4m3 for every role, a scale per 1x128 block of activations and
//! gradients and per 128x128 tile of weights, computed from each block as it is cast
//! (docs/fp8_training.md). cuBLASLt runs its products on Hopper and newer.
struct mixed_fp8_block : policy<bfloat16, float8_e4m3, float, float> {
  static constexpr std::string_view name = "mixed_fp8_block";
};
//! mixed_fp8's dtypes with torchao's rowwise recipe: e4m3 for every role, a scale per
//! row of each product's operands (over all of K).
struct mixed_fp8_rowwise : policy<bfloat16, float8_e4m3, float, float> {
  static constexpr std::string_view name = "mixed_fp8_rowwise";
};
//! mixed_fp8's dtypes with MXFP8 (OCP's Microscaling format): e4m3 for every role, a
//! power-of-two (E8M0) scale per 32 values along K, computed from each block as it is
//! cast. cuBLASLt runs its products on Blackwell and newer; the host runs it anywhere.
struct mixed_mxfp8 : policy<bfloat16, float8_e4m3, float, float> {
  static constexpr std::string_view name = "mixed_mxfp8";
};
//! NVFP4 (NVIDIA's 4-bit recipe) in the products: e2m1 values for every role, an e4m3
//! scale per 16 values along K (per 16x16 for weights) under a float scale per tensor,
//! stochastic rounding of gradients and a random Hadamard transform on the weight
//! gradient's inputs (docs/fp8_training.md). The compute dtype names the nearest dtype,
//! e4m3 (the 4-bit values are not a dtype: no tensor holds them outside the products).
//! cuBLASLt runs its products on Blackwell and newer; the host runs it anywhere.
struct mixed_nvfp4 : policy<bfloat16, float8_e4m3, float, float> {
  static constexpr std::string_view name = "mixed_nvfp4";
};

namespace detail {
template <class P>
struct without_fp8_of {
  using compute = typename P::compute_type;
  using type = policy<typename P::storage_type,
                      std::conditional_t<sizeof(compute) == 1, typename P::storage_type, compute>,
                      typename P::accumulate_type, typename P::param_type>;
};
}  // namespace detail

//! P with its products in the storage type where P computes in fp8, else P itself: for
//! the layers kept out of fp8 (a network's first and last, LSTMs).
template <class P>
using without_fp8 = typename detail::without_fp8_of<P>::type;

//! Whether P's matrix products run in fp8 (dense and conv layers then keep scales).
template <class P>
inline constexpr bool computes_in_fp8 = sizeof(typename P::compute_type) == 1;

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
