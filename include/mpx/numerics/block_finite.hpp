// The block-level finite check for your own kernels: each thread counts the values it
// wrote that are NaN or ±inf (mpx::is_finite), and one call sums the counts over the
// block (CUB's BlockReduce) and adds the block's total to a counter in global memory
// with one atomic, from one thread, only when the block found any. A kernel then needs
// no second pass over its output to know whether it overflowed:
//
//   unsigned bad = 0;
//   for (...) { y[i] = f(x[i]); bad += mpx::is_finite(y[i]) ? 0u : 1u; }
//   mpx::block_add_nonfinite<threads>(bad, counter);   // every thread of the block calls it
//
// Device code only (under nvcc); the header includes no executor, tensor or host
// reduction, so a kernel author's translation unit stays light. On the host,
// mpx::count_nonfinite (<mpx/numerics/finite.hpp>) counts the same values.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#if MPX_HAS_CUDA
#include <cub/block/block_reduce.cuh>

namespace mpx {

//! The sum of `count` over the threads of a block of BlockThreads threads, in thread 0
//! (unspecified in the others). Every thread of the block must call it, as it would
//! __syncthreads; it may be called again in the same kernel.
template <int BlockThreads>
__device__ unsigned block_count_nonfinite(unsigned count) {
  static_assert(BlockThreads > 0 && BlockThreads <= 1024, "a CUDA block has 1 to 1024 threads");
  using block_reduce = cub::BlockReduce<unsigned, BlockThreads>;
  __shared__ typename block_reduce::TempStorage temp;
  unsigned const total = block_reduce(temp).Sum(count);
  __syncthreads();  // temp is free again for a second call
  return total;
}

//! Adds the block's sum of `count` to *total: one atomicAdd, from thread 0, when the sum
//! is not zero. Every thread of the block must call it; blockDim.x must be BlockThreads.
template <int BlockThreads>
__device__ void block_add_nonfinite(unsigned count, unsigned long long* total) {
  unsigned const block_total = block_count_nonfinite<BlockThreads>(count);
  if (threadIdx.x == 0 && block_total != 0) atomicAdd(total, static_cast<unsigned long long>(block_total));
}

}  // namespace mpx
#endif
