// The kernels of mpx::unscale_and_check (scaling/unscale_and_check.hpp holds the
// gradient list and the public calls): one multi-tensor pass per dtype that unscales
// and checks every chunk, then one small pass that folds the chunks into per-tensor
// norms and the verdict. Both passes are one body for both executors, run by a block's
// threads on the GPU and by the host's emulation of them (exec/lanes.hpp), so every
// chunk's sum, every norm and the verdict have the same bits on both.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/reduce_items.hpp>
#include <mpx/kernels/multi_tensor.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

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
struct combine_partials {
  using value_type = chunk_partial;
  MPX_HD static chunk_partial identity() noexcept { return {0.0f, 0u}; }
  MPX_HD chunk_partial operator()(chunk_partial a, chunk_partial b) const noexcept {
    return {add_rn(a.sum_of_squares, b.sum_of_squares), a.nonfinite | b.nonfinite};
  }
};

//! Unscales one element and accounts for it in `p`. Checking the unscaled value
//! suffices: a NaN or inf stays one when multiplied by a finite nonzero factor, and a
//! finite value that overflows when unscaled (a scale below 1) becomes one. In place,
//! the norm is that of the values written back; deferred, that of the exact float
//! products. Each square is rounded before it is added (add_rn), on the GPU too.
template <bool InPlace>
struct unscale_element {
  float inverse_scale;
  template <class T>
  MPX_HD T operator()(T g, chunk_partial& p) const noexcept {
    float const x = cast<float>(g) * inverse_scale;
    if constexpr (InPlace) {
      T const y = cast<T>(x);
      float const yf = cast<float>(y);
      p.nonfinite |= is_finite(y) ? 0u : 1u;
      p.sum_of_squares = add_rn(p.sum_of_squares, yf * yf);
      return y;
    } else {
      p.nonfinite |= is_finite(x) ? 0u : 1u;
      p.sum_of_squares = add_rn(p.sum_of_squares, x * x);
      return g;
    }
  }
};

//! One chunk of one gradient, unscaled and checked by a block's lanes (block_size of
//! them): each lane folds its columns (a 16-byte vector, or one element at either end),
//! each column's squares summed in order, then the lanes are combined in the block's
//! order (reduce_in_chunk, kernels/multi_tensor.hpp).
template <class T, bool InPlace>
struct unscale_chunk {
  T* data;
  unscale_element<InPlace> op;
  template <class Lanes>
  MPX_HD chunk_partial operator()(Lanes const& lanes, std::size_t count) const {
    constexpr int width = vector_width<T>;
    auto const column = [&](auto w, std::size_t i) {
      constexpr int n = decltype(w)::value;
      vector_access<T, n> v(data + i);
      chunk_partial p{0.0f, 0u};
      MPX_UNROLL
      for (int k = 0; k < n; ++k) {
        T const y = op(v[k], p);
        if constexpr (InPlace) v[k] = y;
      }
      if constexpr (InPlace) v.store();
      return p;
    };
    return reduce_in_chunk<width>(lanes, count, elements_to_alignment<width>(data), combine_partials{}, column);
  }
};

//! PyTorch's clip_grad_norm_ factor: max_norm / (norm + 1e-6), at most 1; 1 when
//! max_norm <= 0 (no clipping).
MPX_HD inline float clip_coefficient_for(float norm, float max_norm) noexcept {
  if (!(max_norm > 0)) return 1.0f;
  float const c = max_norm / (norm + 1e-6f);
  return c < 1.0f ? c : 1.0f;
}

template <class T, bool InPlace>
void host_unscale_and_check(tensor_table<1> const& table, float inverse_scale, chunk_partial* partials) {
  // Chunks are independent (each writes its own partial), so they are shared between
  // the host's threads; each is folded as a GPU block folds it.
  host_parallel_ranges(table.blocks(), std::size_t{table.blocks()} * multi_tensor_chunk,
                       [&](std::size_t first, std::size_t last) {
                         for (std::size_t b = first; b < last; ++b) {
                           chunk_location const loc = locate_chunk(table, static_cast<std::uint32_t>(b));
                           T* data = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
                           partials[table.first_partial + b] =
                               unscale_chunk<T, InPlace>{data, {inverse_scale}}(host_lanes<block_size>{}, loc.count);
                         }
                       });
}

//! The summary's clipping fields, from its norm.
MPX_HD inline void set_clipping(gradient_summary& s, float max_norm, float deferred_factor) noexcept {
  s.clip_coefficient = clip_coefficient_for(s.norm, max_norm);
  s.gradient_factor = s.clip_coefficient * deferred_factor;
}

//! What the tensors folded so far add up to: their sums of squares, and the first and
//! last list index among them that held a NaN or inf (no_nonfinite and -1: none did).
struct tensor_verdict {
  float sum_of_squares;
  std::int32_t first_nonfinite;
  std::int32_t last_nonfinite;
};
inline constexpr std::int32_t no_nonfinite = 0x7fffffff;

