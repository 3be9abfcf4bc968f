// mpx::fp8_block_gemm: C = alpha * A B^T + beta * C for operands quantized with one
// scale per block (mpx::quantize_fp8_blocks), summed in float. On the host each value is
// dequantised (fp8 value * its block's inverse scale: exact when the scales are powers of
// two) and the float product runs as mpx::gemm's; on a cuda_executor it is one cuBLASLt
// call with the blocks' scale modes: OUTER_VEC_32F, VEC128_32F and BLK128x128_32F, which
// cuBLASLt offers on Hopper (sm_90), and VEC32_UE8M0 (MXFP8), which it offers on
// Blackwell (sm_100) and newer.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/fp8_gemm.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/kernels/fp8_block_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace mpx {

//! An operand quantize_fp8_blocks made: values [outer, layout.padded_k()] (K contiguous)
//! and the blocks' inverse scales [layout.count()] (floats, or float8_e8m0 for vec32
//! blocks), in Space.
template <class Format, memory_space Space, class Scale = float>
struct fp8_block_operand {
  tensor_view<Format const, Space> values;
  tensor_view<Scale const, Space> inverse_scales;
  fp8_block_scale_layout layout;
};

namespace detail {

//! Names a block kind in messages.
inline char const* block_kind_name(fp8_block_kind k) noexcept {
  switch (k) {
    case fp8_block_kind::row: return "rowwise";
    case fp8_block_kind::vec128: return "1x128";
    case fp8_block_kind::vec32: return "1x32 (MXFP8)";
    case fp8_block_kind::tile128: break;
  }
  return "128x128";
}

//! The checks of fp8_block_gemm that hold on every executor, in this order: each
//! operand's values and scales as its layout says, the pair of block kinds cuBLASLt
//! has a product for (rowwise with rowwise; 1x32 with 1x32; 1x128 with 1x128 or
//! 128x128, not two 128x128), K alike, N a multiple of 16, C [M, N].
template <class FA, class FB, class Space, class SA, class SB>
void check_fp8_block_gemm(fp8_block_operand<FA, Space, SA> const& a, fp8_block_operand<FB, Space, SB> const& b,
                          shape const& c, mpx::source_location loc) {
  auto const check_operand = [&](char const* name, auto const& x) {
    using scale_type = std::remove_const_t<typename decltype(x.inverse_scales)::element_type>;
    if (x.layout.e8m0_scales() != std::is_same_v<scale_type, float8_e8m0>)
      fail<invalid_argument>("fp8_block_gemm", std::string(name) + "'s layout says " +
                                                   block_kind_name(x.layout.kind) + " blocks, whose scales are " +
                                                   (x.layout.e8m0_scales() ? "float8_e8m0" : "float") +
                                                   ", but its scales hold another type",
                             loc);
    shape const want{x.layout.outer, x.layout.padded_k()};
    if (x.values.shape() != want)
      fail<shape_error>("fp8_block_gemm", std::string(name) + "'s values have shape " + x.values.shape().to_string() +
                                              " but its layout says " + want.to_string(),
                        loc);
    if (x.inverse_scales.shape() != shape{x.layout.count()})
      fail<shape_error>("fp8_block_gemm", std::string(name) + "'s inverse scales have shape " +
                                              x.inverse_scales.shape().to_string() + " but its " +
                                              block_kind_name(x.layout.kind) + " blocks need [" +
                                              std::to_string(x.layout.count()) + "]",
                        loc);
  };
  check_operand("A", a);
  check_operand("B", b);
  for (fp8_block_kind const only_alike : {fp8_block_kind::row, fp8_block_kind::vec32})
    if ((a.layout.kind == only_alike) != (b.layout.kind == only_alike))
      fail<invalid_argument>("fp8_block_gemm", std::string(block_kind_name(only_alike)) + " blocks multiply only " +
                                                   block_kind_name(only_alike) + " blocks; got A " +
                                                   block_kind_name(a.layout.kind) + " and B " +
                                                   block_kind_name(b.layout.kind),
                             loc);
  if (a.layout.kind == fp8_block_kind::tile128 && b.layout.kind == fp8_block_kind::tile128)
    fail<invalid_argument>("fp8_block_gemm",
                           "A and B are both in 128x128 blocks, which cuBLASLt has no product for: quantize one of "
                           "them in 1x128 blocks (block_scaling does so for activations and gradients)",
                           loc);
  if (a.layout.k != b.layout.k)
    fail<shape_error>("fp8_block_gemm", "A has K = " + std::to_string(a.layout.k) + " but B has K = " +
                                            std::to_string(b.layout.k),
                      loc);
  if (b.layout.outer % fp8_gemm_multiple != 0)
    fail<invalid_argument>("fp8_block_gemm",
                           "N (B's rows) must be a multiple of 16 for cuBLASLt's fp8 products; got N = " +
                               std::to_string(b.layout.outer) +
                               ". In a layer under an fp8 policy N is its unit count or its input width: make it "
                               "a multiple of 16, or give the layer mpx::without_fp8<Policy>",
                           loc);
  if (c != shape{a.layout.outer, b.layout.outer})
    fail<shape_error>("fp8_block_gemm", "C has shape " + c.to_string() + " but A B^T is [" +
                                            std::to_string(a.layout.outer) + ", " + std::to_string(b.layout.outer) + "]",
                      loc);
}

//! An operand's values dequantised into float scratch [outer, padded k]: value * its
//! block's inverse scale, exact where the scales are powers of two (one scale read per
//! block).
template <std::size_t Slot, class Format, class Space, class Scale>
float const* host_dequantize_blocks(fp8_block_operand<Format, Space, Scale> const& x) {
  struct tag {};
  std::size_t const pitch = static_cast<std::size_t>(x.layout.padded_k());
  std::size_t const length = static_cast<std::size_t>(x.layout.block_length());
  std::size_t const n = static_cast<std::size_t>(x.layout.outer) * pitch;
  float* out = host_scratch_floats<tag, Slot>(n);
  Format const* v = x.values.data();
  Scale const* s = x.inverse_scales.data();
  for (std::size_t o = 0; o < static_cast<std::size_t>(x.layout.outer); ++o)
    for (std::size_t k0 = 0; k0 < pitch; k0 += length) {
      float const factor = dequantisation_factor(s[x.layout.slot(o, k0)]);
      for (std::size_t kk = k0; kk < k0 + length; ++kk) out[o * pitch + kk] = cast<float>(v[o * pitch + kk]) * factor;
    }
  return out;
}

#if MPX_HAS_CUDA
//! cuBLASLt's scale mode (cublasLtMatmulMatrixScale_t, an int32_t attribute) of a kind.
inline std::int32_t lt_scale_mode(fp8_block_kind k) noexcept {
  switch (k) {
    case fp8_block_kind::row: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case fp8_block_kind::vec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case fp8_block_kind::vec32: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    case fp8_block_kind::tile128: break;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}
#endif

}  // namespace detail

//! C = alpha * A B^T + beta * C, A [M, K] and B [N, K] quantized in blocks (values times
//! their blocks' inverse scales), summed in float. C holds half, bfloat16 or float,
//! [M, N], in the executor's memory.
//!
//! Error: a dequantised value is exact with power-of-two scales (block_scaling's
//! default, and always for vec32's E8M0 scales) and within 2^-24 relative otherwise; the float sums add at most
//! (K + 4) 2^-24 |alpha| sum_k |a||b| + |beta C0|, plus C's rounding, on the host. The GPU
//! sums each 128-long run of K on its tensor cores and promotes to float between runs.
//!
//! Refused before anything runs (mpx::shape_error or mpx::invalid_argument, naming the
//! operand): values or scales not as their layouts say, rowwise or 1x32 blocks with other
//! blocks, two 128x128 operands, K that differs, N not a multiple of 16, C not [M, N], C
//! overlapping an operand. On a cuda_executor too: pointers (scales included) not
//! 16-byte aligned; for rowwise, 1x128 and 128x128 blocks a device other than Hopper
//! (sm_90), for 1x32 blocks one older than Blackwell (sm_100).
template <executor Exec, class FA, class FB, memory_space Space, class SA, class SB, tensor_like C>
void fp8_block_gemm([[maybe_unused]] Exec const& exec, fp8_block_operand<FA, Space, SA> const& a,
                    fp8_block_operand<FB, Space, SB> const& b, C&& c, float alpha = 1.0f, float beta = 0.0f,
                    mpx::source_location loc = mpx::source_location::current()) {
  detail::check_fp8_gemm_types<FA, FB, value_t<C>>();
  detail::require_access<Exec, Space, space_t<C>>();
  auto const cv = mpx::view(c);
  static_assert(!std::is_const_v<typename decltype(cv)::element_type>, "mpx::fp8_block_gemm: C is const");
  detail::check_fp8_block_gemm(a, b, cv.shape(), loc);
  detail::require_disjoint("fp8_block_gemm", "C", cv, "A", a.values);
  detail::require_disjoint("fp8_block_gemm", "C", cv, "B", b.values);
  detail::require_disjoint("fp8_block_gemm", "C", cv, "A's scales", a.inverse_scales);
  detail::require_disjoint("fp8_block_gemm", "C", cv, "B's scales", b.inverse_scales);
  std::int64_t const m = a.layout.outer, n = b.layout.outer, k = a.layout.padded_k();
  detail::gemm_dims const d{.batch = 1, .m = m, .n = n, .k = k, .stride_a = m * k, .stride_b = n * k, .stride_c = m * n};
  gemm_options const o{.transpose_a = false, .transpose_b = true, .alpha = alpha, .beta = beta};
  if constexpr (is_host_executor_v<Exec>) {
    if (cv.empty() || detail::gemm_without_products(exec, cv, d, o)) return;
    float const* af = detail::host_dequantize_blocks<0>(a);
    float const* bf = detail::host_dequantize_blocks<1>(b);
    detail::host_gemm<float>(d, false, true, alpha, af, bf, beta, cv.data());
  } else {
#if MPX_HAS_CUDA
    detail::check_fp8_gemm_device(d, o, a.values.data(), b.values.data(), cv.data(), loc);
    if (cv.empty() || detail::gemm_without_products(exec, cv, d, o)) return;
    if (reinterpret_cast<std::uintptr_t>(a.inverse_scales.data()) % 16 != 0 ||
        reinterpret_cast<std::uintptr_t>(b.inverse_scales.data()) % 16 != 0)
      detail::fail<invalid_argument>("fp8_block_gemm",
                                     "on the GPU the inverse scales must start at 16-byte aligned addresses (a view "
                                     "at an offset may not); copy them into a tensor of their own",
                                     loc);
    int device = 0, major = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (a.layout.kind == fp8_block_kind::vec32 ? major < 10 : major != 9)
      detail::fail<invalid_argument>(
          "fp8_block_gemm",
          std::string(a.layout.kind == fp8_block_kind::vec32
                          ? "cuBLASLt offers MXFP8 products (1x32 blocks, E8M0 scales) on Blackwell (sm_100) and "
                            "newer"
                          : "cuBLASLt offers these block scale modes (rowwise, 1x128, 128x128) on Hopper (sm_90) "
                            "only") +
              "; this device is sm_" + std::to_string(major) + "x. Use mpx::fp8_gemm with per-tensor scales here",
          loc);
    // cuBLASLt's A is our B (see cuda_gemm): its scales and mode come first.
    detail::cuda_gemm<float>(exec.stream(), d, false, true, alpha, a.values.data(), b.values.data(), beta, cv.data(),
                             detail::lt_operand_scales{b.inverse_scales.data(), a.inverse_scales.data(),
                                                       detail::lt_scale_mode(b.layout.kind),
                                                       detail::lt_scale_mode(a.layout.kind)});
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
