// Four floats (or int32s) as one SSE register, in GCC/Clang vector types, for the host
// loops that GCC at -O2 does not vectorise by itself (its "very cheap" cost model): the
// host gemm's micro-kernel and max pooling's channel scan. Other compilers get nothing
// here and those loops fall back to plain code.
#pragma once

#include <cstdint>

namespace mpx::detail {

#if defined(__GNUC__)
using float4_vector = float __attribute__((vector_size(16)));
using int4_vector = std::int32_t __attribute__((vector_size(16)));

//! Four floats from p, which need not be 16-byte aligned.
inline float4_vector load_float4(float const* p) noexcept {
  float4_vector v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
#endif

}  // namespace mpx::detail