struct combine_verdicts {
  using value_type = tensor_verdict;
  MPX_HD static tensor_verdict identity() noexcept { return {0.0f, no_nonfinite, -1}; }
  MPX_HD tensor_verdict operator()(tensor_verdict a, tensor_verdict b) const noexcept {
    return {add_rn(a.sum_of_squares, b.sum_of_squares),
            a.first_nonfinite < b.first_nonfinite ? a.first_nonfinite : b.first_nonfinite,
            a.last_nonfinite > b.last_nonfinite ? a.last_nonfinite : b.last_nonfinite};
  }
};

//! The finishing pass's row body (exec/reduce_items.hpp): tensor t's chunks [ranges[2t],
//! ranges[2t + 1]) folded by a warp's lanes into its sum of squares, which it stores, and
//! its verdict. A warp per tensor: a huge tensor's thousands of chunks are shared by 32
//! lanes, and a long list of small tensors by the warps of every block.
struct finish_check_tensor {
  std::uint32_t const* ranges;
  chunk_partial const* partials;
  float* tensor_sum_of_squares;

  template <class Lanes>
  MPX_HD tensor_verdict operator()(Lanes const& lanes, std::size_t t) const {
    std::uint32_t const begin = ranges[2 * t], end = ranges[2 * t + 1];
    chunk_partial const p = lanes.reduce(end - begin, combine_partials{}, [&](std::size_t c) { return partials[begin + c]; });
    lanes.once([&] { tensor_sum_of_squares[t] = p.sum_of_squares; });
    auto const index = static_cast<std::int32_t>(t);
    return p.nonfinite ? tensor_verdict{p.sum_of_squares, index, index}
                       : tensor_verdict{p.sum_of_squares, no_nonfinite, -1};
  }
};

//! Writes the summary from every tensor's verdict: the norm, and the clipping (times the
//! inverse scale when the unscaling was deferred).
struct finish_check_summary {
  float max_norm;
  float const* scale;
  bool is_inverse;
  bool deferred;
  gradient_summary* summary;

  MPX_HD void operator()(tensor_verdict const& all) const {
    gradient_summary s;
    bool const found = all.first_nonfinite != no_nonfinite;
    s.first_nonfinite = found ? all.first_nonfinite : -1;
    s.last_nonfinite = all.last_nonfinite;
    s.found_nonfinite = found ? 1u : 0u;
    s.norm = ::sqrtf(all.sum_of_squares);
    set_clipping(s, max_norm, deferred ? unscaling_factor(scale, is_inverse) : 1.0f);
    *summary = s;
  }
};

#if MPX_HAS_CUDA
template <class T, bool InPlace>
__global__ void __launch_bounds__(block_size)
    unscale_and_check_kernel(tensor_table<1> const table, float const* __restrict__ scale, bool is_inverse,
                             chunk_partial* __restrict__ partials) {
  chunk_location const loc = locate_chunk(table, blockIdx.x);
  T* const data = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
  // A misaligned tensor (a view into a packed buffer) is brought to a vector boundary by
  // a scalar head; chunks start at multiples of 16384 elements, so every chunk of a
  // tensor has the same head.
  device_lanes<block_size> const lanes{static_cast<int>(threadIdx.x)};
  chunk_partial const p = unscale_chunk<T, InPlace>{data, {unscaling_factor(scale, is_inverse)}}(lanes, loc.count);
  lanes.once([&] { partials[table.first_partial + blockIdx.x] = p; });
}

static_assert(sizeof(tensor_table<1>) + 3 * sizeof(void*) <= kernel_parameter_limit,
              "unscale_and_check_kernel's parameters exceed what CUDA 12.1+ accepts");

#endif

//! One multi-tensor plan per dtype of mpx::dtype_list, in this order.
inline constexpr auto const& all_dtypes = all_dtype_ids;

//! The passes of unscale_and_check over a gradient list planned per dtype (plans[d] for
//! all_dtypes[d]), host or CUDA: every chunk unscaled and checked into partials, then
//! the per-tensor sums of squares (tensors of them, chunk ranges [ranges[2t],
//! ranges[2t + 1])) and the verdict folded from them in a fixed order, the same on both
//! executors (reduce_items, with verdict_partials: max_item_blocks of them). `deferred`
//! leaves the gradients scaled and puts the inverse scale into the verdict's factor.
template <class Exec>
void unscale_and_check_pass([[maybe_unused]] Exec const& exec, std::array<multi_tensor_plan<1>, dtype_count> const& plans,
                            float const* scale, bool is_inverse, float max_norm, bool deferred, std::uint32_t tensors,
                            std::uint32_t const* ranges, chunk_partial* partials, float* tensor_sum_of_squares,
                            tensor_verdict* verdict_partials, gradient_summary* summary) {
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
#else
    kernels_need_nvcc<Exec>();
#endif
  }
  reduce_items<item_kind::row>(exec, tensors, combine_verdicts{}, finish_check_tensor{ranges, partials, tensor_sum_of_squares},
                               finish_check_summary{max_norm, scale, is_inverse, deferred, summary}, verdict_partials);
}

}  // namespace detail
}  // namespace mpx
