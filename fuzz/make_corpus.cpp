// Writes the seed corpora of the fuzzers (fuzz/corpus/<reader>/) with mpx's own
// writers: for each reader, valid files of the kinds it meets, then a truncated and a
// bit-flipped copy of each so the fuzzer starts on both sides of every check. Small on
// purpose (a few KB per reader): libFuzzer mutates from here. Also writes the hostile
// files of issue 21 to fuzz/regressions/<reader>/ (a gzip bomb, dimensions whose
// product overflowed before a zero, impossible checkpoint values, repeated and unknown
// sections), beside which the reproducers of future findings go; the host suite
// replays both folders (tests/model/test_fuzz_corpus.cpp).
//   c++ -std=c++20 -I. -Iinclude -isystem $CUDA/include -isystem $CUDA/include/cccl \
//       -DMPX_HAS_ZLIB=1 fuzz/make_corpus.cpp -lz -o make_corpus && ./make_corpus fuzz
// (fuzz/run.sh --regenerate does this.)
#include "examples/common/command_line.hpp"
#include "fuzz/targets.hpp"

#include <mpx/optim/sgd.hpp>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::vector<std::uint8_t> file_bytes(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void put(fs::path const& dir, std::string const& name, std::vector<std::uint8_t> const& bytes) {
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

//! The file, a copy cut at two thirds, and a copy with one bit flipped in the middle.
void put_with_damage(fs::path const& dir, std::string const& name, std::vector<std::uint8_t> const& bytes) {
  put(dir, name, bytes);
  put(dir, name + ".truncated", {bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(bytes.size() * 2 / 3)});
  auto flipped = bytes;
  if (!flipped.empty()) flipped[flipped.size() / 2] ^= 0x04;
  put(dir, name + ".flipped", flipped);
}

void idx_corpus(fs::path const& dir) {
  mpx::idx_array images{{3, 2, 2}, {}};
  for (int i = 0; i < 12; ++i) images.data.push_back(static_cast<std::uint8_t>(i * 21));
  mpx::idx_array const labels{{5}, {0, 1, 2, 3, 9}};
  mpx::idx_array const empty{{0, 28, 28}, {}};
  auto const plain = mpx::idx_bytes(images);
  put_with_damage(dir, "images.idx", plain);
  put(dir, "labels.idx", mpx::idx_bytes(labels));
  put(dir, "empty.idx", mpx::idx_bytes(empty));
  if constexpr (mpx::idx_gzip_available) {
    auto const gz = mpx::detail::gzip_bytes(plain, "corpus", "make_corpus");
    put_with_damage(dir, "images.idx.gz", gz);
    auto two_members = mpx::detail::gzip_bytes(mpx::idx_bytes(labels), "corpus", "make_corpus");
    auto const half = two_members.size();
    two_members.insert(two_members.end(), two_members.begin(), two_members.begin() + static_cast<std::ptrdiff_t>(half));
    put(dir, "labels_twice.idx.gz", two_members);  // two members: the data repeated (trailing garbage)
  }
}

void checkpoint_corpus(fs::path const& dir, fs::path const& scratch) {
  auto& o = mpx_fuzz::objects();
  o.optimizer.save(o.exec, scratch);
  put_with_damage(dir, "fresh.ckpt", file_bytes(scratch));
  o.optimizer.optimizer().allow_step_without_backward(true);  // the built model's zero gradients, on purpose
  o.optimizer.step(o.exec);  // zero gradients: finite, applied
  o.optimizer.step(o.exec);
  o.optimizer.save(o.exec, scratch);
  put_with_damage(dir, "two_steps.ckpt", file_bytes(scratch));
  auto sgd = mpx::sgd(o.exec, o.model.parameters(o.exec), 0.1f, {.momentum = 0.9f});
  sgd.save(o.exec, scratch);  // a plain optimizer's file: another kind
  put(dir, "sgd.ckpt", file_bytes(scratch));
}

void model_corpus(fs::path const& dir, fs::path const& scratch) {
  auto& o = mpx_fuzz::objects();
  mpx::save_model(o.exec, o.model, scratch);
  put_with_damage(dir, "model.mpx", file_bytes(scratch));
  auto wider = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3, mpx::activation::tanh), mpx::dense<>(2),
                                                   mpx::dense<>(2));
  wider.build(o.exec, {4}, 2);
  mpx::save_model(o.exec, wider, scratch);  // one layer more: refused, or loaded partially
  put(dir, "extra_layer.mpx", file_bytes(scratch));
}

//! The hostile files of issue 21, each once refused by mistake or not at all.
void idx_regressions(fs::path const& dir) {
  constexpr std::uint8_t ff = 0xFF;
  put(dir, "zero_last.idx", {0, 0, 8, 4, ff, ff, ff, ff, ff, ff, ff, ff, ff, ff, ff, ff, 0, 0, 0, 0});
  put(dir, "zero_first.idx", {0, 0, 8, 4, 0, 0, 0, 0, ff, ff, ff, ff, ff, ff, ff, ff, ff, ff, ff, ff});
  if constexpr (mpx::idx_gzip_available) {
    // 4 bytes described, 8 MiB of zeros after them: an 8 KB file.
    auto bomb = mpx::detail::gzip_bytes(std::vector<std::uint8_t>{0, 0, 8, 1, 0, 0, 0, 4, 1, 2, 3, 4}, "corpus", "make_corpus");
    auto const zeros = mpx::detail::gzip_bytes(std::vector<std::uint8_t>(8u << 20), "corpus", "make_corpus");
    bomb.insert(bomb.end(), zeros.begin(), zeros.end());
    put(dir, "bomb.idx.gz", bomb);
  }
}

