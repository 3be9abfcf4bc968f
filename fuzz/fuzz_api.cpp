// The libFuzzer harness of the API fuzzer (fuzz/api/): one binary, the group chosen by
// MPX_FUZZ_API (elementwise, matmul, ...), as fuzz_reader.cpp chooses its reader.
// fuzz/run.sh builds and runs it; MPX_FUZZ_API=list prints the groups.
#include "api/groups.hpp"

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace {
mpx_fuzz::api::group const* chosen = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char const* name = std::getenv("MPX_FUZZ_API");
  std::string_view const n = name ? name : "";
  if (n == "list") {
    for (auto const& g : mpx_fuzz::api::groups) std::printf("%.*s\n", static_cast<int>(g.name.size()), g.name.data());
    std::exit(0);
  }
  chosen = mpx_fuzz::api::find_group(n);
  if (!chosen) {
    std::fprintf(stderr, "fuzz_api: set MPX_FUZZ_API to one of the groups (MPX_FUZZ_API=list names them)\n");
    std::exit(2);
  }
  return 0;
}

// A finding is thrown (mpx_fuzz::api::finding); left uncaught, it ends in std::terminate,
// which prints its message, and libFuzzer keeps the input as a crash.
extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  mpx_fuzz::api::run_input(*chosen, {data, size});
  return 0;
}
