// The API fuzzer's elementwise group: being written.
#pragma once

#include "harness.hpp"

namespace mpx_fuzz::api {

inline void run_elementwise(draw&) {}

}  // namespace mpx_fuzz::api
