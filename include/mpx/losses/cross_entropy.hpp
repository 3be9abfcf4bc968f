// Sparse categorical cross-entropy from logits (Keras
// SparseCategoricalCrossentropy(from_logits=True)): log-softmax and the negative
// log-likelihood of integer labels fused in one pass, in float, with the gradient.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/reduce_items.hpp>
#include <mpx/exec/tensor.hpp>
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
  // A row's lanes count classes in 32 bits (max_row_cols), the items their rows too.
  if (classes > max_row_cols || rows >= 0xFFFF'FFFFu)
    fail<invalid_argument>("sparse_categorical_cross_entropy",
                           "at most 2^31 - 1025 classes and 2^32 - 1 samples are supported, got " + logits.to_string());
}

//! Refuses the first label outside [0, classes) before anything is written (the host's
//! labels are at hand; see the note at the top).
inline void require_labels_in_range(std::int32_t const* labels, std::size_t rows, std::size_t classes) {
  for (std::size_t r = 0; r < rows; ++r)
    if (labels[r] < 0 || static_cast<std::size_t>(labels[r]) >= classes)
      fail<invalid_argument>("sparse_categorical_cross_entropy",
                             "sample " + std::to_string(r) + " has label " + std::to_string(labels[r]) +
                                 ", outside [0, " + std::to_string(classes) + ")");
}

//! One row of logits: the maximum, the sum of exponentials and the gradient are three
//! passes over the row by its lanes; returns the row's loss (NaN, with the bad label
//! recorded, when the label is out of range: the row's gradient is NaN too).
template <class X, class G>
struct cross_entropy_row {
  X const* x;
  std::int32_t const* labels;
  G* grad;
  std::size_t rows, classes;
  float const* scale;
  template <class Lanes>
  MPX_HD loss_partial operator()(Lanes const& lanes, std::size_t r) const {
    X const* xr = x + r * classes;
    G* gr = grad + r * classes;
    std::int32_t const label = labels[r];
    bool const valid = label >= 0 && static_cast<std::size_t>(label) < classes;
    float const factor = gradient_factor(scale, rows);
    float const m = lanes.reduce(classes, max_float{}, [&](std::size_t c) { return cast<float>(xr[c]); });
    float const s =
        lanes.reduce(classes, sum_float{}, [&](std::size_t c) { return exp_float(cast<float>(xr[c]) - m); });
    float const nan = dtype_traits<float>::quiet_nan();
    lanes.for_each(classes, [&](std::size_t c) {
      float const p = exp_float(cast<float>(xr[c]) - m) / s;
      gr[c] = cast<G>(valid ? (c == static_cast<std::size_t>(label) ? p - 1.0f : p) * factor : nan);
    });
    if (!valid) return {nan, 0u, bad_label_key(r, label)};
    return {::logf(s) - (cast<float>(xr[label]) - m), 0u, no_bad_label};
  }
};

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
void sparse_categorical_cross_entropy(Exec const& exec, Logits&& logits, Labels&& labels,
                                      Gradient&& gradient, loss_value<Space>& loss, float const* scale = nullptr) {
  detail::require_float_loss<Policy>();
  static_assert(std::is_same_v<value_t<Labels>, std::int32_t>,
                "mpx::sparse_categorical_cross_entropy: labels must be a tensor of std::int32_t class indices");
  auto [xv, lv, gv] = detail::views_for<Exec>(logits, labels, gradient);
  detail::require_access<Exec, Space>();  // where the loss is written
  static_assert(!std::is_const_v<typename decltype(gv)::element_type>,
                "mpx::sparse_categorical_cross_entropy: the gradient is const");
  std::size_t rows = 0, classes = 0;
  detail::cross_entropy_layout(xv.shape(), lv.shape(), rows, classes);
  detail::require_same_shape("sparse_categorical_cross_entropy", "logits", xv.shape(), "gradient", gv.shape());
  detail::require_disjoint("sparse_categorical_cross_entropy", "the gradient", gv, "the logits", xv);
  // (A structured binding is not captured: clang before 16 refuses that.)
  detail::check_on_host(exec, [&, ids = lv.data()] { detail::require_labels_in_range(ids, rows, classes); });
  detail::cross_entropy_row<value_t<Logits>, value_t<Gradient>> const body{xv.data(), lv.data(), gv.data(),
                                                                           rows,      classes,   scale};
  detail::reduce_items<detail::item_kind::row>(
      exec, rows, detail::loss_sum{}, body,
      detail::store_mean_loss{loss.record(), rows, static_cast<std::int32_t>(classes)}, loss.partials());
}

}  // namespace mpx
