// The data folder: IDX files read back as written (plain and gzip, told apart by their
// bytes), every malformed file refused with a message naming the file and the fault,
// data sets assembled from image and label files, a shuffle pinned to fixed values so
// it is the same on every platform, and batches in each storage dtype in the
// executor's memory. The installed Fashion-MNIST test split is checked where present.
#include "../support/testing.hpp"

#include <mpx/data/batches.hpp>
#include <mpx/data/dataset.hpp>
#include <mpx/data/idx.hpp>
#include <mpx/data/tensor_batches.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

using temp_dir = mpx_test::scratch_dir;

void write_bytes(fs::path const& path, std::vector<std::uint8_t> const& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::vector<std::uint8_t> read_bytes(fs::path const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

mpx::idx_array random_idx(std::vector<std::int64_t> dims, std::uint64_t stream) {
  mpx::idx_array a{std::move(dims), {}};
  mpx::splitmix64 rng(mpx_test::seed + stream);
  a.data.resize(a.size());
  for (auto& v : a.data) v = static_cast<std::uint8_t>(rng() >> 56);
  return a;
}

//! n images of h x w whose pixels are distinct per image, and labels i % classes.
void write_small_dataset(temp_dir const& dir, std::int64_t n, std::int64_t h, std::int64_t w,
                         mpx::idx_compression c = mpx::idx_compression::none) {
  mpx::idx_array images{{n, h, w}, {}};
  for (std::int64_t i = 0; i < n * h * w; ++i) images.data.push_back(static_cast<std::uint8_t>((i * 7) % 256));
  mpx::idx_array labels{{n}, {}};
  for (std::int64_t i = 0; i < n; ++i) labels.data.push_back(static_cast<std::uint8_t>(i % 10));
  mpx::write_idx(dir / "images", images, c);
  mpx::write_idx(dir / "labels", labels, c);
}

}  // namespace

TEST_CASE("idx: a plain file reads back as written", "[data][idx]") {
  temp_dir dir("plain");
  for (auto const& dims : std::vector<std::vector<std::int64_t>>{{17}, {3, 4, 5}, {2, 3, 4, 1}, {0, 28, 28}}) {
    auto const a = random_idx(dims, dims.size());
    mpx::write_idx(dir / "a.idx", a);
    auto const bytes = read_bytes(dir / "a.idx");
    REQUIRE(bytes.size() == 4 + 4 * dims.size() + a.data.size());
    CHECK(bytes[0] == 0x00);
    CHECK(bytes[1] == 0x00);
    CHECK(bytes[2] == 0x08);
    CHECK(bytes[3] == dims.size());
    auto const b = mpx::read_idx(dir / "a.idx");
    CHECK(b.dims == a.dims);
    CHECK(b.data == a.data);
  }
  // Big-endian dimensions: 0x00000102 = 258.
  std::vector<std::uint8_t> bytes{0, 0, 8, 1, 0, 0, 1, 2};
  bytes.resize(bytes.size() + 258, 9);
  write_bytes(dir / "be.idx", bytes);
  CHECK(mpx::read_idx(dir / "be.idx").dims == std::vector<std::int64_t>{258});
  // The name decides nothing: a plain file called .gz is read as plain.
  mpx::write_idx(dir / "plain.gz", random_idx({6}, 1));
  CHECK(mpx::read_idx(dir / "plain.gz").data == random_idx({6}, 1).data);
}

TEST_CASE("idx: a gzip file reads back as written, recognised by its bytes", "[data][idx]") {
  temp_dir dir("gzip");
  auto a = random_idx({100, 28, 28}, 2);
  for (auto& v : a.data) v &= 7;  // 3 random bits a byte: compressible
  if constexpr (!mpx::idx_gzip_available) {
    CHECK_THROWS_TYPE_WITH(mpx::write_idx(dir / "a.gz", a, mpx::idx_compression::gzip), mpx::data_error,
                           Contains("zlib") && Contains("a.gz"));
    write_bytes(dir / "b.gz", {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3});
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(dir / "b.gz"), mpx::data_error,
                           Contains("b.gz") && Contains("gzip-compressed") &&
                               Contains("zlib was not available when this program was built"));
    WARN("built without zlib: only the refusal of gzip files was checked");
    return;
  }
  mpx::write_idx(dir / "images", a, mpx::idx_compression::gzip);  // no .gz in the name
  auto const bytes = read_bytes(dir / "images");
  REQUIRE(bytes.size() > 2);
  CHECK(bytes[0] == 0x1f);
  CHECK(bytes[1] == 0x8b);
  CHECK(bytes.size() < a.data.size() / 2);  // compressed
  auto const b = mpx::read_idx(dir / "images");
  CHECK(b.dims == a.dims);
  CHECK(b.data == a.data);

  // Concatenated gzip members are one stream (what `cat a.gz b.gz` makes).
  auto const plain = mpx::idx_bytes(a);
  std::size_t const half = plain.size() / 2;
  auto first = mpx::detail::gzip_bytes(std::span(plain).first(half), "x", "test");
  auto const second = mpx::detail::gzip_bytes(std::span(plain).subspan(half), "x", "test");
  first.insert(first.end(), second.begin(), second.end());
  write_bytes(dir / "two_members.gz", first);
  CHECK(mpx::read_idx(dir / "two_members.gz").data == a.data);
}

