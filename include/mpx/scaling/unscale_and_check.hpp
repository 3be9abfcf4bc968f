// mpx::unscale_and_check: divides every gradient of a list by the loss scale, in place,
// and finds NaN and ±inf, in one pass over the data. One launch per dtype present (per
// ~1,600 tensors), then one small launch turns the per-chunk results into the verdict:
// whether any value was non-finite, the first gradient that held one, per-tensor and
// global L2 norms, and the factor that clips to a maximum norm. Nothing waits for the
// host; the results stay where the executor computes until asked for.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/kernels/multi_tensor.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

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
};

//! Whether unscale_and_check writes the unscaled gradients back, or leaves them scaled
//! for the consumer to multiply by gradient_summary::gradient_factor as it reads them.
//! Deferring is exact for 16-bit gradients, which could underflow again if written back
//! unscaled (a scaled 2^-10 unscaled by 2^15 is below half's smallest subnormal), and
//! makes the check a read-only pass: loss_scale_optimizer defers.
enum class unscaling { in_place, deferred };

//! A loss scale given as its inverse (PyTorch's GradScaler hands 1 / scale to its
//! check): the gradients are multiplied by exactly *value, with no reciprocal of a
//! reciprocal rounded in between. `value` points into the executor's space.
struct inverse_scale {
  float const* value;
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
  for (std::uint32_t b = 0; b < table.blocks(); ++b) {
    chunk_location const loc = locate_chunk(table, b);
    T* data = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
    unscale_chunk_on_host<T, InPlace> const unscale{data, {inverse_scale}};
    chunk_partial partial{0, 0};
    for (std::size_t i = 0; i < loc.count; ++i) partial = combine_partials{}(partial, unscale(i));
    partials[table.first_partial + b] = partial;
  }
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
  for_each_in_chunk<width>(loc.count, elements_to_alignment<width>(data), true, [&](auto w, std::size_t i) {
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
  std::int32_t first_bad = none;

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
  if (threadIdx.x == 0) {
    gradient_summary s;
    s.first_nonfinite = first == none ? -1 : first;
    s.found_nonfinite = first == none ? 0u : 1u;
    s.norm = sqrtf(all);
    set_clipping(s, max_norm, deferred ? unscaling_factor(scale, is_inverse) : 1.0f);
    *summary = s;
  }
}
#endif

//! One multi-tensor plan per dtype of mpx::dtype_list, in this order.
inline constexpr auto const& all_dtypes = all_dtype_ids;

//! The scale operand of unscale_and_check, whichever way the caller gave it.
struct scale_operand {
  float const* value;
  bool is_inverse;
};

}  // namespace detail

//! A fixed list of gradient tensors (of any dtypes of mpx::dtype_list, mixed freely), planned
//! once for multi-tensor launches, and the results of its last unscale_and_check.
//! The tensors must outlive the list and keep their addresses.
template <executor Exec>
class gradient_list {
 public:
  using space = memory_space_t<Exec>;

  //! `names` (optional) label the gradients in reports ("dense_1/kernel").
  gradient_list(Exec const& exec, std::vector<tensor_ref<space>> gradients, std::vector<std::string> names = {})
      : gradients_(std::move(gradients)), names_(std::move(names)) {
    if (!names_.empty() && names_.size() != gradients_.size())
      detail::fail<invalid_argument>("gradient_list", std::to_string(names_.size()) + " names for " +
                                                          std::to_string(gradients_.size()) + " gradients");
    for (std::size_t i = names_.size(); i < gradients_.size(); ++i) names_.push_back("gradient " + std::to_string(i));
    // One plan per dtype; chunk results numbered dtype after dtype, and each tensor
    // remembers its range of them, in list order.
    std::vector<std::uint32_t> ranges(2 * gradients_.size());
    std::uint32_t next = 0;
    for (std::size_t d = 0; d < detail::all_dtypes.size(); ++d) {
      std::vector<std::array<void*, 1>> pointers;
      std::vector<std::size_t> sizes, members;
      for (std::size_t i = 0; i < gradients_.size(); ++i) {
        if (gradients_[i].dtype() != detail::all_dtypes[d]) continue;
        pointers.push_back({gradients_[i].data()});
        sizes.push_back(gradients_[i].size());
        members.push_back(i);
      }
      plans_[d] = detail::plan_multi_tensor<1>(pointers, sizes, next);
      for (std::size_t k = 0; k < members.size(); ++k) {
        ranges[2 * members[k]] = plans_[d].chunk_begin[k];
        ranges[2 * members[k] + 1] = plans_[d].chunk_begin[k + 1];
      }
      next = plans_[d].chunk_begin.back();
    }
    ranges_ = make_tensor<std::uint32_t>(exec, shape{static_cast<std::int64_t>(ranges.size())});
    copy(exec, tensor_view<std::uint32_t const, host_space>(ranges.data(), ranges_.shape()), ranges_);
    partials_ = make_tensor<detail::chunk_partial>(exec, shape{std::max<std::int64_t>(std::int64_t{next}, 1)});
    sum_of_squares_ = make_tensor<float>(exec, shape{static_cast<std::int64_t>(gradients_.size())});
    summary_ = resident<gradient_summary, space>(exec, gradient_summary{});
    exec.synchronize();  // the host vector `ranges` dies here
  }

