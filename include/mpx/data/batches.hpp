// Mini-batches of an image_dataset for a training loop: a shuffle per epoch that is the
// same on every platform (splitmix64 and Fisher-Yates, never std::shuffle, whose
// algorithm the standard leaves open), each batch gathered, cast to the storage dtype
// and placed in the executor's memory. On a cuda_executor the next batch is staged in
// pinned memory and copied on a second stream while the current step runs; the ordering
// of that double buffer is plain C++ over a backend (CUDA's calls in
// cuda_staging_backend), so the host suite runs it against a fake GPU.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/splitmix64.hpp>
#include <mpx/data/dataset.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/streams.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

//! The order in which epoch `epoch` visits n samples: a permutation of [0, n) by
//! Fisher-Yates from a generator seeded with (seed, epoch). The same arguments give
//! the same order everywhere; each epoch's order is drawn independently.
inline std::vector<std::size_t> shuffled_order(std::size_t n, std::uint64_t seed, std::uint64_t epoch) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  splitmix64 rng(splitmix64(splitmix64(seed)() ^ epoch)());
  for (std::size_t i = n; i > 1; --i) std::swap(order[i - 1], order[static_cast<std::size_t>(rng.below(i))]);
  return order;
}

//! The order of epoch `epoch` of a batch source: shuffled_order(n, seed, epoch), or [0, n)
//! without shuffling.
inline std::vector<std::size_t> epoch_order(std::size_t n, bool shuffle, std::uint64_t seed, std::uint64_t epoch) {
  if (shuffle) return shuffled_order(n, seed, epoch);
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  return order;
}

namespace detail {
//! invalid_argument unless a resumed epoch's first batch lies within its `batches`.
inline void require_first_batch(std::string_view op, std::size_t first_batch, std::size_t batches) {
  if (first_batch > batches)
    fail<invalid_argument>(op, "batch " + std::to_string(first_batch) + " of an epoch of " + std::to_string(batches) +
                                   " batches");
}
}  // namespace detail

//! How the replicas of a data-parallel job share an epoch (every replica draws the
//! same shuffle from the same seed).
enum class sharding {
  //! Training: each global batch of batch_size × replicas samples is cut into one share
  //! of batch_size per replica, so every replica takes the same number of steps and a
  //! step sees the samples one process would see with the global batch. A last global
  //! batch that is not full is dropped (another shuffle next epoch).
  split_each_batch,
  //! Evaluation: whole batches dealt out in turn (batch k to replica k mod replicas),
  //! so every sample is seen exactly once over all replicas.
  whole_batches,
};

//! How batch_loader cuts an epoch into batches.
struct batch_options {
  std::size_t batch_size = 32;  //!< samples per batch, > 0 (per replica when sharded)
  bool shuffle = true;          //!< false: the data set's order every epoch
  std::uint64_t seed = 0;       //!< with the epoch number, decides the shuffle
  bool drop_last = false;       //!< drop a last batch smaller than batch_size
  std::size_t replica = 0;      //!< this replica's rank, < replicas
  std::size_t replicas = 1;     //!< replicas sharing each epoch (data-parallel ranks)
  sharding shard_by = sharding::split_each_batch;
};

namespace detail {

//! Copies the images and labels of `samples` into contiguous memory, casting to T.
template <class T>
void gather_batch(image_dataset const& data, std::span<std::size_t const> samples, T* images,
                  std::int32_t* labels) {
  std::size_t const per_image = data.image_size();
  float const* source = data.images.data();
  for (std::size_t k = 0; k < samples.size(); ++k) {
    float const* from = source + samples[k] * per_image;
    T* to = images + k * per_image;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(to, from, per_image * sizeof(float));
    } else {
      for (std::size_t j = 0; j < per_image; ++j) to[j] = mpx::cast<T>(from[j]);
    }
    labels[k] = data.labels[samples[k]];
  }
}

//! Where a batch is assembled: stage() prepares the next batch, take() makes it the
//! current one and returns its images and labels in the executor's memory.
template <class Exec, class T>
class batch_staging;

//! The host has nothing to overlap with: take() gathers into one buffer.
template <class T>
class batch_staging<host_executor, T> {
 public:
  batch_staging(host_executor const& exec, image_dataset const& data, std::size_t capacity)
      : data_(&data),
        images_(detail::allocate<T>(exec, capacity * data.image_size())),
        labels_(detail::allocate<std::int32_t>(exec, capacity)) {}

  void stage(std::span<std::size_t const> samples) { staged_ = samples; }
  std::pair<T const*, std::int32_t const*> take() {
    gather_batch(*data_, staged_, images_.data(), labels_.data());
    return {images_.data(), labels_.data()};
  }

