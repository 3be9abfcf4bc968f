// mpx::fp8_block_gemm: C = alpha * A B^T + beta * C for operands quantized with one
// scale per block (mpx::quantize_fp8_blocks, or mpx::quantize_nvfp4 for NVFP4), summed
// in float. On the host each value is dequantised (the value times its block's inverse
// scale: exact when the scales are powers of two, and always for NVFP4, whose e2m1
// values times e4m3 scales fit a float) and the float product runs as mpx::gemm's; on a
// cuda_executor it is one cuBLASLt call with the blocks' scale modes: OUTER_VEC_32F,
// VEC128_32F and BLK128x128_32F, which cuBLASLt offers on Hopper (sm_90), and
// VEC32_UE8M0 (MXFP8) and VEC16_UE4M3 (NVFP4), which it offers on Blackwell (sm_100)
// and newer.
#pragma once

#include <mpx/core/block_formats.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
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
//! blocks), in Space. Or one quantize_nvfp4 made: values float4_e2m1x2 [outer,
//! layout.padded_k() / 2], the block scales float8_e4m3, and its tensor scale.
template <class Format, memory_space Space, class Scale = float>
struct fp8_block_operand {
  tensor_view<Format const, Space> values;
  tensor_view<Scale const, Space> inverse_scales;
  fp8_block_scale_layout layout;
  //! NVFP4 only: [amax, decode factor] as quantize_nvfp4 wrote them; empty otherwise.
  tensor_view<float const, Space> tensor_scale{};
};

//! An NVFP4 operand (mpx::quantize_nvfp4's outputs).
template <memory_space Space>
using nvfp4_operand = fp8_block_operand<float4_e2m1x2, Space, float8_e4m3>;

