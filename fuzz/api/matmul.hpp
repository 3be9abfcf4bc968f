// The API fuzzer's matmul group: being written.
#pragma once

#include "harness.hpp"

namespace mpx_fuzz::api {

inline void run_matmul(draw&) {}

}  // namespace mpx_fuzz::api
