// Small MPX_HD arithmetic helpers that must round identically on host and device.
#pragma once

#include <mpx/core/config.hpp>

#include <cmath>

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

}  // namespace mpx
