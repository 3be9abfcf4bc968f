// What each fuzzer does with one input: hand the bytes to one of mpx's file readers, as
// a user's file would reach it. A clean mpx::error is the reader doing its job; anything
// else (another exception, a crash, a sanitizer report, a hang, memory without bound)
// is a finding. Shared by the libFuzzer harnesses (fuzz/fuzz_<reader>.cpp) and the host
// suite (tests/model/test_fuzz_corpus.cpp), which replays every stored input and
// reproducer through the same functions.
#pragma once

#include <mpx/data/idx.hpp>
#include <mpx/data/text_corpus.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/model/model_file.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace mpx_fuzz {

//! The readers, one per fuzzer; the name is the fuzzer's and its corpus folder's.
inline constexpr std::string_view readers[] = {"idx", "checkpoint", "model", "text"};

//! A model and a loss-scaled optimizer of fixed shapes that the checkpoint and model
//! inputs are loaded into: two dense layers, mixed_float16 (master weights and slots).
inline auto make_model() {
  return mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3, mpx::activation::tanh), mpx::dense<>(2));
}

using model_type = decltype(make_model());

inline auto make_optimizer(mpx::host_executor const& exec, model_type& model) {
  mpx::dynamic_scale_rule rule;
  rule.growth_interval = 5;
  return mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), mpx::dynamic_loss_scaler(exec, rule));
}

inline model_type built_model(mpx::host_executor const& exec) {
  model_type m = make_model();
  m.build(exec, {4}, 1);
  return m;
}

struct training_objects {
  mpx::host_executor exec;
  model_type model = built_model(exec);
  decltype(make_optimizer(exec, model)) optimizer = make_optimizer(exec, model);
};

//! One set per process: the harness is called millions of times.
inline training_objects& objects() {
  static training_objects o;
  return o;
}

//! Where input files go: memory (/dev/shm) where there is one. On a disk, rewriting the
//! same file thousands of times a second waits for writeback (ext4 flushes a file that
//! was truncated and rewritten when it is closed).
inline std::filesystem::path input_directory() {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  return std::filesystem::temp_directory_path();
}

//! A file holding `bytes`, private to this process (the readers take paths).
inline std::filesystem::path input_file(std::span<std::uint8_t const> bytes) {
  static struct removed_at_exit {
    std::filesystem::path path = input_directory() / ("mpx_fuzz_input_" + std::to_string(::getpid()));
    ~removed_at_exit() {
      std::error_code ignored;
      std::filesystem::remove(path, ignored);
    }
  } const file;
  std::filesystem::path const& path = file.path;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
  return path;
}

//! IDX, plain and gzip (told apart by the bytes), straight from memory.
inline void read_idx_input(std::span<std::uint8_t const> bytes) {
  try {
    mpx::idx_array const a = mpx::decode_idx(bytes, "fuzz input");
    if (a.size() != a.data.size()) std::abort();  // a refusal is fine, a wrong answer is not
  } catch (mpx::error const&) {
  }
}

//! The input as it is, then with its trailing checksum recomputed: most mutations break
//! the checksum, and the second form lets them reach the parser and the value checks
//! behind it (a file patched by hand looks like that).
template <class Load>
void as_is_and_resummed(std::span<std::uint8_t const> bytes, Load&& load) {
  load(input_file(bytes));
  if (bytes.size() < 8) return;
  std::vector<std::uint8_t> resummed(bytes.begin(), bytes.end());
  std::uint64_t const sum = mpx::detail::fnv1a(std::as_bytes(std::span(resummed).first(resummed.size() - 8)));
  std::memcpy(resummed.data() + resummed.size() - 8, &sum, sizeof sum);
  load(input_file(resummed));
}

//! An optimizer checkpoint loaded into the loss-scaled Adam above.
inline void read_checkpoint_input(std::span<std::uint8_t const> bytes) {
  auto& o = objects();
  as_is_and_resummed(bytes, [&](std::filesystem::path const& path) {
    try {
      o.optimizer.load(o.exec, path);
    } catch (mpx::error const&) {
    }
  });
}

//! A model file loaded into the model above, exactly and then partially.
inline void read_model_input(std::span<std::uint8_t const> bytes) {
  auto& o = objects();
  as_is_and_resummed(bytes, [&](std::filesystem::path const& path) {
    for (auto mode : {mpx::model_load::exact, mpx::model_load::partial}) {
      try {
        mpx::load_model(o.exec, o.model, path, mode);
      } catch (mpx::error const&) {
      }
    }
  });
}

//! A text corpus file, split and cut into windows whose context comes from the first
//! byte; every window must lie inside its part of the text, and its targets must be its
//! inputs shifted by one.
inline void read_text_input(std::span<std::uint8_t const> bytes) {
  try {
    mpx::text_corpus const corpus = mpx::read_text_corpus(input_file(bytes));
    auto const split = mpx::split_text(corpus, 0.25);
    if (split.train.size() + split.validation.size() != corpus.size()) std::abort();
    std::size_t const context = 1 + corpus.bytes[0] % 32;
    mpx::host_executor exec;
    mpx::text_batches<mpx::host_executor> windows(exec, split.train, {.context = context, .batch_size = 4, .seed = 1});
    auto const b = windows.next();
    if (!b) std::abort();
    for (std::size_t i = 0; i + 1 < b->inputs.size(); ++i)
      if ((i + 1) % context != 0 && b->inputs.data()[i + 1] != b->targets.data()[i]) std::abort();
  } catch (mpx::error const&) {
  }
}

//! The reader a fuzzer or corpus folder is named after.
inline void read_input(std::string_view reader, std::span<std::uint8_t const> bytes) {
  if (reader == "idx") return read_idx_input(bytes);
  if (reader == "checkpoint") return read_checkpoint_input(bytes);
  if (reader == "model") return read_model_input(bytes);
  if (reader == "text") return read_text_input(bytes);
  std::fprintf(stderr, "mpx_fuzz: no reader named '%.*s'\n", static_cast<int>(reader.size()), reader.data());
  std::abort();
}

}  // namespace mpx_fuzz