TEST_CASE("idx: every malformed file is refused, naming the file and the fault", "[data][idx][errors]") {
  temp_dir dir("bad");
  auto const file = [&](std::string const& name, std::vector<std::uint8_t> const& bytes) {
    write_bytes(dir / name, bytes);
    return dir / name;
  };

  auto const missing = dir / "missing-images-idx3-ubyte";
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(missing), mpx::data_error,
                         Contains("mpx::read_idx") && Contains(missing.string()) && Contains("cannot open") &&
                             Contains("No such file"));
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(dir.path), mpx::data_error, Contains("is a directory"));

  // Fewer data bytes than the dimensions ask for: expected and found are named.
  auto const truncated = file("truncated", {0, 0, 8, 2, 0, 0, 0, 3, 0, 0, 0, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(truncated), mpx::data_error,
                         Contains(truncated.string()) && Contains("truncated") && Contains("[3, 4]") &&
                             Contains("need 12 data bytes") && Contains("found 10"));
  auto const short_header = file("short_header", {0, 0, 8, 3, 0, 0, 0, 1, 0, 0});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(short_header), mpx::data_error,
                         Contains("truncated") && Contains("needs 16 bytes, found 10"));
  auto const tiny = file("tiny", {0, 0});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(tiny), mpx::data_error, Contains("2 bytes, too short"));
  auto const empty = file("empty", {});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(empty), mpx::data_error, Contains("0 bytes, too short"));

  auto const trailing = file("trailing", {0, 0, 8, 1, 0, 0, 0, 2, 5, 6, 7, 8});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(trailing), mpx::data_error,
                         Contains(trailing.string()) && Contains("trailing garbage: 2 bytes after the 2 data bytes"));

  auto const magic = file("magic", {0x50, 0x4b, 3, 4, 0, 0, 0, 0});  // a zip file
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(magic), mpx::data_error,
                         Contains(magic.string()) && Contains("wrong magic") && Contains("0x50 0x4B 0x03 0x04"));
  auto const floats = file("floats", {0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0x80, 0x3f});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(floats), mpx::data_error,
                         Contains("element type float32 (0x0D) is not supported"));
  auto const unknown = file("unknown", {0, 0, 0x42, 1, 0, 0, 0, 0});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(unknown), mpx::data_error, Contains("unknown type 0x42"));
  auto const rank0 = file("rank0", {0, 0, 8, 0, 7});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(rank0), mpx::data_error, Contains("bad number of dimensions 0"));
  auto const rank9 = file("rank9", {0, 0, 8, 9});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(rank9), mpx::data_error, Contains("bad number of dimensions 9"));
  // Dimensions whose product overflows 64 bits are a truncation, not a crash.
  auto const huge = file("huge", {0, 0, 8, 3, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 1});
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(huge), mpx::data_error, Contains("more than 2^64"));

  if constexpr (mpx::idx_gzip_available) {
    auto const good = mpx::detail::gzip_bytes(mpx::idx_bytes(random_idx({40, 28, 28}, 3)), "x", "test");
    REQUIRE(good.size() > 100);

    auto corrupt = good;
    for (std::size_t i = 20; i < 40; ++i) corrupt[i] ^= 0x5a;  // inside the deflate data
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("corrupt.gz", corrupt)), mpx::data_error,
                           Contains("corrupt.gz") && Contains("corrupt gzip stream"));
    auto bad_crc = good;
    bad_crc[bad_crc.size() - 8] ^= 1;  // the CRC-32 in the trailer
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("bad_crc.gz", bad_crc)), mpx::data_error,
                           Contains("corrupt gzip stream: incorrect data check"));
    auto const bad_header = file("bad_header.gz", {0x1f, 0x8b, 0x63, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3});
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(bad_header), mpx::data_error, Contains("corrupt gzip stream"));
    auto cut = good;
    cut.resize(cut.size() / 2);
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("cut.gz", cut)), mpx::data_error,
                           Contains("cut.gz") && Contains("gzip stream ends early"));
    auto junk = good;
    junk.insert(junk.end(), {'j', 'u', 'n', 'k'});
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("junk.gz", junk)), mpx::data_error,
                           Contains("4 bytes of trailing garbage after the end of the gzip stream"));
    // A well-formed gzip stream around a truncated IDX file: the IDX check still runs.
    auto const inner = mpx::detail::gzip_bytes(std::vector<std::uint8_t>{0, 0, 8, 1, 0, 0, 0, 5, 1}, "x", "test");
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("inner.gz", inner)), mpx::data_error,
                           Contains("inner.gz") && Contains("need 5 data bytes") && Contains("found 1"));
  }
}

