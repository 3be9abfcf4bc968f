// mpx::loss_value: where a loss writes its mean value (a float in the executor's memory,
// so a CUDA step never waits for it) with an explicit, synchronising read; and the
// machinery the pointwise losses (binary cross-entropy, mean squared error) share.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/row_reduce.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mpx {

namespace detail {

//! No bad label seen: the largest key, so the smallest key is the first bad sample.
inline constexpr unsigned long long no_bad_label = ~0ull;

//! A bad label as one ordered key: the sample in the high half, the label in the low.
MPX_HD inline unsigned long long bad_label_key(std::size_t sample, std::int32_t label) noexcept {
  return (static_cast<unsigned long long>(sample) << 32) | static_cast<std::uint32_t>(label);
}

//! What a loss leaves where the executor computes. One 16-byte record, read in one copy.
struct alignas(16) loss_record {
  float value;                   //!< the mean loss
  std::int32_t classes;          //!< the number of classes of the latest labelled loss
  unsigned long long first_bad;  //!< bad_label_key of the first bad label since the last read
};

//! One block's share of a loss: its sum and the first bad label it saw.
struct alignas(16) loss_partial {
  float sum;
  std::uint32_t unused;
  unsigned long long first_bad;
};

//! Blocks per SM of the loss kernels (256 threads each), which bounds the partials.
inline constexpr int loss_blocks_per_sm = 4;
inline constexpr int loss_block_threads = 256;

//! The gradient's factor: the loss scale (1 when none is given) over the count the
//! mean divides by, in double so a count above 2^24 costs no extra rounding.
MPX_HD inline float gradient_factor(float const* scale, std::size_t count) noexcept {
  double const s = scale ? static_cast<double>(*scale) : 1.0;
  return static_cast<float>(s / static_cast<double>(count));
}

#if MPX_HAS_CUDA
// The second level of every loss: one block adds the partials in a fixed order, divides
// by the count, and keeps the first bad label (sticky until loss_value::read reports it).
template <int Threads>
__global__ void __launch_bounds__(Threads)
    finish_loss_kernel(loss_partial const* __restrict__ partials, unsigned count, unsigned long long divisor,
                       std::int32_t classes, loss_record* __restrict__ record) {
  __shared__ float float_scratch[32];
  __shared__ unsigned long long key_scratch[32];
  float sum = 0.0f;
  unsigned long long bad = no_bad_label;
  for (unsigned i = threadIdx.x; i < count; i += Threads) {
    sum += partials[i].sum;
    bad = bad < partials[i].first_bad ? bad : partials[i].first_bad;
  }
  sum = block_all_reduce(sum, sum_float{}, float_scratch);
  bad = block_all_reduce(bad, min_u64{}, key_scratch);
  if (threadIdx.x == 0) {
    loss_record r = *record;
    r.value = divisor ? static_cast<float>(static_cast<double>(sum) / static_cast<double>(divisor)) : 0.0f;
    if (classes >= 0) r.classes = classes;
    r.first_bad = r.first_bad < bad ? r.first_bad : bad;
    *record = r;
  }
}

// Pointwise losses: a grid-stride pass that writes the gradient and sums the loss;
// each block's sum goes to its partial, in a fixed order.
template <class Loss, class P, class T, class G>
__global__ void __launch_bounds__(loss_block_threads)
    pointwise_loss_kernel(Loss loss, P const* __restrict__ p, T const* __restrict__ t, G* __restrict__ grad,
                          std::size_t n, float const* scale, loss_partial* __restrict__ partials) {
  __shared__ float scratch[32];
  float const factor = gradient_factor(scale, n);
  float acc = 0.0f;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float const pv = cast<float>(p[i]);
    float const tv = cast<float>(t[i]);
    acc += loss.value(pv, tv);
    grad[i] = cast<G>(loss.gradient(pv, tv) * factor);
  }
  acc = block_all_reduce(acc, sum_float{}, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = loss_partial{acc, 0u, no_bad_label};
}
#endif

}  // namespace detail

//! The mean value of a loss, kept in the executor's memory: on a cuda_executor a loss
//! call only enqueues, and the value is read when (and if) you ask. Reuse one per loss
//! across steps; each call overwrites the value. Its buffers are allocated and freed on
//! the stream it was made with: use it from that stream, or from streams ordered after
//! its construction and before its destruction (one stream at a time: two losses in
//! flight on different streams would share its partial sums).
template <memory_space Space>
class loss_value {
 public:
  //! Allocates the value (NaN until a loss writes it) and, on a GPU, the partial sums.
  template <executor Exec>
  explicit loss_value(Exec const& exec)
      : record_(exec, detail::loss_record{__builtin_nanf(""), -1, detail::no_bad_label}) {
    detail::require_access<Exec, Space>();
    if constexpr (!is_host_executor_v<Exec>) {
#if MPX_HAS_CUDA
      capacity_ = static_cast<std::size_t>(detail::sm_count()) * detail::loss_blocks_per_sm;
      partials_ = detail::buffer<detail::loss_partial, Space>(capacity_, exec.stream());
#endif
    }
  }

  //! Where the mean loss lies (a float in Space): for a kernel that logs or averages it.
  [[nodiscard]] float const* data() const noexcept { return &record_.get()->value; }