 private:
  image_dataset const* data_;
  buffer<T, host_space> images_;
  buffer<std::int32_t, host_space> labels_;
  std::span<std::size_t const> staged_;
};

//! Double buffering. Slot s holds a pinned host copy and a device copy of one batch,
//! and two events: `copied` (recorded on the copy stream after its upload) and
//! `released` (recorded on the consumer's stream when the batch it held is no longer
//! needed). While the consumer's step runs on batch n from one slot, batch n + 1 is
//! gathered into the other slot's pinned memory and uploaded on the copy stream. The
//! consumer's stream waits for `copied` on the GPU; the host waits only before it
//! overwrites pinned memory whose upload (one batch earlier) may still be running.
//!
//! Plain C++ over a Backend that makes and frees the streams, events and memory, so the
//! host suite runs this ordering against a backend of its own; cuda_staging_backend
//! gives it CUDA. A Backend has: types consumer_type (the executor the batches are for),
//! stream_type, event_type (neither copied nor moved), host_buffer<U> and
//! device_buffer<U> (move-only owners with data()); stream_of(consumer);
//! create_stream(), synchronize_stream(stream), destroy_stream(stream); make_event(),
//! record_event(event, stream), wait_event(stream, event) (the stream waits, not the
//! host), synchronize_event(event) (the host waits); allocate_pinned<U>(n) (page-locked
//! host memory), allocate_device<U>(consumer, n); upload(to, from, n, stream) (n
//! elements, host to device, in the stream's order). Each of these may throw; report(what,
//! why) never does, for failures nothing can throw.
template <class Backend, class T>
class double_buffered_staging {
 public:
  using consumer_type = typename Backend::consumer_type;
  using stream_type = typename Backend::stream_type;

  double_buffered_staging(consumer_type const& consumer, image_dataset const& data, std::size_t capacity,
                          Backend backend = {})
      : backend_(std::move(backend)), consumer_(consumer), data_(&data), copy_stream_(backend_.create_stream()) {
    try {
      std::size_t const pixels = capacity * data.image_size();
      for (auto& s : slots_)  // (new, not make_unique: a slot's events cannot be moved)
        s.reset(new slot{backend_.template allocate_pinned<T>(pixels),
                         backend_.template allocate_pinned<std::int32_t>(capacity),
                         backend_.template allocate_device<T>(consumer, pixels),
                         backend_.template allocate_device<std::int32_t>(consumer, capacity), backend_.make_event(),
                         backend_.make_event()});
    } catch (...) {
      for (auto& s : slots_) s.reset();
      destroy_copy_stream();
      throw;
    }
  }
  ~double_buffered_staging() {
    // An upload may still be writing a slot: let it finish before the pinned memory is
    // freed and the device memory is released on the consumer's stream.
    report_failure_of(backend_, "batch_loader: waiting for the copy stream",
                      [&] { backend_.synchronize_stream(copy_stream_); });
    for (auto& s : slots_) s.reset();
    destroy_copy_stream();
  }
  double_buffered_staging(double_buffered_staging const&) = delete;
  double_buffered_staging& operator=(double_buffered_staging const&) = delete;

  //! Gathers `samples` into the next slot and enqueues its upload. Everything the
  //! consumer enqueued until now on its stream (the work on the batch this slot held
  //! before) runs before the upload overwrites the slot.
  void stage(std::span<std::size_t const> samples) {
    slot& s = *slots_[next_];
    // The pinned memory is free again. (The wait does not empty the device's pool of the
    // step's freed temporaries: keep_pool_memory raised its release threshold.)
    backend_.synchronize_event(s.copied);
    gather_batch(*data_, samples, s.host_images.data(), s.host_labels.data());
    backend_.record_event(s.released, backend_.stream_of(consumer_));
    backend_.wait_event(copy_stream_, s.released);
    std::size_t const pixels = samples.size() * data_->image_size();
    if (pixels) backend_.upload(s.images.data(), s.host_images.data(), pixels, copy_stream_);
    if (!samples.empty()) backend_.upload(s.labels.data(), s.host_labels.data(), samples.size(), copy_stream_);
    backend_.record_event(s.copied, copy_stream_);
  }
  //! The staged batch: the consumer's stream waits (on the GPU) for its upload.
  std::pair<T const*, std::int32_t const*> take() {
    slot& s = *slots_[next_];
    backend_.wait_event(backend_.stream_of(consumer_), s.copied);
    next_ ^= 1;
    return {s.images.data(), s.labels.data()};
  }

 private:
  template <class U>
  using host_buffer = typename Backend::template host_buffer<U>;
  template <class U>
  using device_buffer = typename Backend::template device_buffer<U>;
  using event_type = typename Backend::event_type;