// Found by trying hostile files against the reader (issue 21): an unbounded gzip
// inflation, a decision that depended on the order of the dimensions, names the file
// system refuses. Each is refused with a data_error naming the file, or read exactly.
TEST_CASE("idx: hostile files: gzip bombs, exact dimension products, names no file system takes",
          "[data][idx][errors]") {
  temp_dir dir("hostile");
  auto const file = [&](std::string const& name, std::vector<std::uint8_t> const& bytes) {
    write_bytes(dir / name, bytes);
    return dir / name;
  };
  auto const header = [](std::vector<std::uint32_t> const& dims) {
    std::vector<std::uint8_t> h{0, 0, 8, static_cast<std::uint8_t>(dims.size())};
    for (std::uint32_t d : dims)
      for (int shift = 24; shift >= 0; shift -= 8) h.push_back(static_cast<std::uint8_t>(d >> shift));
    return h;
  };
  auto const peak_rss_kib = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_maxrss;
  };

  // The exact product decides: a zero anywhere makes an empty array, however large the
  // other dimensions and in whatever order (2^96 before a zero used to "overflow").
  constexpr std::uint32_t big = 0xFFFFFFFFu;
  for (auto const& dims : std::vector<std::vector<std::uint32_t>>{{big, big, big, 0}, {0, big, big, big}, {big, 0, big, big}}) {
    mpx::idx_array const a = mpx::read_idx(file("zero", header(dims)));
    CHECK(a.data.empty());
    CHECK(a.dims == std::vector<std::int64_t>(dims.begin(), dims.end()));
    auto one_more = header(dims);
    one_more.push_back(7);
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("zero_plus_one", one_more)), mpx::data_error,
                           Contains("trailing garbage: 1 bytes after the 0 data bytes"));
  }
  // Just below 2^64 data bytes the count is exact; at 2^64 no file can hold it.
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("2^63", header({65536, 65536, 65536, 32768}))), mpx::data_error,
                         Contains("need 9223372036854775808 data bytes after the header, found 0"));
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("2^64", header({65536, 65536, 65536, 65536}))), mpx::data_error,
                         Contains("2^64") && Contains("[65536, 65536, 65536, 65536]"));

  // Names the file system refuses are data_errors too, never filesystem_error.
  fs::create_symlink(dir / "loop_b", dir / "loop_a");
  fs::create_symlink(dir / "loop_a", dir / "loop_b");
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(dir / "loop_a"), mpx::data_error,
                         Contains("loop_a") && Contains("symbolic links"));
  std::string const long_name(300, 'x');
  CHECK_THROWS_TYPE_WITH(mpx::read_idx(dir / long_name), mpx::data_error,
                         Contains(long_name) && Contains("File name too long"));

  if constexpr (mpx::idx_gzip_available) {
    // A bomb: the header describes 4 bytes, the stream goes on to 256 MiB of zeros (32
    // members of 8 MiB). Only the 12 bytes described, plus one, may be inflated.
    auto bomb = mpx::detail::gzip_bytes(std::vector<std::uint8_t>{0, 0, 8, 1, 0, 0, 0, 4, 1, 2, 3, 4}, "x", "test");
    auto const zeros = mpx::detail::gzip_bytes(std::vector<std::uint8_t>(8u << 20), "x", "test");
    for (int i = 0; i < 32; ++i) bomb.insert(bomb.end(), zeros.begin(), zeros.end());
    auto const bomb_file = file("bomb.gz", bomb);
    long const before = peak_rss_kib();
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(bomb_file), mpx::data_error,
                           Contains("bomb.gz") && Contains("inflates to more than the 12 bytes its header describes"));
    CHECK(peak_rss_kib() - before < 64 * 1024);
    // A header asking for 4 GiB in a stream of 10 bytes: a truncation, nothing reserved.
    auto const asks = mpx::detail::gzip_bytes(std::vector<std::uint8_t>{0, 0, 8, 1, 255, 255, 255, 255, 1, 2}, "x", "test");
    CHECK_THROWS_TYPE_WITH(mpx::read_idx(file("asks.gz", asks)), mpx::data_error,
                           Contains("asks.gz") && Contains("need 4294967295 data bytes after the header, found 2"));
    CHECK(peak_rss_kib() - before < 64 * 1024);
    // The same header and data as a plain file, gzip-compressed: still read exactly.
    auto const fine = mpx::detail::gzip_bytes(header({big, 0}), "x", "test");
    CHECK(mpx::read_idx(file("fine.gz", fine)).dims == std::vector<std::int64_t>{big, 0});
  }
}

