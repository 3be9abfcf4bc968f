// Small MPX_HD arithmetic helpers that must round identically on host and device.
#pragma once

#include <mpx/core/config.hpp>

#include <cmath>
#include <type_traits>

namespace mpx {

//! a * b + c rounded once, on host and device alike (a plain `a * b + c` is contracted
//! into an FMA by nvcc but not by g++, and the results would differ in the last bit).
MPX_HD inline float fma(float a, float b, float c) noexcept {
#if MPX_DEVICE_PASS
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

//! a * b rounded on its own, never fused with a neighbouring addition into an FMA, on
//! host and device alike. Update rules write their products with it: nvcc contracts a
//! plain `a * b + c` into one FMA (one rounding instead of two), and so does g++ where
//! FMA instructions are enabled (-mfma, -march=native, aarch64; its default is
//! -ffp-contract=fast even under -std=c++20), so the host and the GPU would otherwise
//! compute updates that differ in the last bit. (mpx::fma is the fused alternative.)
MPX_HD inline float mul_rn(float a, float b) noexcept {
#if MPX_DEVICE_PASS
  return __fmul_rn(a, b);  // documented never to be merged into a multiply-add
#else
  float product = a * b;
#if defined(__FP_FAST_FMAF) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(product));  // an opaque value: nothing left to fuse with
#elif defined(__FP_FAST_FMAF) && defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(product));
#endif
  return product;
#endif
}

//! a + b rounded on its own: neither operand's product (if it is one) is fused into the
//! addition, on host and device alike. Sums written with it (the reductions' combining
//! operations) add exactly the values their terms round to, so the host's sums and the
//! GPU's agree bit for bit when they add in the same order.
//! For float and double (float64 sums of float terms, as the shadow's error sums).
template <class T>
  requires std::is_same_v<T, float> || std::is_same_v<T, double>
MPX_HD inline T add_rn(T a, T b) noexcept {
#if MPX_DEVICE_PASS
  // documented never to be merged into a multiply-add
  if constexpr (std::is_same_v<T, float>) return __fadd_rn(a, b);
  else return __dadd_rn(a, b);
#else
#if (defined(__FP_FAST_FMAF) || defined(__FP_FAST_FMA)) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(a), "+x"(b));  // opaque operands: nothing left to fuse with
#elif (defined(__FP_FAST_FMAF) || defined(__FP_FAST_FMA)) && defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(a), "+w"(b));
#endif
  return a + b;
#endif
}

//! A float and a double: the float widens (exactly) and the sum is a double, rounded
//! once, as a + b would be.
template <class A, class B>
  requires(!std::is_same_v<A, B> && (std::is_same_v<A, float> || std::is_same_v<A, double>) &&
           (std::is_same_v<B, float> || std::is_same_v<B, double>))
MPX_HD inline double add_rn(A a, B b) noexcept {
  return add_rn(static_cast<double>(a), static_cast<double>(b));
}

}  // namespace mpx