  struct slot {
    host_buffer<T> host_images;
    host_buffer<std::int32_t> host_labels;
    device_buffer<T> images;
    device_buffer<std::int32_t> labels;
    event_type copied;
    event_type released;
  };

  // Reports, never throws: it runs in the destructor and while a failed constructor's
  // error is on its way out.
  void destroy_copy_stream() noexcept {
    report_failure_of(backend_, "batch_loader: destroying the copy stream",
                      [&] { backend_.destroy_stream(copy_stream_); });
  }

  Backend backend_;
  consumer_type consumer_;
  image_dataset const* data_;
  stream_type copy_stream_;
  std::array<std::unique_ptr<slot>, 2> slots_;
  std::size_t next_ = 0;  // the slot that holds, or will hold, the next batch
};

#if MPX_HAS_CUDA_RUNTIME
//! CUDA's calls for double_buffered_staging: a non-blocking copy stream, ordering
//! events, pinned host memory and device memory on the consumer's stream.
struct cuda_staging_backend {
  using consumer_type = cuda_executor;
  using stream_type = cudaStream_t;
  using event_type = ordering_event;
  template <class U>
  using host_buffer = pinned_buffer<U>;
  template <class U>
  using device_buffer = buffer<U, device_space>;

  static cudaStream_t stream_of(cuda_executor const& exec) noexcept { return exec.stream(); }
  static cudaStream_t create_stream() {
    cudaStream_t stream = nullptr;
    MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }
  static void synchronize_stream(cudaStream_t stream) { MPX_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  static void destroy_stream(cudaStream_t stream) { MPX_CUDA_CHECK(cudaStreamDestroy(stream)); }
  static ordering_event make_event() { return {}; }
  static void record_event(ordering_event const& e, cudaStream_t stream) {
    MPX_CUDA_CHECK(cudaEventRecord(e.get(), stream));
  }
  static void wait_event(cudaStream_t stream, ordering_event const& e) {
    MPX_CUDA_CHECK(cudaStreamWaitEvent(stream, e.get(), 0));
  }
  static void synchronize_event(ordering_event const& e) { MPX_CUDA_CHECK(cudaEventSynchronize(e.get())); }
  template <class U>
  static pinned_buffer<U> allocate_pinned(std::size_t n) {
    return pinned_buffer<U>(n);
  }
  template <class U>
  static buffer<U, device_space> allocate_device(cuda_executor const& exec, std::size_t n) {
    return detail::allocate<U>(exec, n);
  }
  template <class U>
  static void upload(U* to, U const* from, std::size_t n, cudaStream_t stream) {
    MPX_CUDA_CHECK(cudaMemcpyAsync(to, from, n * sizeof(U), cudaMemcpyHostToDevice, stream));
  }
  static void report(char const* what, char const* why) noexcept {
    std::fprintf(stderr, "mpx: %s failed: %s\n", what, why);
  }
};

//! The GPU's double buffer, on the executor's stream and a copy stream of its own.
template <class T>
class batch_staging<cuda_executor, T> : public double_buffered_staging<cuda_staging_backend, T> {
 public:
  using double_buffered_staging<cuda_staging_backend, T>::double_buffered_staging;
};
#endif

}  // namespace detail

//! Cuts an image_dataset into mini-batches, epoch after epoch, and places each in the
//! executor's memory with images in Storage (float, half or bfloat16):
//!
//!   mpx::batch_loader<mpx::cuda_executor, mpx::half> loader(exec, train, {.batch_size = 64, .seed = 1});
//!   for (int epoch = 0; epoch < 10; ++epoch) {
//!     loader.start_epoch(epoch);
//!     while (auto b = loader.next()) step(b->images, b->labels);  // [B, H, W, C], [B]
//!   }
//!
//! A batch's views stay valid until the next call to next() or start_epoch(): on a
//! cuda_executor, work enqueued on the executor's stream before that call may still
//! read them (the next upload into that memory waits for it), so enqueue a step's work
//! on that stream, or order other streams before it. The data set must outlive the
//! loader. A next() that throws returns no batch and loses none: the next call stages
//! that batch again. (Staging, where a batch is assembled, is for tests that make it fail.)
template <executor Exec, class Storage = float, class Staging = detail::batch_staging<Exec, Storage>>
class batch_loader {
  static_assert(dtype<Storage>, "mpx::batch_loader stores images as mpx::half, mpx::bfloat16 or float");

 public:
  using space = memory_space_t<Exec>;

  //! One mini-batch, in the executor's memory.
  struct batch {
    tensor_view<Storage const, space> images;        //!< [size, H, W, C]
    tensor_view<std::int32_t const, space> labels;   //!< [size]
    std::size_t size = 0;                            //!< samples in this batch
    std::size_t index = 0;                           //!< its position in the epoch, from 0
    std::span<std::size_t const> samples;            //!< their indices in the data set (host memory)
  };

