// A byte-level text corpus for language models: the bytes of a plain-text file, or of
// every text file in a directory (Debian's fortunes, /usr/share/games/fortunes), as token
// ids 0..255; a deterministic train/validation split; and shuffled fixed-length windows
// with next-token targets, in batches in the executor's memory, reproducible from a seed
// and resumable mid-epoch like batch_loader.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/read_file.hpp>
#include <mpx/data/batches.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace mpx {

//! The text of a corpus, one token per byte.
struct text_corpus {
  static constexpr std::size_t vocab_size = 256;  //!< every byte value is a token
  std::vector<std::uint8_t> bytes;                //!< the files' bytes, one after another
  std::vector<std::string> files;                 //!< the files read, in the order read

  [[nodiscard]] std::size_t size() const noexcept { return bytes.size(); }
};

namespace detail {

[[noreturn]] inline void refuse_corpus(std::string_view path, std::string_view why,
                                       source_location loc = source_location::current()) {
  fail<data_error>("read_text_corpus", "'" + std::string(path) + "': " + std::string(why), loc);
}

//! Whether a directory entry of the corpus is read: a regular file (not a symlink, not a
//! subdirectory such as fortunes' off/) whose name is not an index (.dat) or a UTF-8
//! alias (.u8) and does not start with a dot.
inline bool corpus_file_wanted(std::filesystem::directory_entry const& e) {
  std::error_code ec;
  if (e.is_symlink(ec) || ec || !e.is_regular_file(ec) || ec) return false;
  std::string const name = e.path().filename().string();
  auto ends_with = [&](std::string_view tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return !name.empty() && name[0] != '.' && !ends_with(".dat") && !ends_with(".u8");
}

}  // namespace detail

//! The bytes of `text` as a corpus (what a test or a fuzzer feeds); data_error when empty.
inline text_corpus text_corpus_of(std::span<std::uint8_t const> text, std::string origin = "(text)") {
  if (text.empty()) detail::refuse_corpus(origin, "the corpus holds no text");
  return text_corpus{{text.begin(), text.end()}, {std::move(origin)}};
}

//! Reads a corpus: the file at `path`, or, for a directory, every regular file directly in
//! it in name order (skipping symlinks, subdirectories, dot files and fortune's .dat and
//! .u8 files), concatenated. Throws mpx::data_error naming the path when it is missing or
//! unreadable, or when no text is found (never a std::filesystem::filesystem_error).
inline text_corpus read_text_corpus(std::filesystem::path const& path) {
  std::string const where = path.string();
  std::error_code ec;
  auto const status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status))
    detail::refuse_corpus(where, "cannot open it: " + (ec ? ec.message() : std::string("no such file or directory")));
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(status)) {
    std::filesystem::directory_iterator it(path, ec), end;
    if (ec) detail::refuse_corpus(where, "cannot list the directory: " + ec.message());
    for (; it != end; it.increment(ec)) {
      if (ec) detail::refuse_corpus(where, "cannot list the directory: " + ec.message());
      if (detail::corpus_file_wanted(*it)) files.push_back(it->path());
    }
    if (ec) detail::refuse_corpus(where, "cannot list the directory: " + ec.message());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  text_corpus corpus;
  for (auto const& f : files) {
    std::string const name = f.string();
    auto const bytes =
        detail::read_whole_file<std::uint8_t>(f, [&](std::string const& why) { detail::refuse_corpus(name, why); });
    corpus.bytes.insert(corpus.bytes.end(), bytes.begin(), bytes.end());
    corpus.files.push_back(name);
  }
  if (corpus.bytes.empty())
    detail::refuse_corpus(where, files.empty() ? "the directory holds no text file" : "the corpus holds no text");
  return corpus;
}

//! A corpus cut in two: views into its bytes (the corpus must outlive them).
struct text_split {
  std::span<std::uint8_t const> train;       //!< the first bytes
  std::span<std::uint8_t const> validation;  //!< the last round(fraction x size) bytes
};

//! The last `validation_fraction` of the bytes (rounded, at least one byte) for
//! validation, the rest for training: contiguous, so no window spans both and the split
//! is the same on every run and platform (as char-rnn and nanoGPT split their texts).
//! invalid_argument unless 0 < validation_fraction < 1; data_error when a part would be
//! empty (a corpus of one byte).
inline text_split split_text(text_corpus const& corpus, double validation_fraction) {
  if (!(validation_fraction > 0.0 && validation_fraction < 1.0))
    detail::fail<invalid_argument>("split_text", "the validation fraction must lie in (0, 1), got " +
                                                     detail::to_text(validation_fraction));
  std::size_t const n = corpus.size();
  auto val = static_cast<std::size_t>(std::llround(validation_fraction * static_cast<double>(n)));
  val = std::max<std::size_t>(val, 1);
  if (val >= n)
    detail::fail<data_error>("split_text", "a corpus of " + std::to_string(n) +
                                               " bytes cannot give both a train and a validation part");
  std::span<std::uint8_t const> const all(corpus.bytes);
  return {all.first(n - val), all.last(val)};
}

//! How text_batches cuts a text into windows and batches.
struct text_batch_options {
  std::size_t context = 64;     //!< L: tokens per window (> 0)
  std::size_t batch_size = 32;  //!< windows per batch (> 0)
  std::size_t stride = 0;       //!< between window starts; 0: the context (windows do not overlap)
  bool shuffle = true;          //!< false: windows in text order every epoch
  std::uint64_t seed = 0;       //!< with the epoch number, decides the shuffle
  bool drop_last = false;       //!< drop a last batch that is not full
};

