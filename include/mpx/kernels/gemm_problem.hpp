// What identifies one cuBLASLt matrix product, the key of its cached plan, what that plan
// sets on cuBLASLt's descriptors, and the message a product cuBLASLt has no algorithm for
// gets. Plain C++ (CUDA's data type enumerators come from library_types.h, a header every
// mpx build has), so the host suite checks the problem a product becomes, its plan's
// settings and what its refusal says; cublaslt.hpp applies the settings with cuBLASLt.
#pragma once

#include <mpx/core/dtype.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>

namespace mpx::detail {

//! How cuBLASLt applies an operand's scales (its cublasLtMatmulMatrixScale_t): one float
//! for the whole operand (or none: fp8_gemm, gemm), or a scale per block of a layout
//! (fp8_block_gemm: fp8_block_kind's blocks).
enum class lt_operand_scaling : std::uint8_t {
  tensor,   //!< one float, or no scale at all
  row,      //!< OUTER_VEC_32F: a float per row of the operand
  vec128,   //!< VEC128_32F: a float per 128 values along K
  tile128,  //!< BLK128x128_32F: a float per 128 x 128 tile
  vec32,    //!< VEC32_UE8M0: an E8M0 power of two per 32 values along K (MXFP8)
  vec16,    //!< VEC16_UE4M3: an unsigned e4m3 per 16 values along K (NVFP4)
};

//! One product in cuBLASLt's column-major terms (column_major_terms in gemm.hpp: its A is
//! mpx's B, its B mpx's A, its C mpx's C transposed). The same key gets the same plan.
struct lt_problem {
  int device = 0;
  cudaDataType_t a_type = CUDA_R_32F, b_type = CUDA_R_32F, c_type = CUDA_R_32F;
  //! Summed and scaled in half (mpx's half-accumulating policies); else in float, never
  //! TF32: float32 means float.
  bool half_sums = false;
  bool transpose_a = false, transpose_b = false;
  std::uint64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0, c_rows = 0, c_cols = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int32_t batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  std::uint32_t align_a = 0, align_b = 0, align_c = 0;  // bytes: the heuristic needs them
  lt_operand_scaling a_scaling = lt_operand_scaling::tensor, b_scaling = lt_operand_scaling::tensor;
  //! alpha and beta are read from device memory (NVFP4: alpha carries the tensors'
  //! decode factors, which live on the device).
  bool alpha_beta_on_device = false;
  //! Whether the product's calls give A's and B's scale pointers: a plan made with them
  //! has its scale modes set before the heuristic (lt_plan_settings_of), one made without
  //! does not, so the two are different plans.
  bool a_scaled = false, b_scaled = false;

