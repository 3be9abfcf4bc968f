// Sparse categorical cross-entropy from logits (Keras
// SparseCategoricalCrossentropy(from_logits=True)): log-softmax and the negative
// log-likelihood of integer labels fused in one pass, in float, with the gradient.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/row_reduce.hpp>
#include <mpx/losses/loss_value.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

// Labels outside [0, classes): on the host executor the labels are checked before
// anything is written, and mpx::invalid_argument names the first bad sample and its
// label. On a cuda_executor the labels live on the GPU and checking them on the host
// would cost a copy and a synchronisation every step, so the kernel records the first
// bad sample and label in the loss_value (the rows concerned get a NaN loss and a NaN
// gradient, which a loss-scale optimizer skips), and loss_value::read throws the same
// mpx::invalid_argument when the loss is next read.

namespace mpx {

namespace detail {

// Logits [d0, ..., dk, classes] and labels [d0, ..., dk]: one row per label (a sample,
// or a token of a sequence).
inline void cross_entropy_layout(shape const& logits, shape const& labels, std::size_t& rows,
                                 std::size_t& classes) {
  if (logits.rank() < 2)
    fail<shape_error>("sparse_categorical_cross_entropy",
                      "logits must be [batch, classes] or [batch, tokens, classes], got shape " + logits.to_string() +
                          " (labels " + labels.to_string() + ")");
  bool matches = labels.rank() + 1 == logits.rank();
  for (std::size_t i = 0; matches && i < labels.rank(); ++i) matches = labels[i] == logits[i];
  if (!matches) {
    std::string expected = "[";
    for (std::size_t i = 0; i + 1 < logits.rank(); ++i) expected += (i ? ", " : "") + std::to_string(logits[i]);
    fail<shape_error>("sparse_categorical_cross_entropy", "labels of shape " + labels.to_string() +
                                                              " do not match logits of shape " + logits.to_string() +
                                                              " (expected " + expected + "])");
  }
  rows = labels.size();
  classes = static_cast<std::size_t>(logits[logits.rank() - 1]);
  if (rows > 0 && classes == 0)
    fail<invalid_argument>("sparse_categorical_cross_entropy", "logits of shape " + logits.to_string() +
                                                                   " have no classes, so no label is valid");
  // The kernel counts classes in int steps of up to a block: keep the last step below 2^31.
  if (classes > 0x7FFF'FFFFu - 1024 || rows >= 0xFFFF'FFFFu)
    fail<invalid_argument>("sparse_categorical_cross_entropy",
                           "at most 2^31 - 1025 classes and 2^32 - 1 samples are supported, got " + logits.to_string());
}

template <class X, class G>
void host_cross_entropy(X const* x, std::int32_t const* labels, G* grad, std::size_t rows, std::size_t classes,
                        float const* scale, loss_record* record) {
  for (std::size_t r = 0; r < rows; ++r)
    if (labels[r] < 0 || static_cast<std::size_t>(labels[r]) >= classes)
      fail<invalid_argument>("sparse_categorical_cross_entropy",
                             "sample " + std::to_string(r) + " has label " + std::to_string(labels[r]) +
                                 ", outside [0, " + std::to_string(classes) + ")");
  float const factor = rows ? gradient_factor(scale, rows) : 0.0f;
  float total = 0.0f, chunk = 0.0f;
  for (std::size_t r = 0; r < rows; ++r) {
    X const* xr = x + r * classes;
    G* gr = grad + r * classes;
    float m = max_float::identity();
    for (std::size_t c = 0; c < classes; ++c) m = max_keeping_nan(m, cast<float>(xr[c]));
    float lanes[32] = {};
    for (std::size_t c = 0; c < classes; ++c) lanes[c % 32] += ::expf(cast<float>(xr[c]) - m);
    float s = 0.0f;
    for (float l : lanes) s += l;
    auto const label = static_cast<std::size_t>(labels[r]);
    chunk += ::logf(s) - (cast<float>(xr[label]) - m);
    for (std::size_t c = 0; c < classes; ++c) {
      float const p = ::expf(cast<float>(xr[c]) - m) / s;
      gr[c] = cast<G>((c == label ? p - 1.0f : p) * factor);
    }
    if ((r + 1) % 1024 == 0) {
      total += chunk;
      chunk = 0.0f;
    }
  }
  total += chunk;
  record->value = rows ? static_cast<float>(static_cast<double>(total) / static_cast<double>(rows)) : 0.0f;
  record->classes = static_cast<std::int32_t>(classes);
}

#if MPX_HAS_CUDA
// A warp per row (rows in a grid-stride loop over warps): the maximum, the sum of
// exponentials and the gradient are three passes over the row, the second and third
// served from L1/L2. Each warp sums its rows' losses in order, the block its warps' in
// order, into the block's partial.
template <class X, class G>
__global__ void __launch_bounds__(loss_block_threads)
    cross_entropy_kernel(X const* __restrict__ x, std::int32_t const* __restrict__ labels, G* __restrict__ grad,
                         std::size_t rows, int classes, float const* scale, loss_partial* __restrict__ partials) {
  constexpr int warps = loss_block_threads / 32;
  __shared__ float warp_sum[warps];
  __shared__ unsigned long long warp_bad[warps];
  int const lane = static_cast<int>(threadIdx.x & 31u);
  int const warp = static_cast<int>(threadIdx.x >> 5);
  float const factor = gradient_factor(scale, rows);
  float acc = 0.0f;
  unsigned long long bad = no_bad_label;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * warps;
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * warps + warp; r < rows; r += stride) {
    X const* xr = x + r * static_cast<std::size_t>(classes);
    G* gr = grad + r * static_cast<std::size_t>(classes);
    std::int32_t const label = labels[r];
    bool const valid = label >= 0 && label < classes;
    float m = max_float::identity();
    for (int c = lane; c < classes; c += 32) m = max_keeping_nan(m, cast<float>(xr[c]));
    m = warp_all_reduce(m, max_float{});
    float s = 0.0f;
    for (int c = lane; c < classes; c += 32) s += ::expf(cast<float>(xr[c]) - m);
    s = warp_all_reduce(s, sum_float{});
    float const nan = __int_as_float(0x7FC00000);
    for (int c = lane; c < classes; c += 32) {
      float const p = ::expf(cast<float>(xr[c]) - m) / s;
      gr[c] = cast<G>(valid ? (c == label ? p - 1.0f : p) * factor : nan);
    }
    if (valid) {
      acc += ::logf(s) - (cast<float>(xr[label]) - m);
    } else {
      acc += nan;
      unsigned long long const key = bad_label_key(r, label);
      bad = bad < key ? bad : key;
    }
  }
  if (lane == 0) {
    warp_sum[warp] = acc;
    warp_bad[warp] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    unsigned long long b = no_bad_label;
    for (int w = 0; w < warps; ++w) {
      t += warp_sum[w];
      b = b < warp_bad[w] ? b : warp_bad[w];
    }
    partials[blockIdx.x] = loss_partial{t, 0u, b};
  }
}
#endif

}  // namespace detail

