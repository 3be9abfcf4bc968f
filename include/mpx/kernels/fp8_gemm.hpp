// mpx::fp8_gemm: C = alpha * (a_inverse_scale * b_inverse_scale) * op(A) op(B) + beta * C
// for operands scaled and cast to fp8 (cast_to_fp8 / cast_to_fp8_transposed with an
// fp8_tensor_scale), summed in float. On the host the fp8 values are widened to float
// and multiplied exactly (the same product as mpx::gemm's); on a cuda_executor it is one
// cuBLASLt fp8 call, which needs an Ada or Hopper GPU and K-contiguous operands.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/gemm.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

namespace mpx {

//! What cuBLASLt's fp8 kernels need K and N to be multiples of (16 fp8 values: 16-byte
//! rows of A and B; PyTorch's _scaled_mm asks the same of both extents of its mat2).
inline constexpr std::int64_t fp8_gemm_multiple = 16;

//! n rounded up to a multiple of fp8_gemm_multiple: the K that cast_to_fp8_padded and
//! cast_to_fp8_transposed_padded pad an operand to with zeros (exact: zeros add nothing).
constexpr std::int64_t fp8_gemm_padded_extent(std::int64_t n) noexcept {
  return (n + fp8_gemm_multiple - 1) / fp8_gemm_multiple * fp8_gemm_multiple;
}

namespace detail {

//! The compile-time checks of mpx::fp8_gemm, each with the message a user needs.
template <class TA, class TB, class TC>
constexpr void check_fp8_gemm_types() {
  static_assert(dtype8<TA> && dtype8<TB>,
                "mpx::fp8_gemm: A and B must hold float8_e4m3 or float8_e5m2 (cast them with mpx::cast_to_fp8 or "
                "mpx::cast_to_fp8_transposed); for 16- and 32-bit operands use mpx::gemm");
  static_assert(!(std::is_same_v<TA, float8_e5m2> && std::is_same_v<TB, float8_e5m2>),
                "mpx::fp8_gemm: e5m2 x e5m2 is not offered (cuBLASLt has no such kernel): make one operand "
                "float8_e4m3, as in Transformer Engine's hybrid recipe (e4m3 forward operands, e5m2 gradients)");
  static_assert(std::is_same_v<TC, half> || std::is_same_v<TC, bfloat16> || std::is_same_v<TC, float>,
                "mpx::fp8_gemm: C must hold half, bfloat16 or float");
}

//! The shape rules of cuBLASLt's fp8 kernels, in this order: both operands K-contiguous
//! (its "TN" format; row-major A [M, K] and B [N, K], that is transpose_b), K a multiple
//! of 16, N a multiple of 16. fp8_gemm checks them on the GPU; mpx's fp8 layers check
//! them on every executor (after padding K), so that a host run refuses what a GPU would.
inline void check_fp8_gemm_layout(gemm_dims const& d, gemm_options const& o, mpx::source_location loc) {
  if (o.transpose_a || !o.transpose_b)
    fail<invalid_argument>("fp8_gemm",
                           std::string("on the GPU both operands must be K-contiguous: A [M, K] not transposed and B "
                                       "[N, K] with transpose_b (cuBLASLt's fp8 kernels take only this \"TN\" "
                                       "layout); got transpose_a = ") +
                               (o.transpose_a ? "true" : "false") + ", transpose_b = " +
                               (o.transpose_b ? "true" : "false") +
                               ". Cast the operand whose K runs down its columns with mpx::cast_to_fp8_transposed",
                           loc);
  if (d.k % fp8_gemm_multiple != 0)
    fail<invalid_argument>("fp8_gemm",
                           "on the GPU K must be a multiple of 16 (cuBLASLt's fp8 kernels read 16-byte rows); got "
                           "K = " + std::to_string(d.k) +
                               ": pad K with zeros (mpx::cast_to_fp8_padded, mpx::cast_to_fp8_transposed_padded)",
                           loc);
  if (d.n % fp8_gemm_multiple != 0)
    fail<invalid_argument>("fp8_gemm",
                           "on the GPU N must be a multiple of 16 (the rows of B [N, K] cuBLASLt's fp8 kernels "
                           "tile, as PyTorch's _scaled_mm requires); got N = " + std::to_string(d.n) +
                               ". In a layer under an fp8 policy N is its unit count (filters) or its input "
                               "width (kernel taps x channels): make it a multiple of 16, or give the layer "
                               "mpx::without_fp8<Policy>",
                           loc);
}

//! What cuBLASLt's fp8 kernels need, checked before anything is launched and in this
//! order, so that a wrong layout is reported on any GPU: check_fp8_gemm_layout's rules,
//! every pointer 16-byte aligned (the batch strides follow from K and N), and last a
//! device (`cc`, the current one's) of compute capability 8.9 or newer.
template <class TA, class TB, class TC>
void check_fp8_gemm_device(gemm_dims const& d, gemm_options const& o, TA const* a, TB const* b, TC const* c,
                           compute_capability cc, mpx::source_location loc) {
  check_fp8_gemm_layout(d, o, loc);
  auto const misaligned = [](void const* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  if (misaligned(a) || misaligned(b) || misaligned(c))
    fail<invalid_argument>("fp8_gemm",
                           "on the GPU A, B and C must start at 16-byte aligned addresses (a view at an offset "
                           "may not); copy the operand into a tensor of its own",
                           loc);
  if (cc.sm() < 89)
    fail<invalid_argument>("fp8_gemm",
                           "fp8 products need an Ada (sm_89) or Hopper (sm_90) GPU or newer; this device is sm_" +
                               std::to_string(cc.sm()) + ". Use mpx::gemm on 16-bit operands here",
                           loc);
}

#if MPX_HAS_CUDA
//! One cuBLASLt fp8 product, in the layout check_fp8_gemm_device admits (A [M, K], B
//! [N, K]): mpx::gemm's call with the inverse scales as cuBLASLt's scale pointers. Its A
//! is our B, so its A scale is b_inverse_scale.
template <class TA, class TB, class TC>
void cuda_fp8_gemm(cudaStream_t stream, gemm_dims const& d, float alpha, TA const* a, float const* a_inverse_scale,
                   TB const* b, float const* b_inverse_scale, float beta, TC* c) {
  cuda_gemm<float>(stream, d, false, true, alpha, a, b, beta, c, lt_operand_scales{b_inverse_scale, a_inverse_scale});
}
#endif

}  // namespace detail

//! C = alpha * (a_inverse_scale * b_inverse_scale) * op(A) op(B) + beta * C: a product
//! of fp8 operands, dequantised by their inverse scales, summed in float.
//!
//! A and B hold float8_e4m3 or float8_e5m2 (not both e5m2: a compile error), C half,
//! bfloat16 or float. The inverse scales point to one float each in the executor's
//! memory, such as fp8_tensor_scale::inverse_scale_data() (dequantised value = fp8 value
//! * inverse scale); they are read when the product runs (in stream order on the GPU).
//! Shapes as mpx::gemm: A [M, K] ([K, M] with transpose_a), B [K, N] ([N, K] with
//! transpose_b), C [M, N], or strided batches; mpx::shape_error names all three.
//!
//! Error: every product of two fp8 values is exact in float, so the only roundings are
//! the fp8 casts (the caller's: relative 2^-4 per e4m3 operand, 2^-3 per e5m2, under the
//! scale's range) and the float sums: |C - exact| <= (K + 4) 2^-24 (|alpha s_a s_b|
//! sum_k |a||b| + |beta C0|), plus C's final rounding, on the host. The GPU's tensor cores
//! add the products of one fp8 instruction (32 terms of K) with fewer bits than float
//! and promote the partial sums to float between instructions (mpx leaves cuBLASLt's
//! CUBLASLT_MATMUL_DESC_FAST_ACCUM off, which would skip that promotion).
//!
//! The host takes every layout, size and alignment. On a cuda_executor (one cuBLASLt call
//! on its stream) each of these is an mpx::invalid_argument before anything is launched,
//! in this order: transpose_a, or B not transposed (A [M, K] and B [N, K] are the only
//! layout: make a K-contiguous operand with cast_to_fp8_transposed); K not a multiple of
//! 16 (pad it with zeros: cast_to_fp8_padded, cast_to_fp8_transposed_padded); N not a
//! multiple of 16; A, B or C not 16-byte aligned; a device older than sm_89. Layer code
//! that meets these runs unchanged on both executors (mpx's fp8 layers pad K and check
//! the rest with detail::check_fp8_gemm_layout on every executor).
template <executor Exec, tensor_like A, tensor_like B, tensor_like C>
void fp8_gemm([[maybe_unused]] Exec const& exec, A&& a, float const* a_inverse_scale, B&& b,
              float const* b_inverse_scale, C&& c, gemm_options const& options = {},
              mpx::source_location loc = mpx::source_location::current()) {
  detail::check_fp8_gemm_types<value_t<A>, value_t<B>, value_t<C>>();
  detail::require_access<Exec, space_t<A>, space_t<B>, space_t<C>>();
  auto const av = mpx::view(a);
  auto const bv = mpx::view(b);
  auto const cv = mpx::view(c);
  static_assert(!std::is_const_v<typename decltype(cv)::element_type>, "mpx::fp8_gemm: C is const");
  detail::gemm_dims const d = detail::gemm_shapes(av.shape(), bv.shape(), cv.shape(), options, loc);
  detail::require_disjoint("fp8_gemm", "C", cv, "A", av);  // as mpx::gemm: C is written while A and B are read
  detail::require_disjoint("fp8_gemm", "C", cv, "B", bv);
  if (!a_inverse_scale || !b_inverse_scale)
    detail::fail<invalid_argument>("fp8_gemm",
                                   "an inverse scale is null: pass a pointer to one float in the executor's memory, "
                                   "such as fp8_tensor_scale::inverse_scale_data()",
                                   loc);
  // As mpx::gemm: cuBLASLt on the GPU, the exact float product on the host.
  if constexpr (is_host_executor_v<Exec>) {
    if (cv.empty() || detail::gemm_without_products(exec, cv, d, options)) return;
    // alpha * s_a * s_b rounded to float once: one more 2^-24, inside the bound.
    float const alpha = options.alpha * (*a_inverse_scale * *b_inverse_scale);
    detail::host_gemm<float>(d, options.transpose_a, options.transpose_b, alpha, av.data(), bv.data(), options.beta,
                             cv.data());
  } else {
#if MPX_HAS_CUDA
    // Checked before the shortcuts below, so that a layout the GPU cannot take is refused
    // even where it would have nothing to multiply.
    detail::check_fp8_gemm_device(d, options, av.data(), bv.data(), cv.data(), detail::current_compute_capability(),
                                  loc);
    if (cv.empty() || detail::gemm_without_products(exec, cv, d, options)) return;
    detail::cuda_fp8_gemm(exec.stream(), d, options.alpha, av.data(), a_inverse_scale, bv.data(), b_inverse_scale,
                          options.beta, cv.data());
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
