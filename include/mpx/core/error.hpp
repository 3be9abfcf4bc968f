// The exceptions mpx throws. Each carries what failed, the values involved (shapes,
// the CUDA call) and where, so a report names the cause without a debugger.
#pragma once

#include <mpx/core/config.hpp>

#include <cstdio>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#define MPX_HAS_CUDA_RUNTIME 1
#else
#define MPX_HAS_CUDA_RUNTIME 0
#endif

namespace mpx {

//! Base of every exception mpx throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

//! Two tensors (or a tensor and a layer) whose shapes cannot work together.
class shape_error : public error {
 public:
  using error::error;
};

//! An argument outside what the operation accepts (a negative size, a zero scale).
class invalid_argument : public error {
 public:
  using error::error;
};

//! A data file (an IDX image or label file) that is missing, truncated or malformed,
//! or a data set whose parts do not fit together (image and label counts, label range).
class data_error : public error {
 public:
  using error::error;
};

//! A CUDA runtime or library call that failed; code() is the cudaError_t value.
class cuda_error : public error {
 public:
  cuda_error(std::string const& what, int code) : error(what), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace detail {

//! A number as a message shows it: 6 significant digits, exponent when needed
//! (1.17549e-38, not 0.000000; 3.40282e+38, not a 39-digit integer).
inline std::string to_text(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", x);
  return buffer;
}

inline std::string where(std::source_location loc) {
  return std::string(loc.file_name()) + ":" + std::to_string(loc.line());
}

//! Throws E with "mpx::<op>: <message> (at file:line)".
template <class E = error>
[[noreturn]] void fail(std::string_view op, std::string_view message,
                       std::source_location loc = std::source_location::current()) {
  throw E("mpx::" + std::string(op) + ": " + std::string(message) + " (at " + where(loc) + ")");
}

#if MPX_HAS_CUDA_RUNTIME
inline void check_cuda(cudaError_t status, char const* call, char const* file, int line) {
  if (status == cudaSuccess) return;
  // The runtime also records the error as the thread's last error; clear it, or the
  // next launch check would report this failure a second time, as its own.
  static_cast<void>(cudaGetLastError());
  throw cuda_error(std::string("mpx: CUDA call failed: ") + call + " returned " +
                       cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ") at " + file +
                       ":" + std::to_string(line),
                   static_cast<int>(status));
}
#endif

}  // namespace detail
}  // namespace mpx
