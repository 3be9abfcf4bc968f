// The block-level finite check for your own kernels: each thread counts the values it wrote
// that are NaN or ±inf (mpx::is_finite), and one call sums the counts over the block and
// adds the block's total to a counter in global memory with one atomic, from one thread,
// only when the block found any. A kernel then needs no second pass over its output to know
// whether it overflowed:
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
namespace mpx {

//! The sum of `count` over the threads of a block of BlockThreads threads, in every
//! thread. Every thread of the block must call it, as it would __syncthreads; it may be
//! called again in the same kernel.
//!
//! The threads that found any add their count to one shared integer (an integer sum is
//! the same in any order; most threads add nothing). Not CUB's BlockReduce: its header
//! costs the translation unit of every kernel that checks its output about 3.5 s of
//! compile time under nvcc, for a sum made once per block.
template <int BlockThreads>
__device__ unsigned block_count_nonfinite(unsigned count) {
  static_assert(BlockThreads > 0 && BlockThreads <= 1024, "a CUDA block has 1 to 1024 threads");
  __shared__ unsigned block_total;
  if (threadIdx.x == 0) block_total = 0;
  __syncthreads();
  if (count != 0) atomicAdd(&block_total, count);
  __syncthreads();
  unsigned const total = block_total;
  __syncthreads();  // every thread has read it before a second call sets it to 0 again
  return total;
}

//! Adds the block's sum of `count` to *total: one atomicAdd, from thread 0, when the sum
//! is not zero. Every thread of the block must call it; blockDim.x must be BlockThreads.
template <int BlockThreads>
__device__ void block_add_nonfinite(unsigned count, unsigned long long* total) {
  unsigned const block_total = block_count_nonfinite<BlockThreads>(count);
  bool const first_thread = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;  // once per block, of any shape
  if (first_thread && block_total != 0) atomicAdd(total, static_cast<unsigned long long>(block_total));
}

}  // namespace mpx
#endif
