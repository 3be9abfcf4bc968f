// Block-scaled fp8: one scale per block of an operand instead of one per tensor, so an
// outlier costs only its own block's resolution. The recipes (chosen per policy through
// mpx::fp8_recipe_for, layers/matrix_products.hpp):
//   rowwise_scaling  one scale per row of K values (torchao's rowwise recipe; cuBLASLt's
//                    OUTER_VEC_32F scale mode);
//   block_scaling    DeepSeek-V3's recipe, Transformer Engine's Float8BlockScaling:
//                    activations and gradients in 1x128 blocks along K (VEC128_32F),
//                    weights in 128x128 tiles (BLK128x128_32F), e4m3 for every role;
//   mxfp8_scaling    MXFP8 (OCP's Microscaling format, Transformer Engine's
//                    MXFP8BlockScaling): every operand in 1x32 blocks along K with a
//                    power-of-two E8M0 scale (VEC32_UE8M0, Blackwell), e4m3 values;
//   nvfp4_scaling    NVFP4 (NVIDIA's 4-bit training recipe, Transformer Engine's
//                    NVFP4BlockScaling): e2m1 values in 1x16 blocks along K with e4m3
//                    scales under a float scale per tensor (VEC16_UE4M3, Blackwell).
// A block's scale is computed from the block itself when it is quantized (no history,
// nothing to save or to agree on between replicas). This file holds the recipes; the
// blocks' layout and scale are kernels/fp8_block_layout.hpp, the quantize pass
// kernels/fp8_block_quantize.hpp and kernels/nvfp4_quantize.hpp, the product
// kernels/fp8_block_gemm.hpp.
#pragma once

#include <mpx/kernels/fp8_block_layout.hpp>

namespace mpx {

//! torchao's rowwise recipe: a scale per row of A and per column of B (each over all of
//! K), e4m3 for activations, weights and gradients.
struct rowwise_scaling {
  bool power_of_two_scales = false;  //!< round each scale down to a power of two (exact inverses)
};

//! DeepSeek-V3's block recipe (Transformer Engine's Float8BlockScaling): activations and
//! gradients in 1x128 blocks, weights in 128x128 tiles, e4m3 for every role, scales
//! rounded down to powers of two by default (as Transformer Engine does; then a
//! dequantised value is exact).
struct block_scaling {
  bool power_of_two_scales = true;
};

//! MXFP8: 1x32 blocks along K for activations, weights and gradients alike, e4m3 values,
//! each block's scale the power of two (an E8M0 byte) that brings its largest magnitude
//! within 448 (rounded up, as NVIDIA's recipe does, so nothing saturates). Its GPU
//! product needs Blackwell (sm_100) or newer; the host runs it anywhere.
struct mxfp8_scaling {
  static constexpr bool power_of_two_scales = true;  //!< E8M0 holds powers of two only
};

//! NVFP4 as NVIDIA trains with it ("Pretraining Large Language Models with NVFP4",
//! 2025): e2m1 values in 1x16 blocks along K for every role, each block's scale an e4m3
//! under a float scale per tensor; and, each optional (all on by default):
struct nvfp4_scaling {
  //! Weights in 16x16 blocks, so the forward and the input gradient read the same
  //! quantized weight.
  bool square_weight_blocks = true;
  //! Gradients rounded stochastically (unbiased), from Philox at a count the layer keeps
  //! in its training state.
  bool stochastic_gradients = true;
  //! The weight gradient's two inputs transformed along K (the batch) by a random
  //! 16-point Hadamard transform, which spreads outliers over their block.
  bool hadamard_weight_gradients = true;
  static constexpr bool power_of_two_scales = false;
};

//! Whether R is one of the block recipes above (as opposed to per-tensor scaling).
template <class R>
inline constexpr bool is_block_recipe_v = false;
template <>
inline constexpr bool is_block_recipe_v<rowwise_scaling> = true;
template <>
inline constexpr bool is_block_recipe_v<block_scaling> = true;
template <>
inline constexpr bool is_block_recipe_v<mxfp8_scaling> = true;
template <>
inline constexpr bool is_block_recipe_v<nvfp4_scaling> = true;

}  // namespace mpx
