// The byte-level text corpus (data/text_corpus.hpp): windows and next-token targets,
// every window once per epoch, reproducible shuffles and mid-epoch resumption, the
// deterministic split, bad inputs refused with mpx errors, and the real fortunes corpus.
#include "../support/testing.hpp"

#include <mpx/data/text_corpus.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

mpx::text_corpus corpus_of(std::string const& s) {
  return mpx::text_corpus_of(std::span<std::uint8_t const>(reinterpret_cast<std::uint8_t const*>(s.data()), s.size()));
}

void write_text(std::filesystem::path const& p, std::string const& s) {
  std::ofstream(p, std::ios::binary) << s;
}

// Every batch of one epoch, as host vectors: {window indices, inputs, targets}.
struct epoch_batches {
  std::vector<std::vector<std::size_t>> windows;
  std::vector<std::vector<std::int32_t>> inputs, targets;
};

template <class Exec>
epoch_batches collect(Exec const& exec, mpx::text_batches<Exec>& b, std::uint64_t epoch, std::size_t first = 0) {
  epoch_batches out;
  b.start_epoch(epoch, first);
  while (auto batch = b.next()) {
    out.windows.emplace_back(batch->windows.begin(), batch->windows.end());
    out.inputs.push_back(mpx_test::download(exec, batch->inputs));
    out.targets.push_back(mpx_test::download(exec, batch->targets));
  }
  return out;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("text windows hold tokens [s, s + L) and their next tokens, every window once an epoch",
                        "[text_corpus]", mpx_test::executors) {
  TestType exec;
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>(i * 7 % 251 + 1);  // distinct neighbours
  auto const corpus = corpus_of(text);
  for (std::size_t context : {1u, 7u, 64u}) {
    for (std::size_t stride : {0u, 1u, 5u}) {
      for (std::size_t batch_size : {1u, 3u, 32u}) {
        mpx::text_batches<TestType> b(exec, corpus.bytes, {.context = context, .batch_size = batch_size,
                                                           .stride = stride, .seed = 9});
        std::size_t const step = stride ? stride : context;
        INFO("context=" << context << " stride=" << step << " batch=" << batch_size);
        REQUIRE(b.windows() == (text.size() - context - 1) / step + 1);
        auto const e = collect(exec, b, 3);
        REQUIRE(e.windows.size() == b.batches_per_epoch());
        std::vector<std::size_t> seen;
        for (std::size_t k = 0; k < e.windows.size(); ++k) {
          REQUIRE(e.inputs[k].size() == e.windows[k].size() * context);
          for (std::size_t w = 0; w < e.windows[k].size(); ++w) {
            std::size_t const s = e.windows[k][w] * step;
            REQUIRE(s + context + 1 <= text.size());
            for (std::size_t t = 0; t < context; ++t) {
              REQUIRE(e.inputs[k][w * context + t] == static_cast<std::uint8_t>(text[s + t]));
              REQUIRE(e.targets[k][w * context + t] == static_cast<std::uint8_t>(text[s + t + 1]));
            }
            seen.push_back(e.windows[k][w]);
          }
        }
        std::sort(seen.begin(), seen.end());
        std::vector<std::size_t> all(b.windows());
        std::iota(all.begin(), all.end(), std::size_t{0});
        REQUIRE(seen == all);
      }
    }
  }
}

TEMPLATE_LIST_TEST_CASE("text batches are reproducible from the seed and resume mid-epoch", "[text_corpus]",
                        mpx_test::executors) {
  TestType exec;
  std::string text(5000, 'x');
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>('a' + i * 31 % 26);
  auto const corpus = corpus_of(text);
  mpx::text_batch_options const options{.context = 16, .batch_size = 8, .stride = 3, .seed = 42};
  mpx::text_batches<TestType> a(exec, corpus.bytes, options), b(exec, corpus.bytes, options);
  auto const a1 = collect(exec, a, 1);
  auto const b1 = collect(exec, b, 1);
  CHECK(a1.windows == b1.windows);
  CHECK(a1.inputs == b1.inputs);
  CHECK(a1.targets == b1.targets);
  CHECK(collect(exec, a, 2).windows != a1.windows);  // a new shuffle each epoch
  auto other = options;
  other.seed = 43;
  mpx::text_batches<TestType> c(exec, corpus.bytes, other);
  CHECK(collect(exec, c, 1).windows != a1.windows);
  // Resuming at batch 5 gives the rest of the same epoch.
  auto const resumed = collect(exec, b, 1, 5);
  REQUIRE(resumed.windows.size() + 5 == a1.windows.size());
  for (std::size_t k = 0; k < resumed.windows.size(); ++k) {
    CHECK(resumed.windows[k] == a1.windows[k + 5]);
    CHECK(resumed.inputs[k] == a1.inputs[k + 5]);
  }
  CHECK_THROWS_AS(b.start_epoch(1, b.batches_per_epoch() + 1), mpx::invalid_argument);
  // Without shuffling, windows come in text order; drop_last drops the short batch.
  mpx::text_batches<TestType> ordered(exec, corpus.bytes, {.context = 16, .batch_size = 8, .shuffle = false,
                                                           .drop_last = true});
  auto const o = collect(exec, ordered, 7);
  REQUIRE(o.windows.size() == ordered.windows() / 8);
  CHECK(o.windows[1] == std::vector<std::size_t>{8, 9, 10, 11, 12, 13, 14, 15});
}

TEST_CASE("the train/validation split is the corpus's tail, the same every time", "[text_corpus]") {
  auto const corpus = corpus_of("0123456789");
  auto const s = mpx::split_text(corpus, 0.2);
  CHECK(std::string(s.train.begin(), s.train.end()) == "01234567");
  CHECK(std::string(s.validation.begin(), s.validation.end()) == "89");
  auto const tiny = mpx::split_text(corpus, 0.01);  // at least one validation byte
  CHECK(tiny.validation.size() == 1);
  CHECK(tiny.train.size() == 9);
  auto const again = mpx::split_text(corpus, 0.2);
  CHECK(again.train.data() == s.train.data());
  CHECK(again.validation.size() == s.validation.size());
  for (double bad : {0.0, 1.0, -0.5, 1.5, std::numeric_limits<double>::quiet_NaN()})
    CHECK_THROWS_TYPE_WITH(mpx::split_text(corpus, bad), mpx::invalid_argument, Catch::Contains("(0, 1)"));
  CHECK_THROWS_TYPE_WITH(mpx::split_text(corpus_of("x"), 0.5), mpx::data_error, Catch::Contains("1 bytes"));
  CHECK_THROWS_TYPE_WITH(mpx::split_text(corpus, 0.999), mpx::data_error, Catch::Contains("10 bytes"));
}

TEST_CASE("bad corpora and windows are clear mpx errors", "[text_corpus]") {
  mpx_test::scratch_dir dir("text_corpus");
  mpx::host_executor exec;
  CHECK_THROWS_TYPE_WITH(mpx::read_text_corpus(dir / "missing.txt"), mpx::data_error,
                         Catch::Contains("missing.txt") && Catch::Contains("cannot open"));
  write_text(dir / "empty.txt", "");
  CHECK_THROWS_TYPE_WITH(mpx::read_text_corpus(dir / "empty.txt"), mpx::data_error, Catch::Contains("no text"));
  std::filesystem::create_directories(dir / "nothing");
  write_text(dir / "nothing" / "only.dat", "index");
  CHECK_THROWS_TYPE_WITH(mpx::read_text_corpus(dir / "nothing"), mpx::data_error,
                         Catch::Contains("nothing") && Catch::Contains("no text file"));
  CHECK_THROWS_TYPE_WITH(mpx::text_corpus_of({}), mpx::data_error, Catch::Contains("no text"));

  auto const corpus = corpus_of("short text");
  CHECK_THROWS_TYPE_WITH(mpx::text_batches<mpx::host_executor>(exec, corpus.bytes, {.context = 10}), mpx::data_error,
                         Catch::Contains("11 bytes") && Catch::Contains("has 10"));
  CHECK_NOTHROW(mpx::text_batches<mpx::host_executor>(exec, corpus.bytes, {.context = 9}));
  CHECK_THROWS_AS(mpx::text_batches<mpx::host_executor>(exec, corpus.bytes, {.context = 0}), mpx::invalid_argument);
  CHECK_THROWS_AS(mpx::text_batches<mpx::host_executor>(exec, corpus.bytes, {.context = 4, .batch_size = 0}),
                  mpx::invalid_argument);
}

TEST_CASE("a directory corpus reads its text files in name order and skips the rest", "[text_corpus]") {
  mpx_test::scratch_dir dir("text_corpus_dir");
  write_text(dir / "b", "world");
  write_text(dir / "a.txt", "hello ");
  write_text(dir / "a.txt.dat", std::string("\0\0\0\2", 4));  // fortune's index
  std::filesystem::create_symlink("b", dir / "b.u8");
  std::filesystem::create_symlink("a.txt", dir / "link");
  write_text(dir / ".hidden", "secret");
  std::filesystem::create_directories(dir / "off");
  write_text(dir / "off" / "rude", "not read");
  auto const corpus = mpx::read_text_corpus(dir.path);
  CHECK(std::string(corpus.bytes.begin(), corpus.bytes.end()) == "hello world");
  REQUIRE(corpus.files.size() == 2);
  CHECK(std::filesystem::path(corpus.files[0]).filename() == "a.txt");
  CHECK(std::filesystem::path(corpus.files[1]).filename() == "b");
  // A single file, named directly, is read whatever its name.
  CHECK(mpx::read_text_corpus(dir / "a.txt.dat").size() == 4);
}

TEST_CASE("the fortunes corpus loads, splits and serves windows", "[text_corpus]") {
  std::filesystem::path const fortunes = "/usr/share/games/fortunes";
  INFO("Debian's fortunes package (scripts/setup.sh installs it) provides " << fortunes);
  REQUIRE(std::filesystem::is_directory(fortunes));
  auto const corpus = mpx::read_text_corpus(fortunes);
  CHECK(corpus.files.size() >= 10);
  for (auto const& f : corpus.files) {
    INFO(f);
    CHECK(f.find(".dat") == std::string::npos);
    CHECK(f.find(".u8") == std::string::npos);
  }
  CHECK(corpus.size() > 1'000'000);
  std::string const text(corpus.bytes.begin(), corpus.bytes.end());
  CHECK(text.find("\n%\n") != std::string::npos);  // fortune's separator
  auto const split = mpx::split_text(corpus, 0.1);
  CHECK(split.validation.size() == static_cast<std::size_t>(std::llround(0.1 * static_cast<double>(corpus.size()))));
  mpx::host_executor exec;
  mpx::text_batches<mpx::host_executor> train(exec, split.train, {.context = 64, .batch_size = 16, .seed = 1});
  auto const b = train.next();
  REQUIRE(b);
  CHECK(b->inputs.shape() == mpx::shape{16, 64});
  CHECK(train.windows() == (split.train.size() - 65) / 64 + 1);
}
