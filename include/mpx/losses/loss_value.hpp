// mpx::loss_value: where a loss writes its mean value (a float in the executor's memory,
// so a CUDA step never waits for it) with an explicit, synchronising read; and the
// machinery the pointwise losses (binary cross-entropy, mean squared error) share.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/math.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/reduce_items.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>

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

//! A share of a loss: a sum and the first bad label it saw (reduced as one value).
struct alignas(16) loss_partial {
  float sum;
  std::uint32_t unused;
  unsigned long long first_bad;
};

//! Adds the sums and keeps the first bad label.
struct loss_sum {
  using value_type = loss_partial;
  MPX_HD static loss_partial identity() noexcept { return {0.0f, 0u, no_bad_label}; }
  MPX_HD loss_partial operator()(loss_partial a, loss_partial b) const noexcept {
    return {add_rn(a.sum, b.sum), 0u, a.first_bad < b.first_bad ? a.first_bad : b.first_bad};
  }
};

//! Where a loss's total goes: the mean into the record, with the number of classes of a
//! labelled loss (-1: none) and the first bad label (sticky until loss_value::read).
struct store_mean_loss {
  loss_record* record;
  std::size_t divisor;
  std::int32_t classes;
  MPX_HD void operator()(loss_partial total) const {
    loss_record r = *record;
    r.value = divisor ? static_cast<float>(static_cast<double>(total.sum) / static_cast<double>(divisor)) : 0.0f;
    if (classes >= 0) r.classes = classes;
    r.first_bad = r.first_bad < total.first_bad ? r.first_bad : total.first_bad;
    *record = r;
  }
};

//! The gradient's factor: the loss scale (1 when none is given) over the count the
//! mean divides by, in double so a count above 2^24 costs no extra rounding.
MPX_HD inline float gradient_factor(float const* scale, std::size_t count) noexcept {
  double const s = scale ? static_cast<double>(*scale) : 1.0;
  return static_cast<float>(s / static_cast<double>(count));
}

//! One element of a pointwise loss: writes its gradient, returns its loss.
template <class Loss, class P, class T, class G>
struct pointwise_loss_element {
  Loss loss;
  P const* p;
  T const* t;
  G* grad;
  std::size_t n;
  float const* scale;
  MPX_HD loss_partial operator()(std::size_t i) const {
    float const pv = cast<float>(p[i]);
    float const tv = cast<float>(t[i]);
    grad[i] = cast<G>(loss.gradient(pv, tv) * gradient_factor(scale, n));
    return {loss.value(pv, tv), 0u, no_bad_label};
  }
};

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
    partials_ = detail::allocate<detail::loss_partial>(exec, detail::max_item_blocks);
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

 private:
  resident<detail::loss_record, Space> record_;
  detail::buffer<detail::loss_partial, Space> partials_;  // the first-level sums
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

//! A loss that is a mean of loss.value(p[i], t[i]) over every element, with gradient
//! loss.gradient(p[i], t[i]) * scale / n, under Policy: binary cross-entropy, mean
//! squared error.
template <class Policy, class Loss, class Exec, class P, class T, class G, class Space>
void pointwise_loss(std::string_view op, Exec const& exec, Loss const& loss, P&& predictions,
                    T&& targets, G&& gradient, loss_value<Space>& out, float const* scale) {
  require_float_loss<Policy>();
  auto pv = mpx::view(predictions);
  auto tv = mpx::view(targets);
  auto gv = mpx::view(gradient);
  require_access<Exec, space_t<P>, space_t<T>, space_t<G>, Space>();
  static_assert(!std::is_const_v<typename decltype(gv)::element_type>, "mpx losses: the gradient is const");
  require_same_shape(op, "predictions", pv.shape(), "targets", tv.shape());
  require_same_shape(op, "predictions", pv.shape(), "gradient", gv.shape());
  std::size_t const n = pv.size();
  pointwise_loss_element<Loss, value_t<P>, value_t<T>, value_t<G>> const body{loss,      pv.data(), tv.data(),
                                                                               gv.data(), n,         scale};
  reduce_items<item_kind::element>(exec, n, loss_sum{}, body, store_mean_loss{out.record(), n, -1}, out.partials());
}

}  // namespace detail
}  // namespace mpx
