// The API fuzzer's sequence group: being written.
#pragma once

#include "harness.hpp"

namespace mpx_fuzz::api {

inline void run_sequence(draw&) {}

}  // namespace mpx_fuzz::api