//! Sparse categorical cross-entropy of `logits` [batch, classes] (any dtype) against
//! integer `labels` [batch] (std::int32_t, in [0, classes)): the mean over the batch of
//! log(sum_j exp(x_j)) - x_label, computed max-subtracted in float. Sequences: logits
//! [batch, tokens, classes] and labels [batch, tokens] give the mean over every token
//! (a language model's per-token loss; any number of leading dimensions works).
//! Writes the mean to `loss` and d(mean)/d(logits) = (softmax(x) - onehot(label)) / rows, times *scale
//! when `scale` is given (a float in the executor's memory, e.g.
//! loss_scale_optimizer::scale_data()), to `gradient` (shape of logits, any dtype).
//! The loss value is not scaled. A bad label: see the note at the top of this header.
//! The gradient must not overlap the logits (invalid_argument). Policy must accumulate
//! in float. Asynchronous on a cuda_executor: read the loss with
//! loss.read(exec), which synchronises.
template <class Policy = float32, executor Exec, tensor_like Logits, tensor_like Labels, tensor_like Gradient,
          memory_space Space>
void sparse_categorical_cross_entropy([[maybe_unused]] Exec const& exec, Logits&& logits, Labels&& labels,
                                      Gradient&& gradient, loss_value<Space>& loss, float const* scale = nullptr) {
  detail::require_float_loss<Policy>();
  static_assert(std::is_same_v<value_t<Labels>, std::int32_t>,
                "mpx::sparse_categorical_cross_entropy: labels must be a tensor of std::int32_t class indices");
  auto xv = mpx::view(logits);
  auto lv = mpx::view(labels);
  auto gv = mpx::view(gradient);
  detail::require_access<Exec, space_t<Logits>, space_t<Labels>, space_t<Gradient>, Space>();
  static_assert(!std::is_const_v<typename decltype(gv)::element_type>,
                "mpx::sparse_categorical_cross_entropy: the gradient is const");
  std::size_t rows = 0, classes = 0;
  detail::cross_entropy_layout(xv.shape(), lv.shape(), rows, classes);
  detail::require_same_shape("sparse_categorical_cross_entropy", xv.shape(), gv.shape());
  detail::require_disjoint("sparse_categorical_cross_entropy", "the gradient", gv, "the logits", xv);
  if constexpr (is_host_executor_v<Exec>) {
    detail::host_cross_entropy(xv.data(), lv.data(), gv.data(), rows, classes, scale, loss.record());
  } else {
#if MPX_HAS_CUDA
    cudaStream_t const stream = exec.stream();
    constexpr std::size_t warps = detail::loss_block_threads / 32;
    std::size_t const wanted = (rows + warps - 1) / warps;
    auto const blocks = static_cast<unsigned>(std::max<std::size_t>(1, std::min(wanted, loss.partial_capacity())));
    detail::cross_entropy_kernel<<<blocks, detail::loss_block_threads, 0, stream>>>(
        xv.data(), lv.data(), gv.data(), rows, static_cast<int>(classes), scale, loss.partials());
    MPX_CUDA_CHECK_LAUNCH("mpx::cross_entropy_kernel");
    detail::finish_loss(stream, loss, blocks, rows, static_cast<std::int32_t>(classes));
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