  auto tie() const {
    return std::tie(device, a_type, b_type, c_type, half_sums, transpose_a, transpose_b, a_rows, a_cols, b_rows,
                    b_cols, c_rows, c_cols, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, align_a, align_b,
                    align_c, a_scaling, b_scaling, alpha_beta_on_device, a_scaled, b_scaled);
  }
  friend bool operator<(lt_problem const& x, lt_problem const& y) { return x.tie() < y.tie(); }
  friend bool operator==(lt_problem const& x, lt_problem const& y) { return x.tie() == y.tie(); }
};

//! Device pointers to what cuBLASLt multiplies its A's and B's values by (fp8 operands'
//! dequantisation): one float each, or block scales (floats, E8M0 or e4m3 bytes) in the
//! layout their scaling names. Null: none.
struct lt_operand_scales {
  void const* a = nullptr;
  void const* b = nullptr;
  lt_operand_scaling a_scaling = lt_operand_scaling::tensor, b_scaling = lt_operand_scaling::tensor;
  //! Where alpha and beta are in device memory (two floats), for products whose alpha
  //! the GPU computes (NVFP4's decode factors); null: they are host values.
  float const* device_alpha_beta = nullptr;
};

//! Which schemes cuBLASLt may sum split-K partial products with (its reduction scheme mask).
enum class lt_split_k_sums : std::uint8_t {
  any,           //!< every scheme (C is float: C's type has at least the compute type's precision)
  compute_type,  //!< none, or in the compute type (NONE | COMPUTE_TYPE)
};

//! What make_plan (cublaslt.hpp) sets on a problem's descriptor and heuristic preference,
//! decided here in plain C++ so the host suite checks it; make_plan only applies it, in
//! cuBLASLt's types.
struct lt_plan_settings {
  //! Compute and scale type half (CUBLAS_COMPUTE_16F, CUDA_R_16F); else float (32F).
  bool half_compute = false;
  bool transpose_a = false, transpose_b = false;
  //! alpha and beta are device pointers (CUBLASLT_POINTER_MODE_DEVICE).
  bool device_pointers = false;
  //! The scale modes and pointers are set before the heuristic, which picks kernels by
  //! them (as PyTorch's scaled_gemm and Transformer Engine set them), whenever the
  //! product has scales: block scales on either operand, or a scale pointer.
  bool set_scales = false;
  lt_operand_scaling a_scaling = lt_operand_scaling::tensor, b_scaling = lt_operand_scaling::tensor;
  void const* a_scale = nullptr;
  void const* b_scale = nullptr;
  //! The least alignment (bytes) of A's, B's, C's and D's pointers. The heuristic's
  //! default assumes 256-byte aligned pointers; views at an offset and batch strides can
  //! be less aligned, and an algorithm that needs more would fault. D is C (in place).
  std::uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0;
  //! Split-K partial products must be summed in the compute type. The in-place and
  //! output-type schemes sum them in C's type, which for a 16-bit C rounds every partial
  //! sum to half or bfloat16: one rounding per slice of K, not the one rounding at the
  //! end that gemm's error bound (and docs/gemm.md) promises.
  lt_split_k_sums split_k_sums = lt_split_k_sums::any;
};

//! The settings of problem `p`'s plan, whose first call's scale pointers are `a_scale` and
//! `b_scale` (null: none).
inline lt_plan_settings lt_plan_settings_of(lt_problem const& p, void const* a_scale, void const* b_scale) noexcept {
  lt_plan_settings s;
  s.half_compute = p.half_sums;
  s.transpose_a = p.transpose_a;
  s.transpose_b = p.transpose_b;
  s.device_pointers = p.alpha_beta_on_device;
  bool const blocks = p.a_scaling != lt_operand_scaling::tensor || p.b_scaling != lt_operand_scaling::tensor;
  s.set_scales = blocks || a_scale != nullptr || b_scale != nullptr;
  s.a_scaling = p.a_scaling;
  s.b_scaling = p.b_scaling;
  s.a_scale = a_scale;
  s.b_scale = b_scale;
  s.align_a = p.align_a;
  s.align_b = p.align_b;
  s.align_c = p.align_c;
  s.align_d = p.align_c;
  s.split_k_sums = p.c_type == CUDA_R_32F ? lt_split_k_sums::any : lt_split_k_sums::compute_type;
  return s;
}

//! What the heuristic's answer comes to: an algorithm, or the refusal to report (with
//! lt_no_algorithm_message) and which cuBLAS status names it.
enum class lt_heuristic_outcome : std::uint8_t {
  found,        //!< an algorithm to use
  unsupported,  //!< the query said NOT_SUPPORTED: report its status
  none_found,   //!< the query found nothing: report NOT_SUPPORTED
  failed,       //!< the algorithm it found has a failed state: report that state
};

//! "Not supported" is how the heuristic itself usually says it found nothing: it is
//! reported with the product's shape, like an empty result (any other failed query is a
//! failed call, before this). `found`: how many algorithms it returned; `result_ok`: the
//! first one's state is success.
inline lt_heuristic_outcome lt_heuristic_outcome_of(bool query_unsupported, int found, bool result_ok) noexcept {
  if (query_unsupported) return lt_heuristic_outcome::unsupported;
  if (found < 1) return lt_heuristic_outcome::none_found;
  if (!result_ok) return lt_heuristic_outcome::failed;
  return lt_heuristic_outcome::found;
}

//! An operand type's name in mpx's messages.
inline std::string lt_type_name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_16F: return "half";
    case CUDA_R_16BF: return "bfloat16";
    case CUDA_R_32F: return "float";
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    case CUDA_R_4F_E2M1: return "e2m1";
    default: return "cudaDataType " + std::to_string(static_cast<int>(t));
  }
}

inline std::string lt_operand_name(cudaDataType_t t, lt_operand_scaling scaling) {
  switch (scaling) {
    case lt_operand_scaling::tensor: break;
    case lt_operand_scaling::row: return lt_type_name(t) + " (rowwise scales)";
    case lt_operand_scaling::vec128: return lt_type_name(t) + " (1x128 block scales)";
    case lt_operand_scaling::tile128: return lt_type_name(t) + " (128x128 block scales)";
    case lt_operand_scaling::vec32: return lt_type_name(t) + " (1x32 E8M0 block scales)";
    case lt_operand_scaling::vec16: return lt_type_name(t) + " (1x16 UE4M3 block scales)";
  }
  return lt_type_name(t);
}

//! What mpx::gemm says of a product cuBLASLt has no algorithm for, in mpx's terms (its A
//! is cuBLASLt's B): the shape, the operands and `status`, cuBLASLt's word for it.
inline std::string lt_no_algorithm_message(lt_problem const& p, std::string_view status) {
  std::uint64_t const k = p.transpose_a ? p.a_rows : p.a_cols;
  return "mpx::gemm: cuBLASLt has no algorithm for this product (M x N x K = " + std::to_string(p.c_cols) + " x " +
         std::to_string(p.c_rows) + " x " + std::to_string(k) + ", batch " + std::to_string(p.batch) + "; A " +
         lt_operand_name(p.b_type, p.b_scaling) + ", B " + lt_operand_name(p.a_type, p.a_scaling) + ", C " +
         lt_type_name(p.c_type) + (p.alpha_beta_on_device ? ", alpha on the device" : "") + "): " +
         std::string(status);
}

}  // namespace mpx::detail
