// The libFuzzer harness of every mpx file reader (fuzz/targets.hpp): one binary, the
// reader chosen by MPX_FUZZ_READER (idx, checkpoint, model, ...) so that building the
// fuzzers costs one compile of the headers, not one per reader. fuzz/run.sh builds and
// runs it; MPX_FUZZ_READER=list prints the readers.
#include "fuzz/targets.hpp"

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace {
std::string_view reader;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char const* chosen = std::getenv("MPX_FUZZ_READER");
  std::string_view const name = chosen ? chosen : "";
  for (auto r : mpx_fuzz::readers) {
    if (name == "list") std::printf("%.*s\n", static_cast<int>(r.size()), r.data());
    if (name == r) reader = r;
  }
  if (name == "list") std::exit(0);
  if (reader.empty()) {
    std::fprintf(stderr, "fuzz_reader: set MPX_FUZZ_READER to one of the readers (MPX_FUZZ_READER=list names them)\n");
    std::exit(2);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  mpx_fuzz::read_input(reader, {data, size});
  return 0;
}