TEST_CASE("datasets: images in [0, 1], labels, limits and the errors that name both files", "[data][errors]") {
  temp_dir dir("dataset");
  write_small_dataset(dir, 12, 3, 2);
  auto const data = mpx::load_idx_dataset(dir / "images", dir / "labels");
  REQUIRE(data.size() == 12);
  CHECK(data.images.shape() == mpx::shape{12, 3, 2, 1});
  CHECK(data.image_size() == 6);
  CHECK(data.num_classes == 10);
  for (std::size_t i = 0; i < data.images.size(); ++i) {
    INFO("pixel " << i);
    REQUIRE(data.images[i] == static_cast<float>((i * 7) % 256) / 255.0f);
  }
  for (std::size_t i = 0; i < data.size(); ++i) CHECK(data.labels[i] == static_cast<std::int32_t>(i % 10));

  auto const first5 = mpx::load_idx_dataset(dir / "images", dir / "labels", {.limit = 5});
  CHECK(first5.size() == 5);
  CHECK(first5.images.shape() == mpx::shape{5, 3, 2, 1});
  CHECK(std::equal(first5.images.data(), first5.images.data() + 30, data.images.data()));

  // Mean 0 and standard deviation 1 after normalize().
  auto normalized = mpx::load_idx_dataset(dir / "images", dir / "labels");
  auto const stats = mpx::compute_pixel_statistics(normalized);
  CHECK(stats.mean > 0.1);
  mpx::normalize(normalized, stats);
  auto const after = mpx::compute_pixel_statistics(normalized);
  CHECK(std::abs(after.mean) < 1e-6);
  CHECK(std::abs(after.stddev - 1) < 1e-5);
  CHECK_THROWS_TYPE_WITH(mpx::normalize(normalized, {0.5, 0}), mpx::invalid_argument,
                         Contains("standard deviation must be positive"));

  // 12 images, 11 labels.
  mpx::write_idx(dir / "labels11", mpx::idx_array{{11}, std::vector<std::uint8_t>(11, 1)});
  CHECK_THROWS_TYPE_WITH(mpx::load_idx_dataset(dir / "images", dir / "labels11"), mpx::data_error,
                         Contains((dir / "images").string()) && Contains((dir / "labels11").string()) &&
                             Contains("12 images") && Contains("11 labels"));
  // A label outside [0, num_classes).
  mpx::write_idx(dir / "label10", mpx::idx_array{{12}, {0, 1, 10, 3, 4, 5, 6, 7, 8, 9, 0, 1}});
  CHECK_THROWS_TYPE_WITH(mpx::load_idx_dataset(dir / "images", dir / "label10"), mpx::data_error,
                         Contains("label10") && Contains("label 10 of sample 2 is outside [0, 10)"));
  CHECK(mpx::load_idx_dataset(dir / "images", dir / "label10", {.num_classes = 11}).labels[2] == 10);
  // The files swapped.
  CHECK_THROWS_TYPE_WITH(mpx::load_idx_dataset(dir / "labels", dir / "images"), mpx::data_error,
                         Contains("is it a label file?"));
  CHECK_THROWS_TYPE_WITH(mpx::load_idx_dataset(dir / "images", dir / "images"), mpx::data_error,
                         Contains("is it an image file?"));
  CHECK_THROWS_TYPE_WITH(mpx::load_idx_dataset(dir / "images", dir / "labels", {.num_classes = 0}),
                         mpx::invalid_argument, Contains("num_classes"));

  // The MNIST layout: plain or .gz names; a directory without them.
  fs::create_directories(dir / "mnist");
  mpx::write_idx(dir / "mnist/t10k-images-idx3-ubyte", mpx::idx_array{{2, 2, 2}, {0, 255, 0, 255, 1, 2, 3, 4}});
  mpx::write_idx(dir / "mnist/t10k-labels-idx1-ubyte", mpx::idx_array{{2}, {3, 7}});
  auto const test = mpx::load_mnist(dir / "mnist", mpx::dataset_split::test);
  CHECK(test.size() == 2);
  CHECK(test.images[1] == 1.0f);
  CHECK(test.labels == std::vector<std::int32_t>{3, 7});
  CHECK_THROWS_TYPE_WITH(mpx::load_mnist(dir / "mnist"), mpx::data_error,
                         Contains("MNIST") && Contains("train-images-idx3-ubyte.gz") && Contains("mnist"));
  CHECK_THROWS_TYPE_WITH(mpx::load_fashion_mnist(dir / "mnist"), mpx::data_error,
                         Contains("mpx::load_fashion_mnist") && Contains("train-images-idx3-ubyte") &&
                             Contains("install Debian's dataset-fashion-mnist package"));
}

