// Block-scaled fp8's layout (scaling/fp8_block_scaling.hpp holds the recipes): how an
// operand's values share scales, each block's scale, and where the scales lie in memory
// (the layouts cuBLASLt's block scale modes read). Used by the quantize pass
// (fp8_block_quantize.hpp) and the product (fp8_block_gemm.hpp).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <cstddef>
#include <cstdint>

namespace mpx {

//! How the values of an operand [outer, K] (K contiguous) share scales.
enum class fp8_block_kind {
  row,      //!< one scale per row of K values
  vec128,   //!< one per 128 consecutive values along K (1x128)
  tile128,  //!< one per 128x128 tile (128 rows of outer by 128 of K)
};

//! The block edge of vec128 and tile128, and what K is padded to (with zeros) for them.
inline constexpr std::int64_t fp8_block_length = 128;

//! The smallest amax a block's scale is computed from. An all-zero or all-subnormal
//! block would otherwise get a scale of inf (and 0 * inf = NaN); from 2^-110 the scale
//! max(e4m3) / amax is at most 2^119 (2^118 as a power of two), finite, and its inverse
//! a normal float. The cost: values below about 2^-119 * max(format) / 2 in such a
//! block quantize to zero.
inline constexpr float fp8_block_amax_floor = 0x1p-110f;

//! Where the scales of an operand [outer, k] (K contiguous; k before padding) lie: the
//! layouts cuBLASLt's scale modes read, with outer = M for A and N for B.
//!   row:     `outer` floats, one per row (OUTER_VEC_32F);
//!   vec128:  [k_blocks, pad4(outer)], outer fastest (VEC128_32F, "outer-dim-major");
//!   tile128: [outer_blocks, pad4(k_blocks)], K blocks fastest (BLK128x128_32F).
//! The padding (to multiples of 4 floats: 16-byte rows) holds valid scales nobody reads.
struct fp8_block_scale_layout {
  fp8_block_kind kind = fp8_block_kind::vec128;
  std::int64_t outer = 0;  //!< rows of the operand (M of A, N of B)
  std::int64_t k = 0;      //!< values per row before padding

  MPX_HD static constexpr std::int64_t up(std::int64_t n, std::int64_t m) noexcept { return (n + m - 1) / m * m; }
  //! The K the quantized values are stored with: k padded with zeros to a multiple of
  //! 128 (vec128, tile128) or 16 (row), as cuBLASLt's fp8 products need.
  [[nodiscard]] MPX_HD constexpr std::int64_t padded_k() const noexcept {
    return up(k, kind == fp8_block_kind::row ? 16 : fp8_block_length);
  }
  [[nodiscard]] MPX_HD constexpr std::int64_t k_blocks() const noexcept {
    return kind == fp8_block_kind::row ? 1 : padded_k() / fp8_block_length;
  }
  [[nodiscard]] MPX_HD constexpr std::int64_t outer_blocks() const noexcept {
    return kind == fp8_block_kind::tile128 ? up(outer, fp8_block_length) / fp8_block_length : outer;
  }
  //! Floats the scales take, padding included.
  [[nodiscard]] MPX_HD constexpr std::int64_t count() const noexcept {
    switch (kind) {
      case fp8_block_kind::row: return outer;
      case fp8_block_kind::vec128: return k_blocks() * up(outer, 4);
      case fp8_block_kind::tile128: break;
    }
    return outer_blocks() * up(k_blocks(), 4);
  }
  //! The slot of the scale of value (o, kk), kk < padded_k().
  [[nodiscard]] MPX_HD constexpr std::size_t slot(std::size_t o, std::size_t kk) const noexcept {
    auto const kb = static_cast<std::size_t>(kk) / static_cast<std::size_t>(fp8_block_length);
    switch (kind) {
      case fp8_block_kind::row: return o;
      case fp8_block_kind::vec128: return kb * static_cast<std::size_t>(up(outer, 4)) + o;
      case fp8_block_kind::tile128: break;
    }
    return o / static_cast<std::size_t>(fp8_block_length) * static_cast<std::size_t>(up(k_blocks(), 4)) + kb;
  }
};

namespace detail {

//! A block's quantization scale (the factor its values are multiplied by before the
//! cast) from the largest finite magnitude in it: max(Format) / max(amax, floor),
//! rounded down to a power of two when asked. Always positive and finite.
template <class Format>
MPX_HD inline float fp8_block_scale(float finite_amax, bool power_of_two) noexcept {
  float const a = finite_amax > fp8_block_amax_floor ? finite_amax : fp8_block_amax_floor;
  float const s = cast<float>(dtype_traits<Format>::max()) / a;
  return power_of_two ? bit_cast<float>(bit_cast<std::uint32_t>(s) & 0x7F80'0000u) : s;
}

}  // namespace detail
}  // namespace mpx
