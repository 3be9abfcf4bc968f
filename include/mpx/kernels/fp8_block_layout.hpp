// Block-scaled fp8's and NVFP4's layout (scaling/fp8_block_scaling.hpp holds the
// recipes): how an operand's values share scales, each block's scale, and where the scales lie in memory
// (the layouts cuBLASLt's block scale modes read). Used by the quantize pass
// (fp8_block_quantize.hpp, nvfp4_quantize.hpp) and the product (fp8_block_gemm.hpp).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/block_formats.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mpx {

//! How the values of an operand [outer, K] (K contiguous) share scales.
enum class fp8_block_kind {
  row,      //!< one scale per row of K values
  vec128,   //!< one per 128 consecutive values along K (1x128)
  tile128,  //!< one per 128x128 tile (128 rows of outer by 128 of K)
  vec32,    //!< one per 32 consecutive values along K, an E8M0 power of two (MXFP8)
  vec16,    //!< one per 16 consecutive values along K, an unsigned e4m3 (NVFP4's e2m1 values)
};

//! The block edge of vec128 and tile128, and what K is padded to (with zeros) for them.
inline constexpr std::int64_t fp8_block_length = 128;
//! The block length of vec32 (MXFP8), and what K is padded to for it.
inline constexpr std::int64_t mx_block_length = 32;
//! The block length of vec16 (NVFP4). K is padded to twice that: 16 bytes of packed
//! e2m1 values, the alignment cuBLASLt's rows need.
inline constexpr std::int64_t nvfp4_block_length = 16;

//! The smallest amax a block's scale is computed from. An all-zero or all-subnormal
//! block would otherwise get a scale of inf (and 0 * inf = NaN); from 2^-110 the scale
//! max(e4m3) / amax is at most 2^119 (2^118 as a power of two), finite, and its inverse
//! a normal float. The cost: values below about 2^-119 * max(format) / 2 in such a
//! block quantize to zero.
inline constexpr float fp8_block_amax_floor = 0x1p-110f;

//! Where the scales of an operand [outer, k] (K contiguous; k before padding) lie: the
//! layouts cuBLASLt's scale modes read, with outer = M for A and N for B.
//!   row:     `outer` floats, one per row (OUTER_VEC_32F);
//!   vec128:  [k_blocks, pad4(outer)] floats, outer fastest (VEC128_32F, "outer-dim-major");
//!   tile128: [outer_blocks, pad4(k_blocks)] floats, K blocks fastest (BLK128x128_32F);
//!   vec32:   E8M0 bytes in 512-byte tiles of 128 rows by 4 blocks (VEC32_UE8M0), the
//!            tiles row by row ([pad128(outer) / 128, pad4(k_blocks) / 4]); inside a
//!            tile, row r and block c at (r % 32) * 16 + (r / 32) * 4 + c;
//!   vec16:   unsigned e4m3 bytes (float8_e4m3, sign clear) in the same tiles
//!            (VEC16_UE4M3), a tile covering 128 rows by 4 blocks of 16.
//! The padding (to 16-byte rows, or to whole tiles) holds valid scales nobody reads.
struct fp8_block_scale_layout {
  fp8_block_kind kind = fp8_block_kind::vec128;
  std::int64_t outer = 0;  //!< rows of the operand (M of A, N of B)
  std::int64_t k = 0;      //!< values per row before padding