TEST_CASE("shuffle: splitmix64 and the epoch orders are fixed numbers", "[data][shuffle]") {
  // The first outputs of SplitMix64 from seed 0 (Vigna's reference splitmix64.c).
  mpx::splitmix64 g(0);
  CHECK(g() == 0xE220A8397B1DCDAFull);
  CHECK(g() == 0x6E789E6AA1B965F4ull);
  CHECK(g() == 0x06C45D188009454Full);

  // Pinned: a change here changes every user's training run.
  CHECK(mpx::shuffled_order(10, 42, 0) == std::vector<std::size_t>{6, 1, 8, 5, 2, 7, 4, 3, 9, 0});
  CHECK(mpx::shuffled_order(10, 42, 1) == std::vector<std::size_t>{9, 0, 5, 3, 7, 2, 8, 1, 6, 4});

  for (std::size_t n : {0, 1, 2, 7, 1000}) {
    for (std::uint64_t epoch = 0; epoch < 4; ++epoch) {
      auto const a = mpx::shuffled_order(n, 7, epoch);
      CHECK(a == mpx::shuffled_order(n, 7, epoch));  // same seed and epoch, same order
      auto sorted = a;
      std::sort(sorted.begin(), sorted.end());
      std::vector<std::size_t> identity(n);
      std::iota(identity.begin(), identity.end(), std::size_t{0});
      CHECK(sorted == identity);  // a permutation
    }
  }
  CHECK(mpx::shuffled_order(1000, 7, 0) != mpx::shuffled_order(1000, 7, 1));
  CHECK(mpx::shuffled_order(1000, 7, 0) != mpx::shuffled_order(1000, 8, 0));
  auto const one = mpx::shuffled_order(1000, 7, 0);
  std::vector<std::size_t> identity(1000);
  std::iota(identity.begin(), identity.end(), std::size_t{0});
  CHECK(one != identity);

  // Roughly uniform: over many shuffles of 4, each element lands in each place ~1/4.
  std::array<std::array<int, 4>, 4> counts{};
  for (std::uint64_t e = 0; e < 4000; ++e) {
    auto const o = mpx::shuffled_order(4, 3, e);
    for (std::size_t p = 0; p < 4; ++p) ++counts[o[p]][p];
  }
  for (auto const& row : counts)
    for (int c : row) CHECK((c > 900 && c < 1100));
}