  //! The mean loss. On a cuda_executor this waits for the stream. Throws
  //! mpx::invalid_argument if a labelled loss met a label outside [0, classes) since the
  //! last read (naming the first such sample and its label), and forgets it.
  template <executor Exec>
  [[nodiscard]] float read(Exec const& exec) {
    detail::loss_record r = record_.read(exec);
    if (r.first_bad != detail::no_bad_label) {
      detail::loss_record cleared = r;
      cleared.first_bad = detail::no_bad_label;
      record_.write(exec, cleared);
      auto const sample = r.first_bad >> 32;
      auto const label = static_cast<std::int32_t>(static_cast<std::uint32_t>(r.first_bad & 0xFFFF'FFFFull));
      detail::fail<invalid_argument>("sparse_categorical_cross_entropy",
                                     "sample " + std::to_string(sample) + " has label " + std::to_string(label) +
                                         ", outside [0, " + std::to_string(r.classes) +
                                         ") (found on the device; its loss and gradient row are NaN)");
    }
    return r.value;
  }

  // For the loss kernels.
  [[nodiscard]] detail::loss_record* record() const noexcept { return record_.get(); }
  [[nodiscard]] detail::loss_partial* partials() const noexcept { return partials_.data(); }
  [[nodiscard]] std::size_t partial_capacity() const noexcept { return capacity_; }

 private:
  resident<detail::loss_record, Space> record_;
  detail::buffer<detail::loss_partial, Space> partials_;
  std::size_t capacity_ = 0;
};

template <executor Exec>
loss_value(Exec const&) -> loss_value<memory_space_t<Exec>>;

namespace detail {

//! The refusal every loss shares.
template <class P>
constexpr void require_float_loss() {
  static_assert(policy_type<P>, "mpx losses: the template argument must be a policy such as mpx::mixed_float16");
  static_assert(float_accumulating_policy<P>,
                "mpx losses are computed and summed in float32 (a mean over a batch in 16 bits loses the "
                "small per-sample terms, and float16 overflows past 65504), but this policy's accumulate_type "
                "is 16-bit: use mpx::mixed_float16, mpx::mixed_bfloat16, mpx::float32 or a "
                "policy<Storage, Compute, float>");
}

#if MPX_HAS_CUDA
template <class Space>
void finish_loss(cudaStream_t stream, loss_value<Space>& out, unsigned blocks, std::size_t divisor,
                 std::int32_t classes) {
  finish_loss_kernel<loss_block_threads><<<1, loss_block_threads, 0, stream>>>(
      out.partials(), blocks, static_cast<unsigned long long>(divisor), classes, out.record());
  MPX_CUDA_CHECK_LAUNCH("mpx::finish_loss_kernel");
}
#endif

//! A loss that is a mean of loss.value(p[i], t[i]) over every element, with gradient
//! loss.gradient(p[i], t[i]) * scale / n: binary cross-entropy, mean squared error.
template <class Loss, class Exec, class P, class T, class G, class Space>
void pointwise_loss(std::string_view op, [[maybe_unused]] Exec const& exec, Loss const& loss, P&& predictions,
                    T&& targets, G&& gradient, loss_value<Space>& out, float const* scale) {
  auto pv = mpx::view(predictions);
  auto tv = mpx::view(targets);
  auto gv = mpx::view(gradient);
  require_access<Exec, space_t<P>, space_t<T>, space_t<G>, Space>();
  static_assert(!std::is_const_v<typename decltype(gv)::element_type>, "mpx losses: the gradient is const");
  require_same_shape(op, pv.shape(), tv.shape());
  require_same_shape(op, pv.shape(), gv.shape());
  std::size_t const n = pv.size();
  if constexpr (is_host_executor_v<Exec>) {
    float const factor = n ? gradient_factor(scale, n) : 0.0f;
    // Chunks of 1024 summed, then the chunks: about n / 1024 + 1024 roundings.
    float total = 0.0f;
    for (std::size_t begin = 0; begin < n; begin += 1024) {
      std::size_t const end = std::min(n, begin + 1024);
      float part = 0.0f;
      for (std::size_t i = begin; i < end; ++i) {
        float const p = cast<float>(pv.data()[i]);
        float const t = cast<float>(tv.data()[i]);
        part += loss.value(p, t);
        gv.data()[i] = cast<value_t<G>>(loss.gradient(p, t) * factor);
      }
      total += part;
    }
    out.record()->value = n ? static_cast<float>(static_cast<double>(total) / static_cast<double>(n)) : 0.0f;
  } else {
#if MPX_HAS_CUDA
    cudaStream_t const stream = exec.stream();
    std::size_t const wanted = (n + loss_block_threads - 1) / loss_block_threads;
    auto const blocks = static_cast<unsigned>(std::max<std::size_t>(1, std::min(wanted, out.partial_capacity())));
    pointwise_loss_kernel<<<blocks, loss_block_threads, 0, stream>>>(loss, pv.data(), tv.data(), gv.data(), n, scale,
                                                                     out.partials());
    MPX_CUDA_CHECK_LAUNCH("mpx::pointwise_loss_kernel");
    finish_loss(stream, out, blocks, n, -1);
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace detail
}  // namespace mpx