  MPX_HD static constexpr std::int64_t up(std::int64_t n, std::int64_t m) noexcept { return (n + m - 1) / m * m; }
  //! Values along K that share a scale (all of K for row blocks).
  [[nodiscard]] MPX_HD constexpr std::int64_t block_length() const noexcept {
    switch (kind) {
      case fp8_block_kind::row: return padded_k();
      case fp8_block_kind::vec32: return mx_block_length;
      case fp8_block_kind::vec16: return nvfp4_block_length;
      case fp8_block_kind::vec128:
      case fp8_block_kind::tile128: break;
    }
    return fp8_block_length;
  }
  //! The K the quantized values are stored with: k padded with zeros to a multiple of
  //! the block length (128, or 32 for vec32), of 32 for vec16 (16 bytes of e2m1 pairs),
  //! or of 16 for row blocks, as cuBLASLt's fp8 and fp4 products need.
  [[nodiscard]] MPX_HD constexpr std::int64_t padded_k() const noexcept {
    switch (kind) {
      case fp8_block_kind::row: return up(k, 16);
      case fp8_block_kind::vec32: return up(k, mx_block_length);
      case fp8_block_kind::vec16: return up(k, 2 * nvfp4_block_length);
      case fp8_block_kind::vec128:
      case fp8_block_kind::tile128: break;
    }
    return up(k, fp8_block_length);
  }
  [[nodiscard]] MPX_HD constexpr std::int64_t k_blocks() const noexcept {
    return kind == fp8_block_kind::row ? 1 : padded_k() / block_length();
  }
  [[nodiscard]] MPX_HD constexpr std::int64_t outer_blocks() const noexcept {
    return kind == fp8_block_kind::tile128 ? up(outer, fp8_block_length) / fp8_block_length : outer;
  }
  //! Whether the scales are E8M0 bytes (vec32) rather than floats.
  [[nodiscard]] MPX_HD constexpr bool e8m0_scales() const noexcept { return kind == fp8_block_kind::vec32; }
  //! Whether the scales are unsigned e4m3 bytes (vec16, NVFP4) rather than floats.
  [[nodiscard]] MPX_HD constexpr bool e4m3_scales() const noexcept { return kind == fp8_block_kind::vec16; }
  //! Whether the scales lie in cuBLASLt's swizzled 128x4 tiles (vec32 and vec16).
  [[nodiscard]] MPX_HD constexpr bool swizzled() const noexcept {
    return kind == fp8_block_kind::vec32 || kind == fp8_block_kind::vec16;
  }
  //! Scales (floats, E8M0 bytes for vec32, e4m3 bytes for vec16) the layout takes,
  //! padding included.
  [[nodiscard]] MPX_HD constexpr std::int64_t count() const noexcept {
    switch (kind) {
      case fp8_block_kind::row: return outer;
      case fp8_block_kind::vec128: return k_blocks() * up(outer, 4);
      case fp8_block_kind::vec32:
      case fp8_block_kind::vec16: return up(outer, 128) * up(k_blocks(), 4);
      case fp8_block_kind::tile128: break;
    }
    return outer_blocks() * up(k_blocks(), 4);
  }
  //! The slot of the scale of value (o, kk), kk < padded_k().
  [[nodiscard]] MPX_HD constexpr std::size_t slot(std::size_t o, std::size_t kk) const noexcept {
    switch (kind) {
      case fp8_block_kind::row: return o;
      case fp8_block_kind::vec128:
        return kk / static_cast<std::size_t>(fp8_block_length) * static_cast<std::size_t>(up(outer, 4)) + o;
      case fp8_block_kind::vec32:
      case fp8_block_kind::vec16: {
        std::size_t const kb = kk / static_cast<std::size_t>(block_length());
        std::size_t const tiles_across = static_cast<std::size_t>(up(k_blocks(), 4)) / 4;
        std::size_t const tile = o / 128 * tiles_across + kb / 4;
        return tile * 512 + o % 32 * 16 + o % 128 / 32 * 4 + kb % 4;
      }
      case fp8_block_kind::tile128: break;
    }
    return o / static_cast<std::size_t>(fp8_block_length) * static_cast<std::size_t>(up(k_blocks(), 4)) +
           kk / static_cast<std::size_t>(fp8_block_length);
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

//! A block's scale (the factor its values are multiplied by before the cast) and its
//! inverse as the block's slot holds it: a float, or for vec32 blocks the E8M0 power of
//! two from mx_block_exponent. Both from the block's largest finite magnitude, floored at
//! fp8_block_amax_floor.
template <class Scale>
struct block_scale_pair {
  float scale;
  Scale inverse;
};
template <class Format, class Scale>
MPX_HD inline block_scale_pair<Scale> block_scale_from_amax(float finite_amax, bool power_of_two) noexcept {
  if constexpr (std::is_same_v<Scale, float8_e8m0>) {
    float const a = finite_amax > fp8_block_amax_floor ? finite_amax : fp8_block_amax_floor;
    int const e = mx_block_exponent<Format>(a);  // within [-125, 120]: both powers are normal floats
    return {bit_cast<float>(static_cast<std::uint32_t>(127 - e) << 23), e8m0_from_bits(static_cast<std::uint8_t>(e + 127))};
  } else {
    float const s = fp8_block_scale<Format>(finite_amax, power_of_two);
    return {s, 1.0f / s};
  }
}

//! What a slot's inverse scale multiplies its block's values by, as a float.
MPX_HD inline float dequantisation_factor(float inverse) noexcept { return inverse; }
MPX_HD inline float dequantisation_factor(float8_e8m0 inverse) noexcept { return e8m0_to_float(inverse); }
MPX_HD inline float dequantisation_factor(float8_e4m3 block_scale) noexcept { return cast<float>(block_scale); }

}  // namespace detail
}  // namespace mpx