TEMPLATE_LIST_TEST_CASE("batches: sizes, shuffle, contents in every storage dtype", "[data][batches]",
                        mpx_test::executors) {
  TestType exec;
  temp_dir dir(std::string("batches_") + std::string(TestType::name));
  write_small_dataset(dir, 10, 3, 2);
  auto const data = mpx::load_idx_dataset(dir / "images", dir / "labels");

  mpx_test::for_each_dtype([&]<class T>(T) {
    INFO("storage " << mpx::dtype_traits<T>::name);
    for (bool drop_last : {false, true}) {
      INFO("drop_last " << drop_last);
      mpx::batch_loader<TestType, T> loader(exec, data, {.batch_size = 4, .shuffle = true, .seed = 5, .drop_last = drop_last});
      CHECK(loader.batches_per_epoch() == (drop_last ? 2u : 3u));
      for (std::uint64_t epoch : {0u, 1u, 0u}) {
        loader.start_epoch(epoch);
        auto const expected_order = mpx::shuffled_order(10, 5, epoch);
        CHECK(std::vector<std::size_t>(loader.order().begin(), loader.order().end()) == expected_order);
        std::vector<std::size_t> seen;
        std::vector<std::size_t> sizes;
        while (auto b = loader.next()) {
          sizes.push_back(b->size);
          CHECK(b->index == sizes.size() - 1);
          CHECK(b->images.shape() == mpx::shape{static_cast<std::int64_t>(b->size), 3, 2, 1});
          CHECK(b->labels.shape() == mpx::shape{static_cast<std::int64_t>(b->size)});
          auto const images = mpx_test::download(exec, b->images);
          auto const labels = mpx_test::download(exec, b->labels);
          std::vector<T> expected_images;
          std::vector<std::int32_t> expected_labels;
          for (std::size_t s : b->samples) {
            for (std::size_t j = 0; j < 6; ++j) expected_images.push_back(mpx::cast<T>(data.images[s * 6 + j]));
            expected_labels.push_back(data.labels[s]);
            seen.push_back(s);
          }
          REQUIRE(mpx_test::first_mismatch(images, expected_images).empty());
          CHECK(labels == expected_labels);
        }
        CHECK_FALSE(loader.next());  // the epoch stays over
        CHECK(sizes == (drop_last ? std::vector<std::size_t>{4, 4} : std::vector<std::size_t>{4, 4, 2}));
        auto const visited = drop_last ? std::vector<std::size_t>(expected_order.begin(), expected_order.begin() + 8)
                                       : expected_order;
        CHECK(seen == visited);
      }
    }
  });

  // In order, one batch bigger than the data set, an empty epoch.
  mpx::batch_loader loader(exec, data, {.batch_size = 64, .shuffle = false});
  auto b = loader.next();  // starts epoch 0 by itself
  REQUIRE(b);
  CHECK(b->size == 10);
  CHECK(std::vector<std::size_t>(b->samples.begin(), b->samples.end()) ==
        std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(mpx_test::download(exec, b->labels) == data.labels);
  CHECK_FALSE(loader.next());
  mpx::batch_loader dropped(exec, data, {.batch_size = 64, .drop_last = true});
  CHECK(dropped.batches_per_epoch() == 0);
  CHECK_FALSE(dropped.next());

  CHECK_THROWS_TYPE_WITH((mpx::batch_loader<TestType, float>(exec, data, {.batch_size = 0})), mpx::invalid_argument,
                         Contains("batch_size must be positive"));
}


// The double buffer's two orderings, each able to fail on a GPU. The consumer's stream
// is held while it is given two batches and enqueues copies of them, then released:
// - an upload must wait for the consumer's earlier work on its slot (`released`): the
//   second next() of a hold stages batch k + 2 into the slot of batch k, whose copy is
//   held; without the wait the upload runs during the hold (the host sleeps long enough
//   for it) and the held copy reads batch k + 2;
// - the consumer must wait for a batch's upload (`copied`): batch k + 1's upload was
//   staged behind the hold, so it starts only at the release, and 8 MiB take the copy
//   engine far longer than the consumer needs to reach its copy of batch k + 1, which
//   without the wait reads the slot's previous batch.
// Images 63 x 63 make every sample's pixels differ from its neighbours' (the pattern of
// write_small_dataset repeats only every 256 samples), and the labels are checked too.
// Two next() calls per hold at most: a third would wait on the host for an upload that
// waits for the held stream.
TEMPLATE_LIST_TEST_CASE("batches: epochs through the double buffer without waiting keep every batch intact",
                        "[data][batches]", mpx_test::executors) {
  TestType exec;
  temp_dir dir(std::string("epochs_") + std::string(TestType::name));
  constexpr std::int64_t batch = 1024, n = 4 * batch + 200, side = 63, pixels = side * side;
  write_small_dataset(dir, n, side, side);
  auto const data = mpx::load_idx_dataset(dir / "images", dir / "labels");
  mpx::batch_loader<TestType, mpx::half> loader(exec, data, {.batch_size = batch, .seed = 11});
  // As a training step would, each batch is only used by work enqueued on the executor
  // (a copy into one tensor per epoch); the host waits once, at the end of the epoch.
  auto images = mpx::make_tensor<mpx::half>(exec, {n * pixels});
  auto labels = mpx::make_tensor<std::int32_t>(exec, {n});
  for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
    mpx::fill(exec, images, mpx_test::poison<mpx::half>());
    mpx::fill(exec, labels, std::int32_t{-1});
    loader.start_epoch(epoch);
    std::size_t at = 0;
    for (bool more = true; more;) {
      mpx_test::stream_hold<TestType> hold(exec);
      for (int k = 0; k < 2 && more; ++k) {
        auto b = loader.next();
        more = b.has_value();
        if (!more) break;
        auto const size = static_cast<std::int64_t>(b->size);
        mpx::copy(exec, b->images.reshape({size * pixels}), images.view().flat(at * pixels, b->size * pixels));
        mpx::copy(exec, b->labels, labels.view().flat(at, b->size));
        at += b->size;
      }
      if (hold.held()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }  // released here
    REQUIRE(at == static_cast<std::size_t>(n));
    std::vector<mpx::half> expected_images;
    std::vector<std::int32_t> expected_labels;
    for (std::size_t s : mpx::shuffled_order(n, 11, epoch)) {
      for (std::int64_t j = 0; j < pixels; ++j)
        expected_images.push_back(mpx::cast<mpx::half>(data.images[s * pixels + static_cast<std::size_t>(j)]));
      expected_labels.push_back(data.labels[s]);
    }
    INFO("epoch " << epoch);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, images), expected_images).empty());
    CHECK(mpx_test::download(exec, labels) == expected_labels);
  }
}

