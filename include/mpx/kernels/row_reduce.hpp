// Reductions within a warp and within a block, for kernels that give each row of a
// tensor to a warp or a block (softmax, losses, column sums). Every lane gets the same
// result, and the order of the additions depends only on the launch shape, so results
// are reproducible run after run. CUDA-only by nature, except the NaN-keeping max.
#pragma once

#include <mpx/core/config.hpp>

namespace mpx::detail {

//! max(a, b) that keeps a NaN from either side: fmaxf drops NaN and returns the other
//! operand, so a row holding a NaN would yield finite, wrong probabilities.
MPX_HD inline float max_keeping_nan(float a, float b) noexcept { return (a > b || a != a) ? a : b; }

//! The combining operations of the reductions below, with their neutral elements.
struct sum_float {
  MPX_HD static float identity() noexcept { return 0.0f; }
  MPX_HD float operator()(float a, float b) const noexcept { return a + b; }
};
struct max_float {
  MPX_HD static float identity() noexcept { return -__builtin_huge_valf(); }
  MPX_HD float operator()(float a, float b) const noexcept { return max_keeping_nan(a, b); }
};
struct min_u64 {
  MPX_HD static unsigned long long identity() noexcept { return ~0ull; }
  MPX_HD unsigned long long operator()(unsigned long long a, unsigned long long b) const noexcept {
    return a < b ? a : b;
  }
};

#if MPX_HAS_CUDA
//! Combines v over the 32 lanes of a warp (all lanes active). A butterfly: lane l adds
//! v[l] and v[l ^ o], and since a + b == b + a exactly, every lane ends with the same bits.
template <class T, class Op>
__device__ __forceinline__ T warp_all_reduce(T v, Op op) {
  MPX_UNROLL
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

//! Combines v over the whole block (blockDim.x a multiple of 32, at most 1024) and
//! returns the result to every thread. `scratch` is 32 elements of shared memory; the
//! call may be repeated with the same scratch.
template <class T, class Op>
__device__ __forceinline__ T block_all_reduce(T v, Op op, T* scratch) {
  v = warp_all_reduce(v, op);
  unsigned const lane = threadIdx.x & 31u;
  unsigned const warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  // Every warp reduces the same values in the same order: no second broadcast needed.
  v = lane < (blockDim.x >> 5) ? scratch[lane] : Op::identity();
  return warp_all_reduce(v, op);
}
#endif

}  // namespace mpx::detail
