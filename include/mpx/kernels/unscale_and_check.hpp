// The kernels of mpx::unscale_and_check (scaling/unscale_and_check.hpp holds the
// gradient list and the public calls): one multi-tensor pass per dtype that unscales
// and checks every chunk, then one small pass that folds the chunks into per-tensor
// norms and the verdict. The host loops visit the same chunks in the same order.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/kernels/multi_tensor.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

#if MPX_HAS_CUDA
#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <cuda/functional>
#endif

namespace mpx {

//! The verdict on a gradient list after unscale_and_check, kept in the executor's space.
struct gradient_summary {
  std::uint32_t found_nonfinite = 0;  //!< 1 when any gradient held NaN or ±inf (the step must be skipped)
  std::int32_t first_nonfinite = -1;  //!< list index of the first gradient that did; -1 when none did
  float norm = 0;                     //!< global L2 norm of the unscaled gradients (not finite when found)
  float clip_coefficient = 1;         //!< factor that brings the norm down to max_norm; 1 when not clipping
  //! What a consumer multiplies the stored gradients by: clip_coefficient, times the
  //! inverse scale when the unscaling was deferred.
  float gradient_factor = 1;
  //! List index of the last gradient that held NaN or ±inf; -1 when none did. A model's
  //! parameters are listed in layer order and backpropagation runs the other way, so
  //! this is the first gradient the backward pass wrote non-finite: nearest the cause.
  std::int32_t last_nonfinite = -1;
};

namespace detail {

//! The factor that unscales: 1 / *scale, or *scale itself when it is already the inverse.
MPX_HD inline float unscaling_factor(float const* scale, bool is_inverse) noexcept {
  return is_inverse ? *scale : 1.0f / *scale;
}

//! What one chunk of one gradient contributed.
struct chunk_partial {
  float sum_of_squares;
  std::uint32_t nonfinite;
};

//! Unscales one element and accounts for it. Checking the unscaled value suffices: a
//! NaN or inf stays one when multiplied by a finite nonzero factor, and a finite value
//! that overflows when unscaled (a scale below 1) becomes one. In place, the norm is
//! that of the values written back; deferred, that of the exact float products.
template <bool InPlace>
struct unscale_element {
  float inverse_scale;
  template <class T>
  MPX_HD T operator()(T g, float& sum_of_squares, bool& nonfinite) const noexcept {
    float const x = cast<float>(g) * inverse_scale;
    if constexpr (InPlace) {
      T const y = cast<T>(x);
      float const yf = cast<float>(y);
      nonfinite |= !is_finite(y);
      sum_of_squares += yf * yf;
      return y;
    } else {
      nonfinite |= !is_finite(x);
      sum_of_squares += x * x;
      return g;
    }
  }
};

//! PyTorch's clip_grad_norm_ factor: max_norm / (norm + 1e-6), at most 1; 1 when
//! max_norm <= 0 (no clipping).
MPX_HD inline float clip_coefficient_for(float norm, float max_norm) noexcept {
  if (!(max_norm > 0)) return 1.0f;
  float const c = max_norm / (norm + 1e-6f);
  return c < 1.0f ? c : 1.0f;
}

// Host: the same chunks in the same order, each one a left fold that unscales as it
// reads. (A loop, not thrust::transform_reduce with the host policy, which folds the
// same way: under nvcc Thrust's headers cost every translation unit that includes
// this one about 2.5 s of compile time.)
template <class T, bool InPlace>
struct unscale_chunk_on_host {
  T* data;
  unscale_element<InPlace> op;
  chunk_partial operator()(std::size_t i) const {
    float sum = 0;
    bool bad = false;
    T const y = op(data[i], sum, bad);
    if constexpr (InPlace) data[i] = y;
    return {sum, bad ? 1u : 0u};
  }
};
struct combine_partials {
  MPX_HD chunk_partial operator()(chunk_partial a, chunk_partial b) const noexcept {
    return {a.sum_of_squares + b.sum_of_squares, a.nonfinite | b.nonfinite};
  }
};

template <class T, bool InPlace>
void host_unscale_and_check(tensor_table<1> const& table, float inverse_scale, chunk_partial* partials) {
  // Chunks are independent (each writes its own partial), so they are shared between
  // the host's threads; each chunk still folds its elements in order.
  host_parallel_ranges(table.blocks(), std::size_t{table.blocks()} * multi_tensor_chunk,
                       [&](std::size_t first, std::size_t last) {
                         for (std::size_t b = first; b < last; ++b) {
                           chunk_location const loc = locate_chunk(table, static_cast<std::uint32_t>(b));
                           T* data = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
                           unscale_chunk_on_host<T, InPlace> const unscale{data, {inverse_scale}};
                           chunk_partial partial{0, 0};
                           for (std::size_t i = 0; i < loc.count; ++i) partial = combine_partials{}(partial, unscale(i));
                           partials[table.first_partial + b] = partial;
                         }
                       });
}

//! The summary's clipping fields, from its norm.
MPX_HD inline void set_clipping(gradient_summary& s, float max_norm, float deferred_factor) noexcept {
  s.clip_coefficient = clip_coefficient_for(s.norm, max_norm);
  s.gradient_factor = s.clip_coefficient * deferred_factor;
}

inline void host_finish_check(std::uint32_t tensors, std::uint32_t const* ranges, chunk_partial const* partials,
                              float max_norm, float deferred_factor, float* tensor_sum_of_squares,
                              gradient_summary* summary) {
  gradient_summary s;
  float total = 0;
  for (std::uint32_t t = 0; t < tensors; ++t) {
    chunk_partial p{0, 0};
    for (std::uint32_t c = ranges[2 * t]; c < ranges[2 * t + 1]; ++c) p = combine_partials{}(p, partials[c]);
    tensor_sum_of_squares[t] = p.sum_of_squares;
    total += p.sum_of_squares;
    if (p.nonfinite && s.first_nonfinite < 0) s.first_nonfinite = static_cast<std::int32_t>(t);
    if (p.nonfinite) s.last_nonfinite = static_cast<std::int32_t>(t);
  }
  s.found_nonfinite = s.first_nonfinite >= 0 ? 1u : 0u;
  s.norm = std::sqrt(total);
  set_clipping(s, max_norm, deferred_factor);
  *summary = s;
}

#if MPX_HAS_CUDA
template <class T, bool InPlace>
__global__ void __launch_bounds__(block_size)
    unscale_and_check_kernel(tensor_table<1> const table, float const* __restrict__ scale, bool is_inverse,
                             chunk_partial* __restrict__ partials) {
  chunk_location const loc = locate_chunk(table, blockIdx.x);
  T* const data = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
  unscale_element<InPlace> const op{unscaling_factor(scale, is_inverse)};
  float sum = 0;
  bool bad = false;
  constexpr int width = vector_width<T>;
  // One pointer: a misaligned tensor (a view into a packed buffer) is always brought to
  // a vector boundary by a scalar head; chunks start at multiples of 16384 elements, so
  // every chunk of a tensor has the same head.
  device_lanes<block_size> const lanes{static_cast<int>(threadIdx.x)};
  for_each_in_chunk<width>(lanes, loc.count, elements_to_alignment<width>(data), true, [&](auto w, std::size_t i) {
    constexpr int n = decltype(w)::value;
    auto v = *reinterpret_cast<aligned_vector<T, n>*>(data + i);
#pragma unroll
    for (int k = 0; k < n; ++k) v.v[k] = op(v.v[k], sum, bad);
    if constexpr (InPlace) *reinterpret_cast<aligned_vector<T, n>*>(data + i) = v;
  });
  using block_reduce = cub::BlockReduce<float, block_size>;
  __shared__ typename block_reduce::TempStorage temp;
  float const block_sum = block_reduce(temp).Sum(sum);
  int const block_bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) partials[table.first_partial + blockIdx.x] = {block_sum, block_bad ? 1u : 0u};
}

static_assert(sizeof(tensor_table<1>) + 3 * sizeof(void*) <= kernel_parameter_limit,
              "unscale_and_check_kernel's parameters exceed what CUDA 12.1+ accepts");

inline constexpr int finish_threads = 1024;
//! Tensors of at most this many chunks are folded by one thread, larger ones by a warp.
inline constexpr std::uint32_t small_tensor_chunks = 32;

// One block turns the per-chunk results into per-tensor sums and the verdict. A thread
// per tensor would serialise a huge tensor's thousands of chunks; a warp per tensor
// would serialise a long list of small ones (each step a dependent load). So: every
// thread folds the small tensors of its stride, then each warp scans groups of 32
// tensors and folds the large ones among them with all its lanes. Every sum is taken in
// a fixed order, so the norm is the same run after run. (A template, as every kernel in
// a header must be: a plain __global__ function would be defined in every translation
// unit.)
template <int Threads = finish_threads>
__global__ void __launch_bounds__(Threads)
    finish_check_kernel(std::uint32_t tensors, std::uint32_t const* __restrict__ ranges,
                        chunk_partial const* __restrict__ partials, float max_norm, float const* __restrict__ scale,
                        bool is_inverse, bool deferred, float* __restrict__ tensor_sum_of_squares,
                        gradient_summary* __restrict__ summary) {
  constexpr int warps = Threads / 32;
  constexpr std::int32_t none = 0x7fffffff;
  unsigned const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float total = 0;
  std::int32_t first_bad = none, last_bad = -1;

  for (std::uint32_t t = threadIdx.x; t < tensors; t += Threads) {
    std::uint32_t const begin = ranges[2 * t], end = ranges[2 * t + 1];
    if (end - begin > small_tensor_chunks) continue;
    float sum = 0;
    std::uint32_t bad = 0;
    for (std::uint32_t c = begin; c < end; ++c) {
      sum += partials[c].sum_of_squares;
      bad |= partials[c].nonfinite;
    }
    tensor_sum_of_squares[t] = sum;
    total += sum;
    if (bad && first_bad == none) first_bad = static_cast<std::int32_t>(t);
    if (bad) last_bad = static_cast<std::int32_t>(t);  // t grows along this thread's loop
  }

  using warp_reduce = cub::WarpReduce<float>;
  __shared__ typename warp_reduce::TempStorage warp_temp[warps];
  for (std::uint32_t base = warp * 32; base < tensors; base += Threads) {
    std::uint32_t const t = base + lane;
    std::uint32_t const begin = t < tensors ? ranges[2 * t] : 0, end = t < tensors ? ranges[2 * t + 1] : 0;
    unsigned large = __ballot_sync(0xffffffffu, end - begin > small_tensor_chunks);
    while (large) {
      int const j = __ffs(static_cast<int>(large)) - 1;
      large &= large - 1;
      std::uint32_t const b = __shfl_sync(0xffffffffu, begin, j), e = __shfl_sync(0xffffffffu, end, j);
      float sum = 0;
      std::uint32_t bad = 0;
      for (std::uint32_t c = b + lane; c < e; c += 32) {
        sum += partials[c].sum_of_squares;
        bad |= partials[c].nonfinite;
      }
      float const tensor_sum = warp_reduce(warp_temp[warp]).Sum(sum);
      bool const tensor_bad = __any_sync(0xffffffffu, bad != 0);
      if (lane == 0) {
        tensor_sum_of_squares[base + j] = tensor_sum;
        total += tensor_sum;
        if (tensor_bad && static_cast<std::int32_t>(base + j) < first_bad) first_bad = static_cast<std::int32_t>(base + j);
        if (tensor_bad && static_cast<std::int32_t>(base + j) > last_bad) last_bad = static_cast<std::int32_t>(base + j);
      }
      __syncwarp();  // CUB: the warp's temporary storage is reused by the next Sum only after a warp barrier
    }
  }

  using sum_reduce = cub::BlockReduce<float, Threads>;
  using min_reduce = cub::BlockReduce<std::int32_t, Threads>;
  __shared__ union {
    typename sum_reduce::TempStorage sum;
    typename min_reduce::TempStorage min;
  } temp;
  float const all = sum_reduce(temp.sum).Sum(total);
  __syncthreads();  // the union's storage is reused
  std::int32_t const first = min_reduce(temp.min).Reduce(first_bad, ::cuda::minimum<>{});
  __syncthreads();
  std::int32_t const last = min_reduce(temp.min).Reduce(last_bad, ::cuda::maximum<>{});
  if (threadIdx.x == 0) {
    gradient_summary s;
    s.first_nonfinite = first == none ? -1 : first;
    s.last_nonfinite = last;
    s.found_nonfinite = first == none ? 0u : 1u;
    s.norm = sqrtf(all);
    set_clipping(s, max_norm, deferred ? unscaling_factor(scale, is_inverse) : 1.0f);
    *summary = s;
  }
}
#endif

//! One multi-tensor plan per dtype of mpx::dtype_list, in this order.
inline constexpr auto const& all_dtypes = all_dtype_ids;

//! The passes of unscale_and_check over a gradient list planned per dtype (plans[d] for
//! all_dtypes[d]), host or CUDA: every chunk unscaled and checked into partials, then
//! the per-tensor sums of squares (tensors of them, chunk ranges [ranges[2t],
//! ranges[2t + 1])) and the verdict folded from them in a fixed order. `deferred`
//! leaves the gradients scaled and puts the inverse scale into the verdict's factor.
template <class Exec>
void unscale_and_check_pass([[maybe_unused]] Exec const& exec, std::array<multi_tensor_plan<1>, dtype_count> const& plans,
                            float const* scale, bool is_inverse, float max_norm, bool deferred, std::uint32_t tensors,
                            std::uint32_t const* ranges, chunk_partial* partials, float* tensor_sum_of_squares,
                            gradient_summary* summary) {
  if constexpr (is_host_executor_v<Exec>) {
    float const inverse = unscaling_factor(scale, is_inverse);
    for (std::size_t d = 0; d < all_dtypes.size(); ++d) {
      visit_dtype(all_dtypes[d], [&](auto t) {
        for (auto const& table : plans[d].tables) {
          if (deferred) host_unscale_and_check<decltype(t), false>(table, inverse, partials);
          else host_unscale_and_check<decltype(t), true>(table, inverse, partials);
        }
      });
    }
    host_finish_check(tensors, ranges, partials, max_norm, deferred ? inverse : 1.0f, tensor_sum_of_squares, summary);
  } else {
#if MPX_HAS_CUDA
    for (std::size_t d = 0; d < all_dtypes.size(); ++d) {
      visit_dtype(all_dtypes[d], [&](auto t) {
        using T = decltype(t);
        for (auto const& table : plans[d].tables) {
          if (table.blocks() == 0) continue;  // only empty tensors
          auto const kernel = deferred ? unscale_and_check_kernel<T, false> : unscale_and_check_kernel<T, true>;
          kernel<<<table.blocks(), block_size, 0, exec.stream()>>>(table, scale, is_inverse, partials);
          MPX_CUDA_CHECK_LAUNCH("mpx::unscale_and_check_kernel");
        }
      });
    }
    finish_check_kernel<><<<1, finish_threads, 0, exec.stream()>>>(tensors, ranges, partials, max_norm, scale,
                                                                  is_inverse, deferred, tensor_sum_of_squares, summary);
    MPX_CUDA_CHECK_LAUNCH("mpx::finish_check_kernel");
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace detail
}  // namespace mpx
