#pragma once
// Host conversions of whole arrays between a 16-bit type and float, for the host
// kernels that widen an operand before a float loop (or a BLAS call) and round the
// result once. Bit for bit what the element-wise detail::widen_16_to_float and
// detail::round_float_to_16 give, NaNs included; for half on an x86-64 CPU with F16C
// they convert eight elements per instruction (about 3x faster over a 4M-element array
// on the CI machine, 15-20x when the array sits in cache). bfloat16 is the top half of
// a float: SSE2 (part of x86-64) converts it eight at a time, 3-5x faster than the
// element-wise loop on rows that sit in cache (bench/NOTES.md). Host only: device code
// converts in registers, element by element, with the hardware's instructions.

#include <mpx/core/cast.hpp>

#include <cstddef>
#include <cstring>
#include <type_traits>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MPX_HOST_F16C 1
#else
#define MPX_HOST_F16C 0
#endif
// SSE2 is part of x86-64 itself: no CPU check needed.
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define MPX_HOST_SSE2 1
#else
#define MPX_HOST_SSE2 0
#endif

namespace mpx::detail {

#if MPX_HOST_F16C
//! Whether this CPU converts half in hardware (asked once per process).
inline bool host_has_f16c() noexcept {
  // __builtin_cpu_init first: this may run in a static initialiser, before GCC's own.
  static bool const has = (__builtin_cpu_init(), __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"));
  return has;
}

// The F16C loops convert eight at a time and hand a group holding a NaN to the
// element-wise code: the instructions quiet a signalling NaN and keep a payload where
// mpx's cast keeps the pattern (widening) or gives the canonical quiet NaN (rounding).
__attribute__((target("avx,f16c"))) inline void widen_half_f16c(half const* x, float* out,
                                                                 std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 const v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(x + i)));
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) {
      for (std::size_t k = i; k < i + 8; ++k) out[k] = widen_16_to_float(x[k]);
    } else {
      _mm256_storeu_ps(out + i, v);
    }
  }
  for (; i < n; ++i) out[i] = widen_16_to_float(x[i]);
}

__attribute__((target("avx,f16c"))) inline void round_half_f16c(float const* x, half* out,
                                                                std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 const v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) {
      for (std::size_t k = i; k < i + 8; ++k) out[k] = round_float_to_16<half>(x[k]);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  for (; i < n; ++i) out[i] = round_float_to_16<half>(x[i]);
}
#endif

#if MPX_HOST_SSE2
// bfloat16 in SSE2, eight per step, bit for bit the element-wise code: widening puts
// the pattern in the top half of a zero float (a NaN keeps its payload, as the shift
// does); rounding adds 0x7FFF plus the kept bit's lowest and takes the top half, and a
// NaN becomes the canonical quiet NaN. An arithmetic shift by 16 sign-extends the top
// half, so the signed saturating pack keeps its sixteen bits exactly.
inline void widen_bfloat16_sse2(bfloat16 const* x, float* out, std::size_t n) noexcept {
  __m128i const zero = _mm_setzero_si128();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i const v = _mm_loadu_si128(reinterpret_cast<__m128i const*>(x + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi16(zero, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 4), _mm_unpackhi_epi16(zero, v));
  }
  for (; i < n; ++i) out[i] = widen_16_to_float(x[i]);
}

inline __m128i round_four_to_bfloat16_sse2(float const* x) noexcept {
  __m128i const u = _mm_loadu_si128(reinterpret_cast<__m128i const*>(x));
  __m128i const magnitude = _mm_and_si128(u, _mm_set1_epi32(0x7FFF'FFFF));
  __m128i const is_nan = _mm_cmpgt_epi32(magnitude, _mm_set1_epi32(0x7F80'0000));
  __m128i const lowest_kept = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  __m128i const rounded = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7FFF), lowest_kept));
  __m128i const nan = _mm_set1_epi32(static_cast<int>(std::uint32_t{bits(dtype_traits<bfloat16>::quiet_nan())} << 16));
  __m128i const chosen = _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, rounded));
  return _mm_srai_epi32(chosen, 16);
}

inline void round_bfloat16_sse2(float const* x, bfloat16* out, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i const packed = _mm_packs_epi32(round_four_to_bfloat16_sse2(x + i), round_four_to_bfloat16_sse2(x + i + 4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = round_float_to_16<bfloat16>(x[i]);
}
#endif

//! out[i] = x[i] as float, exactly, for i < n (a 16-bit x must not overlap out).
template <class T>
void widen_span(T const* x, float* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n != 0 && out != x) std::memmove(out, x, n * sizeof(float));
#if MPX_HOST_SSE2
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    widen_bfloat16_sse2(x, out, n);
#endif
  } else {
#if MPX_HOST_F16C
    if constexpr (std::is_same_v<T, half>) {
      if (host_has_f16c()) return widen_half_f16c(x, out, n);
    }
#endif
    for (std::size_t i = 0; i < n; ++i) out[i] = widen_16_to_float(x[i]);
  }
}

//! out[i] = x[i] rounded to nearest even in T, for i < n (a 16-bit out must not overlap x).
template <class T>
void round_span(float const* x, T* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n != 0 && out != x) std::memmove(out, x, n * sizeof(float));
#if MPX_HOST_SSE2
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    round_bfloat16_sse2(x, out, n);
#endif
  } else {
#if MPX_HOST_F16C
    if constexpr (std::is_same_v<T, half>) {
      if (host_has_f16c()) return round_half_f16c(x, out, n);
    }
#endif
    for (std::size_t i = 0; i < n; ++i) out[i] = round_float_to_16<T>(x[i]);
  }
}

}  // namespace mpx::detail