  //! invalid_argument when batch_size is 0.
  batch_loader(Exec const& exec, image_dataset const& data, batch_options const& options = {})
      : data_(&data), options_(options) {
    if (options.batch_size == 0) detail::fail<invalid_argument>("batch_loader", "batch_size must be positive");
    if (options.replicas == 0 || options.replica >= options.replicas)
      detail::fail<invalid_argument>("batch_loader", "replica " + std::to_string(options.replica) + " of " +
                                                         std::to_string(options.replicas) + " replicas");
    if (data.images.shape().rank() != 4 || static_cast<std::size_t>(data.images.shape()[0]) != data.size())
      detail::fail<shape_error>("batch_loader", "images of shape " + data.images.shape().to_string() + " for " +
                                                    std::to_string(data.size()) + " labels; expected [" +
                                                    std::to_string(data.size()) + ", H, W, C]");
    std::size_t const capacity = std::min(options.batch_size, data.size());
    staging_ = std::make_unique<Staging>(exec, data, capacity);
  }
  //! The loader keeps a pointer to the data set, so a temporary one is refused.
  batch_loader(Exec const&, image_dataset&&, batch_options const& = {}) = delete;

  //! Batches per epoch: ceil(N / batch_size), or floor with drop_last. Sharded:
  //! floor(N / (batch_size × replicas)) when split_each_batch; this replica's turns
  //! among the whole batches when whole_batches.
  [[nodiscard]] std::size_t batches_per_epoch() const noexcept {
    std::size_t const n = data_->size(), b = options_.batch_size, r = options_.replicas;
    if (r > 1 && options_.shard_by == sharding::split_each_batch) return n / (b * r);
    std::size_t const all = options_.drop_last ? n / b : (n + b - 1) / b;
    return all > options_.replica ? (all - options_.replica + r - 1) / r : 0;
  }
  [[nodiscard]] batch_options const& options() const noexcept { return options_; }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  //! The order of the current epoch (indices into the data set).
  [[nodiscard]] std::span<std::size_t const> order() const noexcept { return order_; }

  //! Begins epoch `epoch` (any number; the shuffle depends on it and on the seed) at its
  //! batch `first_batch` (0: the start; a resumed run passes its training_position), and
  //! starts preparing that batch. invalid_argument when the epoch has fewer batches.
  void start_epoch(std::uint64_t epoch, std::size_t first_batch = 0) {
    detail::require_first_batch("batch_loader::start_epoch", first_batch, batches_per_epoch());
    epoch_ = epoch;
    started_ = true;
    order_ = epoch_order(data_->size(), options_.shuffle, options_.seed, epoch);
    next_batch_ = first_batch;
    staged_ = false;
    if (next_batch_ < batches_per_epoch()) stage(next_batch_);
  }

  //! The epoch's next batch, or nullopt when the epoch is over. Starts epoch 0 if no
  //! epoch was started.
  [[nodiscard]] std::optional<batch> next() {
    if (!started_) start_epoch(0);
    if (next_batch_ >= batches_per_epoch()) return std::nullopt;
    auto const samples = samples_of(next_batch_);
    if (!staged_) stage(next_batch_);  // its staging failed (below, or in start_epoch): again
    auto const [images, labels] = staging_->take();
    staged_ = false;  // the slot now holds nothing staged: a failure below leaves it so
    if (next_batch_ + 1 < batches_per_epoch()) stage(next_batch_ + 1);
    auto const& s = data_->images.shape();
    auto const b = static_cast<std::int64_t>(samples.size());
    return batch{tensor_view<Storage const, space>(images, shape{b, s[1], s[2], s[3]}),
                 tensor_view<std::int32_t const, space>(labels, shape{b}), samples.size(), next_batch_++, samples};
  }

 private:
  // The samples of this replica's batch k: batch k × replicas + replica of the epoch's
  // order, for both shardings (they differ in how many batches an epoch has).
  std::span<std::size_t const> samples_of(std::size_t k) const noexcept {
    std::size_t const begin = (k * options_.replicas + options_.replica) * options_.batch_size;
    return std::span<std::size_t const>(order_).subspan(begin, std::min(options_.batch_size, order_.size() - begin));
  }
  void stage(std::size_t k) {
    staging_->stage(samples_of(k));
    staged_ = true;
  }

  image_dataset const* data_;
  batch_options options_;
  std::unique_ptr<Staging> staging_;
  std::vector<std::size_t> order_;
  std::uint64_t epoch_ = 0;
  std::size_t next_batch_ = 0;
  bool started_ = false;
  bool staged_ = false;  // batch next_batch_ is staged, ready for take()
};

}  // namespace mpx
