// The API fuzzer's optim group: being written.
#pragma once

#include "harness.hpp"

namespace mpx_fuzz::api {

inline void run_optim(draw&) {}

}  // namespace mpx_fuzz::api