namespace {
//! The host's staging, failing the stage calls it is told to (as a broken GPU would).
template <class T>
struct failing_staging : mpx::detail::batch_staging<mpx::host_executor, T> {
  using mpx::detail::batch_staging<mpx::host_executor, T>::batch_staging;
  inline static std::set<int> fail_at;  // the stage calls (counted from 0) that throw
  inline static int calls = 0;
  void stage(std::span<std::size_t const> samples) {
    if (fail_at.contains(calls++)) throw mpx::cuda_error("cudaMemcpyAsync: an illegal memory access", 700);
    mpx::detail::batch_staging<mpx::host_executor, T>::stage(samples);
  }
};
}  // namespace

TEST_CASE("batches: a next() or start_epoch() whose staging fails loses no batch and repeats none",
          "[data][batches][errors]") {
  mpx::host_executor const exec;
  temp_dir dir("failing_stage");
  constexpr std::int64_t n = 23, side = 3;
  write_small_dataset(dir, n, side, side);
  auto const data = mpx::load_idx_dataset(dir / "images", dir / "labels");
  mpx::batch_options const options{.batch_size = 4, .seed = 5};
  // What each batch holds when nothing fails: its index, labels and images.
  using seen = std::tuple<std::size_t, std::vector<std::int32_t>, std::vector<float>>;
  auto const take_all = [&](auto& loader, std::uint64_t epoch, int& failures) {
    std::vector<seen> batches;
    try {
      loader.start_epoch(epoch);
    } catch (mpx::cuda_error const&) {
      ++failures;
    }
    for (;;) {
      try {
        auto b = loader.next();
        if (!b) break;
        batches.emplace_back(b->index, mpx_test::download(exec, b->labels), mpx_test::download(exec, b->images));
      } catch (mpx::cuda_error const&) {
        ++failures;
      }
    }
    return batches;
  };
  mpx::batch_loader<mpx::host_executor> reference(exec, data, options);
  int none = 0;
  auto const expected = take_all(reference, 3, none);
  REQUIRE(expected.size() == 6);
  for (int fail : {0, 1, 2, 5}) {  // start_epoch's stage, then next()'s, the last one included
    CAPTURE(fail);
    failing_staging<float>::fail_at = {fail};
    failing_staging<float>::calls = 0;
    mpx::batch_loader<mpx::host_executor, float, failing_staging<float>> loader(exec, data, options);
    int failures = 0;
    auto const got = take_all(loader, 3, failures);
    CHECK(failures == 1);
    CHECK(got == expected);
  }
  // Two failures in a row, on the same batch.
  failing_staging<float>::fail_at = {2, 3};
  failing_staging<float>::calls = 0;
  mpx::batch_loader<mpx::host_executor, float, failing_staging<float>> loader(exec, data, options);
  int failures = 0;
  CHECK(take_all(loader, 3, failures) == expected);
  CHECK(failures == 2);
}

