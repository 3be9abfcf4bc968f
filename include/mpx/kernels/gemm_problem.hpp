// What identifies one cuBLASLt matrix product, the key of its cached plan, and the
// message a product cuBLASLt has no algorithm for gets. Plain C++ (CUDA's data type
// enumerators come from library_types.h, a header every mpx build has), so the host
// suite checks the problem a product becomes and what its refusal says; cublaslt.hpp
// turns a problem into cuBLASLt's descriptors.
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

  auto tie() const {
    return std::tie(device, a_type, b_type, c_type, half_sums, transpose_a, transpose_b, a_rows, a_cols, b_rows,
                    b_cols, c_rows, c_cols, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, align_a, align_b,
                    align_c, a_scaling, b_scaling, alpha_beta_on_device);
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
