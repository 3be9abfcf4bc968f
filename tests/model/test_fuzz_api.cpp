// The API fuzzer's stored inputs, replayed in the host suite (and under ASan and UBSan in
// CI): every file of fuzz/corpus/api_<group>/ and fuzz/regressions/api_<group>/ goes
// through its group again (fuzz/api/), without a fuzzer build. A call must refuse with
// an mpx::error naming what is wrong or match its float64 reference; a finding, a crash
// or a sanitizer report fails here. Host only: the groups call the host executor.
#include "../support/testing.hpp"

#include "../../fuzz/api/groups.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

//! The repository's fuzz/ folder, found upwards from the working directory.
fs::path api_fuzz_folder() {
  for (fs::path p = fs::current_path(); !p.empty(); p = p.parent_path()) {
    if (fs::exists(p / "fuzz" / "api" / "groups.hpp")) return p / "fuzz";
    if (p == p.parent_path()) break;
  }
  return {};
}

std::vector<std::uint8_t> file_bytes(fs::path const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("API fuzzer corpora and reproducers: every stored call refuses cleanly or matches its reference",
          "[fuzz][errors]") {
  fs::path const fuzz = api_fuzz_folder();
  INFO("working directory " << fs::current_path().string());
  REQUIRE(!fuzz.empty());
  for (auto const& group : mpx_fuzz::api::groups) {
    std::size_t seeds = 0;
    for (char const* kind : {"corpus", "regressions"}) {
      fs::path const dir = fuzz / kind / ("api_" + std::string(group.name));
      if (!fs::exists(dir)) continue;
      for (auto const& entry : fs::directory_iterator(dir)) {
        INFO(entry.path().string());
        std::vector<std::uint8_t> const bytes = file_bytes(entry.path());
        CHECK_NOTHROW(mpx_fuzz::api::run_input(group, bytes));
        seeds += std::string_view(kind) == "corpus";
      }
    }
    INFO("group " << group.name);
    CHECK(seeds >= 20);  // the stored corpus is there
  }
}

TEST_CASE("API fuzzer: a finding is not an mpx::error, so nothing in mpx can swallow it", "[fuzz]") {
  STATIC_REQUIRE(!std::is_base_of_v<mpx::error, mpx_fuzz::api::finding>);
  mpx::host_executor exec;
  mpx_fuzz::api::guarded<float> g(exec, {3}, 2);
  g.data()[-1] = 1.0f;  // a write before the view
  CHECK_THROWS_AS(g.require_guards_intact(mpx_fuzz::api::call_name("test"), "x"), mpx_fuzz::api::finding);
  mpx_fuzz::api::call_name const call("test");
  CHECK_THROWS_AS(mpx_fuzz::api::require_near(call, "y", 0, std::nan(""), 1.0, 1.0), mpx_fuzz::api::finding);
  CHECK_THROWS_AS(mpx_fuzz::api::require_near(call, "y", 0, 1.0, std::nan(""), 1.0), mpx_fuzz::api::finding);
  CHECK_THROWS_AS(mpx_fuzz::api::require_near(call, "y", 0, 1.5, 1.0, 0.25), mpx_fuzz::api::finding);
  CHECK_NOTHROW(mpx_fuzz::api::require_near(call, "y", 0, 1.2, 1.0, 0.25));
  CHECK_THROWS_AS(mpx_fuzz::api::require_refusal(call, {"x"}, [] {}), mpx_fuzz::api::finding);
  CHECK_THROWS_AS(mpx_fuzz::api::require_refusal(call, {"the bias"}, [] { throw mpx::invalid_argument("op: the kernel is wrong"); }),
                  mpx_fuzz::api::finding);
  CHECK_NOTHROW(mpx_fuzz::api::require_refusal(call, {"the bias"}, [] { throw mpx::invalid_argument("op: the bias is wrong"); }));
}