//! Batches of windows of a text: window w starts at byte s = w x stride, its inputs are
//! tokens [s, s + L) and its targets tokens [s + 1, s + L + 1) (the next token of each
//! input), int32 [batch, L] each, in the executor's memory. Each epoch visits every
//! window once, in an order drawn from (seed, epoch) with mpx::shuffled_order.
//!
//!   mpx::text_batches<mpx::host_executor> train(exec, split.train, {.context = 64, .seed = 1});
//!   for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
//!     train.start_epoch(epoch);
//!     while (auto b = train.next()) step(b->inputs, b->targets);
//!   }
//!
//! A batch's views stay valid until the next call to next() or start_epoch(); the text
//! must outlive the batches.
template <executor Exec>
class text_batches {
 public:
  using space = memory_space_t<Exec>;

  struct batch {
    tensor_view<std::int32_t const, space> inputs;   //!< [size, L]
    tensor_view<std::int32_t const, space> targets;  //!< [size, L]: inputs shifted by one token
    std::size_t size = 0;                            //!< windows in this batch
    std::size_t index = 0;                           //!< its position in the epoch, from 0
    std::span<std::size_t const> windows;            //!< their indices (start = index x stride)
  };

  //! invalid_argument for a zero context or batch size; data_error when the text is
  //! shorter than one window and its target (context + 1 bytes).
  text_batches(Exec const& exec, std::span<std::uint8_t const> text, text_batch_options const& options = {})
      : exec_(exec), text_(text), options_(options) {
    if (options_.context == 0 || options_.batch_size == 0)
      detail::fail<invalid_argument>("text_batches", "context and batch_size must be positive");
    if (options_.stride == 0) options_.stride = options_.context;
    if (text.size() < options_.context + 1)
      detail::fail<data_error>("text_batches", "a window of " + std::to_string(options_.context) +
                                                   " tokens and its next-token targets need " +
                                                   std::to_string(options_.context + 1) + " bytes, but the text has " +
                                                   std::to_string(text.size()));
    windows_ = (text.size() - options_.context - 1) / options_.stride + 1;
    std::size_t const capacity = std::min(options_.batch_size, windows_);
    auto const s = shape{static_cast<std::int64_t>(capacity), static_cast<std::int64_t>(options_.context)};
    inputs_ = tensor<std::int32_t, space>(exec, s);
    targets_ = tensor<std::int32_t, space>(exec, s);
    host_inputs_.resize(capacity * options_.context);
    host_targets_.resize(capacity * options_.context);
  }

  [[nodiscard]] text_batch_options const& options() const noexcept { return options_; }
  //! Windows in the text: (size - context - 1) / stride + 1.
  [[nodiscard]] std::size_t windows() const noexcept { return windows_; }
  [[nodiscard]] std::size_t batches_per_epoch() const noexcept {
    std::size_t const b = options_.batch_size;
    return options_.drop_last ? windows_ / b : (windows_ + b - 1) / b;
  }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  //! The order of the current epoch (window indices).
  [[nodiscard]] std::span<std::size_t const> order() const noexcept { return order_; }

  //! Begins epoch `epoch` at its batch `first_batch` (a resumed run passes its position).
  //! invalid_argument when the epoch has fewer batches.
  void start_epoch(std::uint64_t epoch, std::size_t first_batch = 0) {
    detail::require_first_batch("text_batches::start_epoch", first_batch, batches_per_epoch());
    epoch_ = epoch;
    started_ = true;
    order_ = epoch_order(windows_, options_.shuffle, options_.seed, epoch);
    next_batch_ = first_batch;
  }

  //! The epoch's next batch, or nullopt when the epoch is over (epoch 0 starts itself).
  [[nodiscard]] std::optional<batch> next() {
    if (!started_) start_epoch(0);
    if (next_batch_ >= batches_per_epoch()) return std::nullopt;
    std::size_t const begin = next_batch_ * options_.batch_size;
    auto const windows = std::span<std::size_t const>(order_).subspan(begin, std::min(options_.batch_size, windows_ - begin));
    std::size_t const L = options_.context;
    for (std::size_t k = 0; k < windows.size(); ++k) {
      std::size_t const start = windows[k] * options_.stride;
      for (std::size_t t = 0; t < L; ++t) {
        host_inputs_[k * L + t] = text_[start + t];
        host_targets_[k * L + t] = text_[start + t + 1];
      }
    }
    auto const s = shape{static_cast<std::int64_t>(windows.size()), static_cast<std::int64_t>(L)};
    tensor_view<std::int32_t, space> const in(inputs_.data(), s), out(targets_.data(), s);
    copy(exec_, tensor_view<std::int32_t const, host_space>(host_inputs_.data(), s), in);
    copy(exec_, tensor_view<std::int32_t const, host_space>(host_targets_.data(), s), out);
    exec_.synchronize();  // the host buffers are refilled by the next call
    return batch{in, out, windows.size(), next_batch_++, windows};
  }

 private:
  Exec exec_;
  std::span<std::uint8_t const> text_;
  text_batch_options options_;
  std::size_t windows_ = 0;
  tensor<std::int32_t, space> inputs_, targets_;
  std::vector<std::int32_t> host_inputs_, host_targets_;
  std::vector<std::size_t> order_;
  std::uint64_t epoch_ = 0;
  std::size_t next_batch_ = 0;
  bool started_ = false;
};

}  // namespace mpx