//! The corpus's two-step checkpoint rewritten by mpx's writer (a valid checksum) with
//! `edit` applied to each section: contents no saver writes.
void put_rewritten(fs::path const& dir, std::string const& name, fs::path const& from,
                   std::function<void(std::string const&, std::vector<std::byte>&, mpx::detail::checkpoint_writer&)> const& edit) {
  mpx::detail::checkpoint_reader const in(from, "mpx::loss_scale_optimizer");
  mpx::detail::checkpoint_writer out("mpx::loss_scale_optimizer");
  for (std::string const& section : in.unread_sections()) {
    auto const bytes = in.section(section);
    std::vector<std::byte> copy(bytes.begin(), bytes.end());
    edit(section, copy, out);
  }
  out.commit(dir / name);
}

void checkpoint_regressions(fs::path const& dir, fs::path const& good) {
  auto set = [](std::vector<std::byte>& bytes, std::size_t at, auto value) {
    std::memcpy(bytes.data() + at, &value, sizeof value);
  };
  put_rewritten(dir, "nan_scale.ckpt", good, [&](auto const& name, auto& bytes, auto& out) {
    if (name == "scaler/state") set(bytes, offsetof(mpx::loss_scale_state, scale), std::nanf(""));
    out.add(name, bytes);
  });
  put_rewritten(dir, "max_steps.ckpt", good, [&](auto const& name, auto& bytes, auto& out) {
    if (name == "optimizer/steps") set(bytes, 0, ~std::uint64_t{0});
    out.add(name, bytes);
  });
  put_rewritten(dir, "repeated_section.ckpt", good, [&](auto const& name, auto& bytes, auto& out) {
    out.add(name, bytes);
    if (name == "scaler/state") out.add(name, bytes);
  });
  put_rewritten(dir, "unknown_section.ckpt", good, [&](auto const& name, auto& bytes, auto& out) {
    out.add(name, bytes);
    if (name == "scaler/rule") out.add("scaler/extra", bytes);
  });
}

//! A model file that lacks a layer of the model: it loaded, leaving that layer as it was.
void model_regressions(fs::path const& dir, fs::path const& scratch) {
  auto& o = mpx_fuzz::objects();
  auto shorter = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3, mpx::activation::tanh));
  shorter.build(o.exec, {4}, 3);
  mpx::save_model(o.exec, shorter, scratch);
  put(dir, "missing_layer.mpx", file_bytes(scratch));
}

//! Text corpora: a few fortunes (with fortune's % separators), damaged copies, one byte,
//! an empty file, and every byte value (the first byte picks the window length).
void text_corpus(fs::path const& dir) {
  std::string const fortunes =
      "A day for firm decisions!!!!!  Or is it?\n%\nA few hours grace before the madness begins again.\n%\n"
      "Don't look now, but the man in the moon is laughing at you.\n%\n";
  put_with_damage(dir, "fortunes.txt", {fortunes.begin(), fortunes.end()});
  put(dir, "one_byte", {'x'});
  put(dir, "empty", {});
  std::vector<std::uint8_t> all(256);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint8_t>(255 - i);
  put(dir, "every_byte", all);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FUZZ_DIR (writes FUZZ_DIR/corpus/<reader>/ and FUZZ_DIR/regressions/<reader>/)\n", argv[0]);
    return 2;
  }
  fs::path const corpus = fs::path(argv[1]) / "corpus";
  fs::path const regressions = fs::path(argv[1]) / "regressions";
  for (auto reader : mpx_fuzz::readers) {
    fs::remove_all(corpus / reader);
    fs::create_directories(corpus / reader);
    fs::create_directories(regressions / reader);  // reproducers of findings are kept
  }
  fs::path const scratch = fs::temp_directory_path() / ("mpx_make_corpus_" + std::to_string(::getpid()));
  idx_corpus(corpus / "idx");
  checkpoint_corpus(corpus / "checkpoint", scratch);
  model_corpus(corpus / "model", scratch);
  text_corpus(corpus / "text");
  model_regressions(regressions / "model", scratch);
  fs::remove(scratch);
  idx_regressions(regressions / "idx");
  checkpoint_regressions(regressions / "checkpoint", corpus / "checkpoint" / "two_steps.ckpt");
  // Every file goes through its reader once here: one that crashes is a finding now.
  for (auto const& root : {corpus, regressions})
    for (auto reader : mpx_fuzz::readers)
      for (auto const& entry : fs::directory_iterator(root / reader)) {
        auto const bytes = file_bytes(entry.path());
        mpx_fuzz::read_input(reader, bytes);
      }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("make_corpus");
}
