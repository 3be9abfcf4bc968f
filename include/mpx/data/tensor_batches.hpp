// mpx::tensor_batches: mini-batches of samples that are already tensors in the
// executor's memory (generated data, a data set uploaded once), cut in order. It is a
// batch source for fit() and evaluate(), like batch_loader, but copies nothing: each
// batch is a view of the tensors, which must outlive it.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

namespace mpx {

template <class T, memory_space Space>
class tensor_batches {
 public:
  //! One mini-batch. `images` is the samples, whatever they are: fit() reads that name.
  struct batch {
    tensor_view<T const, Space> images;             //!< [size, sample shape...]
    tensor_view<std::int32_t const, Space> labels;  //!< [size]
    std::size_t size = 0;                           //!< samples in this batch
    std::size_t index = 0;                          //!< its position in the epoch, from 0
  };

  //! samples [N, ...] and labels [N]; shape_error if they disagree, invalid_argument for
  //! a batch_size of 0.
  tensor_batches(tensor_view<T const, Space> samples, tensor_view<std::int32_t const, Space> labels,
                 std::size_t batch_size)
      : samples_(samples), labels_(labels), batch_size_(batch_size) {
    if (batch_size == 0) detail::fail<invalid_argument>("mpx::tensor_batches", "batch_size must be positive");
    if (samples.shape().rank() < 1 || labels.shape().rank() != 1 || samples.shape()[0] != labels.shape()[0])
      detail::fail<shape_error>("mpx::tensor_batches", "samples of shape " + samples.shape().to_string() +
                                                           " and labels of shape " + labels.shape().to_string() +
                                                           "; expected [N, ...] and [N]");
  }

  [[nodiscard]] std::size_t size() const noexcept { return static_cast<std::size_t>(labels_.shape()[0]); }
  [[nodiscard]] std::size_t batch_size() const noexcept { return batch_size_; }
  //! ceil(N / batch_size): the last batch holds what is left.
  [[nodiscard]] std::size_t batches_per_epoch() const noexcept { return (size() + batch_size_ - 1) / batch_size_; }

  //! Every epoch visits the samples in the same order, here from batch `first_batch`
  //! (0: the start; a resumed run passes its training_position).
  void start_epoch(std::size_t /*epoch*/, std::size_t first_batch = 0) {
    if (first_batch > batches_per_epoch())
      detail::fail<invalid_argument>("tensor_batches::start_epoch",
                                     "batch " + std::to_string(first_batch) + " of an epoch of " +
                                         std::to_string(batches_per_epoch()) + " batches");
    next_index_ = first_batch;
  }

  //! The next batch of the epoch, or nullopt after the last.
  [[nodiscard]] std::optional<batch> next() {
    std::size_t const first = next_index_ * batch_size_;
    if (first >= size()) return std::nullopt;
    std::size_t const count = std::min(batch_size_, size() - first);
    shape const all = samples_.shape();
    std::array<std::int64_t, shape::max_rank> extents{};
    std::copy(all.extents().begin(), all.extents().end(), extents.begin());
    std::size_t const per_sample = samples_.size() / size();  // size() > first >= 0
    extents[0] = static_cast<std::int64_t>(count);
    batch out{tensor_view<T const, Space>(samples_.data() + first * per_sample,
                                          shape(std::span<std::int64_t const>(extents.data(), all.rank()))),
              tensor_view<std::int32_t const, Space>(labels_.data() + first, shape{static_cast<std::int64_t>(count)}),
              count, next_index_};
    ++next_index_;
    return out;
  }

 private:
  tensor_view<T const, Space> samples_;
  tensor_view<std::int32_t const, Space> labels_;
  std::size_t batch_size_;
  std::size_t next_index_ = 0;
};

namespace detail {
// The sample type of a tensor_batches whose labels are Label: refused with the reason
// unless they are std::int32_t.
template <class Label, class T>
struct samples_with_int32_labels {
  static_assert(std::is_same_v<std::remove_const_t<Label>, std::int32_t>,
                "mpx::tensor_batches(samples, labels, batch_size): the labels must be std::int32_t class indices, "
                "one per sample (cast float labels first)");
  using type = std::remove_const_t<T>;
};
}  // namespace detail

template <class T, memory_space Space>
tensor_batches(tensor<T, Space> const&, tensor<std::int32_t, Space> const&, std::size_t) -> tensor_batches<T, Space>;
template <class T, memory_space Space>
tensor_batches(tensor_view<T, Space>, tensor_view<std::int32_t, Space>, std::size_t)
    -> tensor_batches<std::remove_const_t<T>, Space>;
// Labels of any other type: the guide that says why they are refused.
template <class T, class Label, memory_space Space>
tensor_batches(tensor<T, Space> const&, tensor<Label, Space> const&, std::size_t)
    -> tensor_batches<typename detail::samples_with_int32_labels<Label, T>::type, Space>;
template <class T, class Label, memory_space Space>
tensor_batches(tensor_view<T, Space>, tensor_view<Label, Space>, std::size_t)
    -> tensor_batches<typename detail::samples_with_int32_labels<Label, T>::type, Space>;

}  // namespace mpx