  [[nodiscard]] std::size_t size() const noexcept { return gradients_.size(); }
  [[nodiscard]] tensor_ref<space> const& operator[](std::size_t i) const noexcept { return gradients_[i]; }
  [[nodiscard]] std::string const& name(std::size_t i) const noexcept { return names_[i]; }
  [[nodiscard]] std::vector<std::string> const& names() const noexcept { return names_; }
  [[nodiscard]] std::size_t elements() const noexcept {
    std::size_t n = 0;
    for (auto const& g : gradients_) n += g.size();
    return n;
  }

  //! Where kernels find the last check's verdict (the optimizer reads it to skip).
  [[nodiscard]] gradient_summary const* summary_data() const noexcept { return summary_.get(); }
  //! The last check's verdict. Synchronises a cuda_executor.
  [[nodiscard]] gradient_summary summary(Exec const& exec) const { return summary_.read(exec); }
  //! Each gradient's L2 norm after the last check. Synchronises a cuda_executor.
  [[nodiscard]] std::vector<float> norms(Exec const& exec) const {
    auto host = to_host(exec, sum_of_squares_);
    std::vector<float> out(host.begin(), host.end());
    for (float& x : out) x = std::sqrt(x);
    return out;
  }

 private:
  template <executor E>
  friend void unscale_and_check(E const& exec, gradient_list<E>& gradients, detail::scale_operand scale,
                                float max_norm, unscaling mode);

  std::vector<tensor_ref<space>> gradients_;
  std::vector<std::string> names_;
  std::array<detail::multi_tensor_plan<1>, dtype_count> plans_;
  tensor<std::uint32_t, space> ranges_;
  tensor<detail::chunk_partial, space> partials_;
  tensor<float, space> sum_of_squares_;
  resident<gradient_summary, space> summary_;
};

// The work of both public overloads below.
template <executor Exec>
void unscale_and_check([[maybe_unused]] Exec const& exec, gradient_list<Exec>& gradients, detail::scale_operand scale,
                       float max_norm, unscaling mode) {
  auto const n = static_cast<std::uint32_t>(gradients.size());
  bool const deferred = mode == unscaling::deferred;
  if constexpr (is_host_executor_v<Exec>) {
    float const inverse = detail::unscaling_factor(scale.value, scale.is_inverse);
    for (std::size_t d = 0; d < detail::all_dtypes.size(); ++d) {
      visit_dtype(detail::all_dtypes[d], [&](auto t) {
        for (auto const& table : gradients.plans_[d].tables) {
          if (deferred) detail::host_unscale_and_check<decltype(t), false>(table, inverse, gradients.partials_.data());
          else detail::host_unscale_and_check<decltype(t), true>(table, inverse, gradients.partials_.data());
        }
      });
    }
    detail::host_finish_check(n, gradients.ranges_.data(), gradients.partials_.data(), max_norm,
                              deferred ? inverse : 1.0f, gradients.sum_of_squares_.data(), gradients.summary_.get());
  } else {
#if MPX_HAS_CUDA
    for (std::size_t d = 0; d < detail::all_dtypes.size(); ++d) {
      visit_dtype(detail::all_dtypes[d], [&](auto t) {
        using T = decltype(t);
        for (auto const& table : gradients.plans_[d].tables) {
          if (table.blocks() == 0) continue;  // only empty tensors
          auto const kernel = deferred ? detail::unscale_and_check_kernel<T, false> : detail::unscale_and_check_kernel<T, true>;
          kernel<<<table.blocks(), detail::block_size, 0, exec.stream()>>>(table, scale.value, scale.is_inverse,
                                                                           gradients.partials_.data());
          MPX_CUDA_CHECK_LAUNCH("mpx::unscale_and_check_kernel");
        }
      });
    }
    detail::finish_check_kernel<><<<1, detail::finish_threads, 0, exec.stream()>>>(
        n, gradients.ranges_.data(), gradients.partials_.data(), max_norm, scale.value, scale.is_inverse, deferred,
        gradients.sum_of_squares_.data(), gradients.summary_.get());
    MPX_CUDA_CHECK_LAUNCH("mpx::finish_check_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! Multiplies every gradient by 1 / *scale (scale: a float in the executor's space, such
//! as a loss scaler's) in place, or with unscaling::deferred leaves them scaled and
//! records the factor to read them with; and records in `gradients` whether any value
//! was NaN or ±inf, which gradient first held one, the norms (in unscaled units) and the
//! factor that clips the global norm to `max_norm` (<= 0: no clipping). On a
//! cuda_executor it only enqueues work: no allocation, no synchronisation, so it can be
//! captured in a CUDA graph.
template <executor Exec>
void unscale_and_check(Exec const& exec, gradient_list<Exec>& gradients, float const* scale, float max_norm = 0,
                       unscaling mode = unscaling::in_place) {
  unscale_and_check(exec, gradients, detail::scale_operand{scale, false}, max_norm, mode);
}

//! The same, multiplying by *inverse.value as given (GradScaler's inv_scale), so the
//! result is bit for bit `g * inv_scale` rounded once to the gradient's dtype.
template <executor Exec>
void unscale_and_check(Exec const& exec, gradient_list<Exec>& gradients, inverse_scale inverse, float max_norm = 0,
                       unscaling mode = unscaling::in_place) {
  unscale_and_check(exec, gradients, detail::scale_operand{inverse.value, true}, max_norm, mode);
}

}  // namespace mpx
