// The float64-side reference of per-tensor fp8 scaling (mixed_fp8, mixed_fp8_current):
// a value as an fp8 product reads it, and the scales a layer's products cast with.
// Shared by the dense, conv2d and attention tests.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/layers/matrix_products.hpp>

#include <type_traits>

namespace mpx_test::reference {

//! The fp8 value of x under `scale` (the cast's float multiply, saturating), dequantised
//! as mpx::fp8_gemm reads it: the fp8 value times the float inverse scale, in float64.
//! x is the value as the layer holds it (its storage type, or float).
template <class Format, class T>
double dequantised(T x, float scale) {
  float const scaled = mpx::cast<float>(x) * scale;
  return mpx::detail::to_double(mpx::saturate_cast<Format>(scaled)) * static_cast<double>(1.0f / scale);
}

//! The three per-tensor scales of a layer's products (its activations, weights and
//! output gradients) as they are now.
struct fp8_role_scales {
  float activation = 1, weight = 1, gradient = 1;
};
template <class Layer, class Exec>
fp8_role_scales role_scales_of(Layer const& layer, Exec const& exec) {
  auto const& p = layer.products();
  return {p.template scale<mpx::operand_role::activation>(exec).values(exec).scale,
          p.template scale<mpx::operand_role::weight>(exec).values(exec).scale,
          p.template scale<mpx::operand_role::gradient>(exec).values(exec).scale};
}

//! Whether policy P's layers scale each tensor from itself (current scaling: the scales
//! a step cast with are the ones the layer holds after it) rather than from the history.
template <class P>
inline constexpr bool current_scaling_v =
    std::is_same_v<std::remove_cvref_t<decltype(mpx::fp8_recipe_for<P>)>, mpx::current_scaling>;

}  // namespace mpx_test::reference
