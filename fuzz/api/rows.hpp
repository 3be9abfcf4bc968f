// The API fuzzer's rows group: being written.
#pragma once

#include "harness.hpp"

namespace mpx_fuzz::api {

inline void run_rows(draw&) {}

}  // namespace mpx_fuzz::api