TEMPLATE_LIST_TEST_CASE("tensor_batches: views of resident tensors, in order, the last batch short", "[data][batches]",
                        mpx_test::executors) {
  TestType exec;
  std::int64_t const n = 11;
  std::vector<float> xs(static_cast<std::size_t>(n * 6));
  std::iota(xs.begin(), xs.end(), 0.0f);
  std::vector<std::int32_t> ys(static_cast<std::size_t>(n));
  std::iota(ys.begin(), ys.end(), 100);
  auto const x = mpx_test::upload(exec, xs, {n, 2, 3});
  auto const y = mpx_test::upload(exec, ys, {n});
  mpx::tensor_batches source(x, y, 4);
  CHECK(source.size() == 11);
  CHECK(source.batches_per_epoch() == 3);
  for (std::size_t epoch = 0; epoch < 2; ++epoch) {
    source.start_epoch(epoch);
    std::size_t seen = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      auto const b = source.next();
      REQUIRE(b);
      std::size_t const expected = k < 2 ? 4 : 3;
      CHECK(b->index == k);
      CHECK(b->size == expected);
      CHECK(b->images.shape() == mpx::shape{static_cast<std::int64_t>(expected), 2, 3});
      CHECK(b->labels.shape() == mpx::shape{static_cast<std::int64_t>(expected)});
      auto const images = mpx_test::download(exec, b->images);
      auto const labels = mpx_test::download(exec, b->labels);
      for (std::size_t i = 0; i < images.size(); ++i) CHECK(images[i] == xs[seen * 6 + i]);
      for (std::size_t i = 0; i < labels.size(); ++i) CHECK(labels[i] == ys[seen + i]);
      seen += expected;
    }
    CHECK_FALSE(source.next());
    CHECK(seen == 11);
  }
  using space = mpx::memory_space_t<TestType>;
  CHECK_THROWS_TYPE_WITH(mpx::tensor_batches(x, y, 0), mpx::invalid_argument, Catch::Contains("batch_size must be positive"));
  auto const short_labels = mpx_test::upload(exec, std::vector<std::int32_t>(10), {10});
  CHECK_THROWS_TYPE_WITH(mpx::tensor_batches(x, short_labels, 4), mpx::shape_error,
                         Catch::Contains("samples of shape [11, 2, 3] and labels of shape [10]; expected [N, ...] and [N]"));
  // An empty data set has no batches.
  auto const none = mpx_test::upload(exec, std::vector<float>{}, {0, 2});
  auto const no_labels = mpx_test::upload(exec, std::vector<std::int32_t>{}, {0});
  mpx::tensor_batches<float, space> empty(none, no_labels, 4);
  CHECK(empty.batches_per_epoch() == 0);
  CHECK_FALSE(empty.next());
}

TEST_CASE("Fashion-MNIST: the installed test split, where present", "[data][fashion_mnist]") {
  CHECK(mpx::fashion_mnist_class_names.size() == 10);
  CHECK(mpx::fashion_mnist_class_names[0] == "T-shirt/top");
  CHECK(mpx::fashion_mnist_class_names[9] == "Ankle boot");
  fs::path const dir(mpx::fashion_mnist_default_directory);
  std::error_code ec;
  if (!fs::exists(dir / "t10k-images-idx3-ubyte.gz", ec) && !fs::exists(dir / "t10k-images-idx3-ubyte", ec)) {
    WARN("Fashion-MNIST is not installed in " << dir.string() << " (Debian: dataset-fashion-mnist); skipped");
    return;
  }
  if (!mpx::idx_gzip_available && !fs::exists(dir / "t10k-images-idx3-ubyte", ec)) {
    WARN("Fashion-MNIST is installed compressed and this build has no zlib; skipped");
    return;
  }
  auto const test = mpx::load_fashion_mnist(dir, mpx::dataset_split::test);
  REQUIRE(test.size() == 10000);
  CHECK(test.images.shape() == mpx::shape{10000, 28, 28, 1});
  std::array<int, 10> per_class{};
  for (std::int32_t label : test.labels) {
    REQUIRE((label >= 0 && label < 10));
    ++per_class[static_cast<std::size_t>(label)];
  }
  for (int c : per_class) CHECK(c == 1000);  // the test split is balanced
  auto const [lo, hi] = std::minmax_element(test.images.view().begin(), test.images.view().end());
  CHECK(*lo == 0.0f);
  CHECK(*hi == 1.0f);
  auto const stats = mpx::compute_pixel_statistics(test);
  CHECK((stats.mean > 0.25 && stats.mean < 0.32));  // about 0.286

  auto const first = mpx::load_fashion_mnist(dir, mpx::dataset_split::test, {.limit = 100});
  CHECK(first.size() == 100);
  CHECK(std::equal(first.labels.begin(), first.labels.end(), test.labels.begin()));
}