namespace detail {

//! Names a block kind in messages.
inline char const* block_kind_name(fp8_block_kind k) noexcept {
  switch (k) {
    case fp8_block_kind::row: return "rowwise";
    case fp8_block_kind::vec128: return "1x128";
    case fp8_block_kind::vec32: return "1x32 (MXFP8)";
    case fp8_block_kind::vec16: return "1x16 (NVFP4)";
    case fp8_block_kind::tile128: break;
  }
  return "128x128";
}

//! The type a layout's scales are stored in, named.
inline char const* block_scale_type_name(fp8_block_scale_layout const& l) noexcept {
  return l.e8m0_scales() ? "float8_e8m0" : l.e4m3_scales() ? "float8_e4m3" : "float";
}
template <class Scale>
constexpr bool scale_type_fits(fp8_block_scale_layout const& l) noexcept {
  if (l.e8m0_scales()) return std::is_same_v<Scale, float8_e8m0>;
  if (l.e4m3_scales()) return std::is_same_v<Scale, float8_e4m3>;
  return std::is_same_v<Scale, float>;
}

//! The types a block product takes: NVFP4 with NVFP4, else fp8_gemm's rules.
template <class FA, class FB, class TC>
constexpr void check_block_gemm_types() {
  constexpr bool fp4_a = std::is_same_v<FA, float4_e2m1x2>, fp4_b = std::is_same_v<FB, float4_e2m1x2>;
  static_assert(fp4_a == fp4_b, "mpx::fp8_block_gemm: NVFP4 operands (float4_e2m1x2) multiply NVFP4 operands only");
  if constexpr (fp4_a)
    static_assert(std::is_same_v<TC, half> || std::is_same_v<TC, bfloat16> || std::is_same_v<TC, float>,
                  "mpx::fp8_block_gemm: C must hold half, bfloat16 or float");
  else
    check_fp8_gemm_types<FA, FB, TC>();
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
    using value_type = std::remove_const_t<typename decltype(x.values)::element_type>;
    constexpr bool fp4 = std::is_same_v<value_type, float4_e2m1x2>;
    if (!scale_type_fits<scale_type>(x.layout))
      fail<invalid_argument>("fp8_block_gemm", std::string(name) + "'s layout says " +
                                                   block_kind_name(x.layout.kind) + " blocks, whose scales are " +
                                                   block_scale_type_name(x.layout) +
                                                   ", but its scales hold another type",
                             loc);
    if (fp4 != (x.layout.kind == fp8_block_kind::vec16))
      fail<invalid_argument>("fp8_block_gemm", std::string(name) + (fp4 ? " holds e2m1 values, which need 1x16 (NVFP4) "
                                                                          "blocks; its layout says "
                                                                        : " holds fp8 values, which 1x16 (NVFP4) "
                                                                          "blocks do not take; its layout says ") +
                                                   block_kind_name(x.layout.kind),
                             loc);
    if (fp4 && x.tensor_scale.shape() != shape{2})
      fail<shape_error>("fp8_block_gemm", std::string(name) + "'s tensor scale has shape " +
                                              x.tensor_scale.shape().to_string() +
                                              " but an NVFP4 operand carries [2] (quantize_nvfp4's tensor_scale)",
                        loc);
    if (!fp4 && !x.tensor_scale.empty())
      fail<invalid_argument>("fp8_block_gemm", std::string(name) +
                                                   " is an fp8 operand with a tensor scale, which only NVFP4 "
                                                   "operands carry: leave it empty",
                             loc);
    shape const want{x.layout.outer, x.layout.padded_k() / (fp4 ? 2 : 1)};
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
  for (fp8_block_kind const only_alike : {fp8_block_kind::row, fp8_block_kind::vec32, fp8_block_kind::vec16})
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
//! block). NVFP4's: e2m1 value * (block scale * decode factor), one rounding, so that
//! the product of two operands overflows only where its true value does (cuBLASLt's
//! alpha, which carries both decode factors, can overflow first).
template <std::size_t Slot, class Format, class Space, class Scale>
float const* host_dequantize_blocks(fp8_block_operand<Format, Space, Scale> const& x) {
  struct tag {};
  std::size_t const pitch = static_cast<std::size_t>(x.layout.padded_k());
  std::size_t const length = static_cast<std::size_t>(x.layout.block_length());
  std::size_t const n = static_cast<std::size_t>(x.layout.outer) * pitch;
  float* out = host_scratch_floats<tag, Slot>(n);
  Format const* v = x.values.data();
  Scale const* s = x.inverse_scales.data();
  float const decode = x.tensor_scale.empty() ? 1.0f : x.tensor_scale.data()[1];
  for (std::size_t o = 0; o < static_cast<std::size_t>(x.layout.outer); ++o)
    for (std::size_t k0 = 0; k0 < pitch; k0 += length) {
      float const block = dequantisation_factor(s[x.layout.slot(o, k0)]);
      float const factor = x.tensor_scale.empty() ? block : block * decode;
      for (std::size_t kk = k0; kk < k0 + length; ++kk) {
        if constexpr (std::is_same_v<Format, float4_e2m1x2>) {
          std::uint8_t const pair = fp4x2_bits(v[(o * pitch + kk) / 2]);
          out[o * pitch + kk] = e2m1_to_float(kk % 2 == 0 ? pair & 0xFu : pair >> 4) * factor;
        } else {
          out[o * pitch + kk] = cast<float>(v[o * pitch + kk]) * factor;
        }
      }
    }
  return out;
}

//! cuBLASLt's 1x128 and 128x128 scale modes take its M and N only in multiples of 4 (the
//! cuBLAS documentation, "Scaling factors layouts"); its N is our M, A's rows (its
//! operands are our B and A), and our N is a multiple of 16 already. Where A's rows are
//! not, they are padded with zero rows (exact: they add nothing) and the product goes to
//! a C of the padded rows, whose first M rows are copied out. The scales need no change:
//! these layouts already hold pad4(M) rows (1x128) or whole 128-row tiles (128x128).
//! Both executors pad, so the host suite runs what the GPU runs.
inline constexpr std::int64_t block_scaled_row_multiple = 4;
inline bool block_scaled_rows_padded(fp8_block_scale_layout const& a) noexcept {
  return (a.kind == fp8_block_kind::vec128 || a.kind == fp8_block_kind::tile128) &&
         a.outer % block_scaled_row_multiple != 0;
}

//! NVFP4 on the GPU: {alpha * decode(A) * decode(B), beta} where cuBLASLt reads them.
struct nvfp4_alpha_beta {
  float* out;
  float const* a_tensor_scale;
  float const* b_tensor_scale;
  float alpha, beta;
  MPX_HD void operator()() const noexcept {
    out[0] = alpha * (a_tensor_scale[1] * b_tensor_scale[1]);
    out[1] = beta;
  }
};

//! What cuBLASLt's block-scaled products need of the operands and the device (`cc`, the
//! current one's), checked before anything is launched: fp8_gemm's layout and alignment
//! rules, the scales 16-byte aligned too, and a device that has the operands' scale
//! mode (rowwise, 1x128 and 128x128 blocks: Hopper only; 1x32 and 1x16: Blackwell on).
template <class FA, class FB, memory_space Space, class SA, class SB, class TC>
void check_block_gemm_device(gemm_dims const& d, gemm_options const& o, fp8_block_operand<FA, Space, SA> const& a,
                             fp8_block_operand<FB, Space, SB> const& b, TC const* c, compute_capability cc,
                             mpx::source_location loc) {
  check_fp8_gemm_device(d, o, a.values.data(), b.values.data(), c, cc, loc);
  if (reinterpret_cast<std::uintptr_t>(a.inverse_scales.data()) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(b.inverse_scales.data()) % 16 != 0)
    fail<invalid_argument>("fp8_block_gemm",
                           "on the GPU the inverse scales must start at 16-byte aligned addresses (a view at an "
                           "offset may not); copy them into a tensor of their own",
                           loc);
  bool const blackwell_mode = a.layout.swizzled();
  if (blackwell_mode ? cc.major >= 10 : cc.major == 9) return;
  fail<invalid_argument>(
      "fp8_block_gemm",
      std::string(blackwell_mode ? std::string("cuBLASLt offers ") +
                                       (a.layout.kind == fp8_block_kind::vec16
                                            ? "NVFP4 products (1x16 blocks, e4m3 scales)"
                                            : "MXFP8 products (1x32 blocks, E8M0 scales)") +
                                       " on Blackwell (sm_100) and newer"
                                 : "cuBLASLt offers these block scale modes (rowwise, 1x128, 128x128) on Hopper "
                                   "(sm_90) only") +
          "; this device is sm_" + std::to_string(cc.major) + "x. Use mpx::fp8_gemm with per-tensor scales here",
      loc);
}

//! Packed e2m1 pairs are cuBLASLt's CUDA_R_4F_E2M1 (its extents count values, not bytes).
template <>
inline constexpr cudaDataType_t cuda_data_type<float4_e2m1x2> = CUDA_R_4F_E2M1;

//! How cuBLASLt applies the scales of a kind's blocks.
constexpr lt_operand_scaling lt_scaling_of(fp8_block_kind k) noexcept {
  switch (k) {
    case fp8_block_kind::row: return lt_operand_scaling::row;
    case fp8_block_kind::vec128: return lt_operand_scaling::vec128;
    case fp8_block_kind::vec32: return lt_operand_scaling::vec32;
    case fp8_block_kind::vec16: return lt_operand_scaling::vec16;
    case fp8_block_kind::tile128: break;
  }
  return lt_operand_scaling::tile128;
}

}  // namespace detail

//! C = alpha * A B^T + beta * C, A [M, K] and B [N, K] quantized in blocks (values times
//! their blocks' inverse scales), summed in float. C holds half, bfloat16 or float,
//! [M, N], in the executor's memory.
//!
//! Error: a dequantised value is exact with power-of-two scales (block_scaling's
//! default, and always for vec32's E8M0 scales) and within 2^-24 relative otherwise
//! (NVFP4's: the block scale times the decode factor, rounded once); the float sums add
//! at most (K + 4) 2^-24 |alpha| sum_k |a||b| + |beta C0|, plus C's rounding, on the
//! host. The GPU sums each 128-long run of K on its tensor cores and promotes to float
//! between runs; for NVFP4 its alpha carries both decode factors, amax(A) amax(B) / 2688^2,
//! which overflows a float (inf or NaN in C) when the two tensors' largest magnitudes
//! multiply past about 2.4e45, and loses precision (0 below about 2^-126 * 2688^2) when
//! they multiply below about 2^-103; the host is exact in both cases.
//!
//! Refused before anything runs (mpx::shape_error or mpx::invalid_argument, naming the
//! operand): values or scales not as their layouts say, rowwise or 1x32 blocks with other
//! blocks, two 128x128 operands, K that differs, N not a multiple of 16, C not [M, N], C
//! overlapping an operand. On a cuda_executor too: pointers (scales included) not
//! 16-byte aligned; for rowwise, 1x128 and 128x128 blocks a device other than Hopper
//! (sm_90), for 1x32 blocks one older than Blackwell (sm_100). Under 1x128 and 128x128
//! blocks an M that is not a multiple of 4 costs a padded copy of A and of C.
template <executor Exec, class FA, class FB, memory_space Space, class SA, class SB, tensor_like C>
void fp8_block_gemm([[maybe_unused]] Exec const& exec, fp8_block_operand<FA, Space, SA> const& a,
                    fp8_block_operand<FB, Space, SB> const& b, C&& c, float alpha = 1.0f, float beta = 0.0f,
                    mpx::source_location loc = mpx::source_location::current()) {
  detail::check_block_gemm_types<FA, FB, value_t<C>>();
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
  // 1x128 and 128x128 blocks with M not a multiple of 4: the product of zero-padded
  // copies of A and C (after the device's checks, so nothing is copied to be refused).
  bool const pad_rows = !std::is_same_v<FA, float4_e2m1x2> && detail::block_scaled_rows_padded(a.layout);
  auto const padded_product = [&] {
    if constexpr (!std::is_same_v<FA, float4_e2m1x2>) {
      using TC = std::remove_const_t<value_t<C>>;
      std::int64_t const rows = fp8_block_scale_layout::up(m, detail::block_scaled_row_multiple);
      tensor<FA, Space> values(exec, shape{rows, k});
      auto const flat = values.view().reshape(shape{rows * k});
      copy(exec, a.values.reshape(shape{m * k}), flat.flat(0, static_cast<std::size_t>(m * k)));
      fill(exec, flat.flat(static_cast<std::size_t>(m * k), static_cast<std::size_t>((rows - m) * k)), cast<FA>(0.0f));
      fp8_block_operand<FA, Space, SA> const padded{values.view(), a.inverse_scales, {a.layout.kind, rows, a.layout.k},
                                                    a.tensor_scale};
      tensor<TC, Space> product(exec, shape{rows, n});
      auto const first_rows = product.view().reshape(shape{rows * n}).flat(0, static_cast<std::size_t>(m * n)).reshape(cv.shape());
      if (beta != 0.0f) {  // C's rows as beta reads them; the padding's rows zero (read, never kept)
        copy(exec, cv, first_rows);
        fill(exec, product.view().reshape(shape{rows * n}).flat(static_cast<std::size_t>(m * n),
                                                                static_cast<std::size_t>((rows - m) * n)),
             cast<TC>(0.0f));
      }
      fp8_block_gemm(exec, padded, b, product, alpha, beta, loc);
      copy(exec, first_rows, cv);
    }
  };
  if constexpr (is_host_executor_v<Exec>) {
    if (pad_rows) return padded_product();
    if (cv.empty() || detail::gemm_without_products(exec, cv, d, o)) return;
    float const* af = detail::host_dequantize_blocks<0>(a);
    float const* bf = detail::host_dequantize_blocks<1>(b);
    detail::host_gemm<float>(d, false, true, alpha, af, bf, beta, cv.data());
  } else {
#if MPX_HAS_CUDA
    detail::check_block_gemm_device(d, o, a, b, cv.data(), detail::current_compute_capability(), loc);
    if (pad_rows) return padded_product();
    if (cv.empty() || detail::gemm_without_products(exec, cv, d, o)) return;
    // cuBLASLt's A is our B (see cuda_gemm): its scales and mode come first.
    detail::lt_operand_scales scales{b.inverse_scales.data(), a.inverse_scales.data(),
                                     detail::lt_scaling_of(b.layout.kind), detail::lt_scaling_of(a.layout.kind)};
    if constexpr (std::is_same_v<FA, float4_e2m1x2>) {
      // The decode factors live on the device: alpha and beta go to cuBLASLt by device
      // pointer, from a stream-ordered pair written in stream order.
      tensor<float, memory_space_t<Exec>> const alpha_beta(exec, shape{2});
      run_once(exec, detail::nvfp4_alpha_beta{alpha_beta.data(), a.tensor_scale.data(), b.tensor_scale.data(), alpha, beta});
      scales.device_alpha_beta = alpha_beta.data();
      detail::cuda_gemm<float>(exec.stream(), d, false, true, alpha, a.values.data(), b.values.data(), beta, cv.data(),
                               scales);
    } else {
      detail::cuda_gemm<float>(exec.stream(), d, false, true, alpha, a.values.data(), b.values.data(), beta, cv.data(),
                               scales);
    }
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
