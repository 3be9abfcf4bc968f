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
#include <cstdint>
#include <cstring>
#include <type_traits>

// F16C through the compiler's builtins on its vector types, and the CPU check through
// cpuid, rather than <immintrin.h>: that header declares every AVX-512 intrinsic, some
// 55,000 lines that each user translation unit would parse (a second under nvcc).
#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
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
//! Whether this CPU converts half in hardware and the OS saves the AVX registers
//! (asked once per process): cpuid leaf 1 has F16C (ECX bit 29), AVX (bit 28) and
//! OSXSAVE (bit 27); XCR0 must enable the SSE and AVX state (bits 1 and 2).
inline bool host_has_f16c() noexcept {
  static bool const has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    constexpr unsigned f16c = 1u << 29, avx = 1u << 28, osxsave = 1u << 27;
    if ((c & (f16c | avx | osxsave)) != (f16c | avx | osxsave)) return false;
    unsigned xcr0_low = 0, xcr0_high = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    std::uint64_t const xcr0 = std::uint64_t{xcr0_high} << 32 | xcr0_low;
    return (xcr0 & 0x6u) == 0x6u;
  }();
  return has;
}

// Eight halves and eight floats as the compiler's vector types (what _mm256_cvtph_ps
// and _mm256_cvtps_ph take).
using eight_halves = short __attribute__((vector_size(16)));
using eight_floats = float __attribute__((vector_size(32)));

// One unordered compare of the vector with itself and its sign mask (vcmpps, vmovmskps):
// a loop over v[k] compiles to eight scalar compares of a copy on the stack, which was
// most of the conversions' time (bench/NOTES.md).
__attribute__((target("avx,f16c"))) inline bool any_nan(eight_floats const& v) noexcept {
  constexpr int unordered_quiet = 3;  // _CMP_UNORD_Q: true where either operand is a NaN
  return __builtin_ia32_movmskps256(__builtin_ia32_cmpps256(v, v, unordered_quiet)) != 0;
}

// The F16C loops convert eight at a time and hand a group holding a NaN to the
// element-wise code: the instructions quiet a signalling NaN and keep a payload where
// mpx's cast keeps the pattern (widening) or gives the canonical quiet NaN (rounding).
__attribute__((target("avx,f16c"))) inline void widen_half_f16c(half const* x, float* out,
                                                                 std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    eight_halves h;
    std::memcpy(&h, x + i, sizeof h);
    eight_floats const v = __builtin_ia32_vcvtph2ps256(h);
    if (any_nan(v)) {
      for (std::size_t k = i; k < i + 8; ++k) out[k] = widen_16_to_float(x[k]);
    } else {
      std::memcpy(out + i, &v, sizeof v);
    }
  }
  for (; i < n; ++i) out[i] = widen_16_to_float(x[i]);
}

__attribute__((target("avx,f16c"))) inline void round_half_f16c(float const* x, half* out,
                                                                std::size_t n) noexcept {
  constexpr int nearest_even_no_exceptions = 0x08;  // _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    eight_floats v;
    std::memcpy(&v, x + i, sizeof v);
    if (any_nan(v)) {
      for (std::size_t k = i; k < i + 8; ++k) out[k] = round_float_to_16<half>(x[k]);
    } else {
      eight_halves const h = __builtin_ia32_vcvtps2ph256(v, nearest_even_no_exceptions);
      std::memcpy(static_cast<void*>(out + i), &h, sizeof h);
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

//! Every value of an 8-bit format as float, indexed by its bit pattern: widening an fp8
//! array is one load per element.
template <class T>
inline constexpr auto fp8_widening_table = [] {
  struct table {
    float value[256];
  } t{};
  for (unsigned i = 0; i < 256; ++i) t.value[i] = widen_8_to_float(bit_cast<T>(static_cast<std::uint8_t>(i)));
  return t;
}();

//! out[i] = x[i] as float, exactly, for i < n (a 16- or 8-bit x must not overlap out).
template <class T>
void widen_span(T const* x, float* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n != 0 && out != x) std::memmove(out, x, n * sizeof(float));
  } else if constexpr (dtype8<T>) {
    auto const& table = fp8_widening_table<T>.value;
    for (std::size_t i = 0; i < n; ++i) out[i] = table[bit_cast<std::uint8_t>(x[i])];
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
    for (std::size_t i = 0; i < n; ++i) out[i] = widen_to_float(x[i]);
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
