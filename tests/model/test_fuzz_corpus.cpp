// Every stored fuzzer input goes through its reader again in the host suite: the seed
// corpora (fuzz/corpus/<reader>/) and the reproducers of past findings and hostile
// files from issue 21 (fuzz/regressions/<reader>/). Each must load or be refused with
// a clean mpx::error; a crash, a sanitizer report (the suite runs under ASan/UBSan in
// CI) or another exception fails here, without a fuzzer build.
#include "../support/testing.hpp"

#include "../../fuzz/targets.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

//! The repository's fuzz/ folder, found upwards from the working directory (meson test
//! runs the suite in the build directory, inside or beside the checkout).
fs::path fuzz_folder() {
  for (fs::path p = fs::current_path(); !p.empty(); p = p.parent_path()) {
    if (fs::exists(p / "fuzz" / "targets.hpp")) return p / "fuzz";
    if (p == p.parent_path()) break;
  }
  return {};
}

}  // namespace

TEST_CASE("fuzz corpora and reproducers: every stored input is read or refused with an mpx::error", "[fuzz][errors]") {
  fs::path const fuzz = fuzz_folder();
  INFO("working directory " << fs::current_path().string());
  REQUIRE(!fuzz.empty());
  for (auto reader : mpx_fuzz::readers) {
    std::size_t seeds = 0;
    for (char const* kind : {"corpus", "regressions"}) {
      fs::path const dir = fuzz / kind / reader;
      if (!fs::exists(dir)) continue;
      for (auto const& entry : fs::directory_iterator(dir)) {
        std::ifstream in(entry.path(), std::ios::binary);
        std::vector<std::uint8_t> const bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
        INFO(entry.path().string());
        CHECK_NOTHROW(mpx_fuzz::read_input(reader, bytes));
        seeds += std::string_view(kind) == "corpus";
      }
    }
    INFO(reader);
    CHECK(seeds >= 3);  // the stored corpus is there
  }
}
