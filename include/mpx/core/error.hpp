// The exceptions mpx throws. Each carries what failed, the values involved (shapes,
// the CUDA call) and where, so a report names the cause without a debugger.
#pragma once

#include <mpx/core/config.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <version>
#if __has_include(<source_location>)
#include <source_location>
#endif

#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#define MPX_HAS_CUDA_RUNTIME 1
#else
#define MPX_HAS_CUDA_RUNTIME 0
#endif

namespace mpx {

#if defined(__cpp_lib_source_location) && __cpp_lib_source_location >= 201907L
using source_location = std::source_location;
#else
//! std::source_location where the standard library lacks it (libstdc++ 12 under clang
//! 14 and 15, which have no __builtin_source_location): file and line of the call, from
//! the builtins GCC and clang evaluate at the outermost call of a default argument.
class source_location {
 public:
  [[nodiscard]] static constexpr source_location current(char const* file = __builtin_FILE(),
                                                         std::uint_least32_t line = __builtin_LINE()) noexcept {
    source_location loc;
    loc.file_ = file;
    loc.line_ = line;
    return loc;
  }
  [[nodiscard]] constexpr char const* file_name() const noexcept { return file_; }
  [[nodiscard]] constexpr std::uint_least32_t line() const noexcept { return line_; }
  [[nodiscard]] constexpr std::uint_least32_t column() const noexcept { return 0; }
  [[nodiscard]] constexpr char const* function_name() const noexcept { return ""; }

 private:
  char const* file_ = "";
  std::uint_least32_t line_ = 0;
};
#endif

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

//! Memory the host or the GPU could not give. The message names what was being
//! allocated (a tensor's dtype and shape) and how many bytes; nothing was allocated, so
//! the caller may retry smaller.
class allocation_error : public error {
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

inline std::string where(source_location loc) {
  return std::string(loc.file_name()) + ":" + std::to_string(loc.line());
}

//! Throws E with "mpx::<op>: <message> (at file:line)"; an op already written as
//! "mpx::<op>" (a layer's display name, say) is not prefixed twice.
template <class E = error>
[[noreturn]] void fail(std::string_view op, std::string_view message,
                       source_location loc = source_location::current()) {
  std::string_view const prefix = op.substr(0, 5) == "mpx::" ? "" : "mpx::";
  throw E(std::string(prefix) + std::string(op) + ": " + std::string(message) + " (at " + where(loc) + ")");
}

// The wording of CUDA failures: plain strings, so the host suite checks them without
// a GPU or the CUDA headers.

//! Where the error a kernel launch check (MPX_CUDA_CHECK_LAUNCH) finds comes from. The
//! check reads cudaGetLastError(), which returns the latest error of *any* runtime call
//! of this thread, so the kernel just launched is not necessarily its cause.
enum class launch_failure {
  this_launch,   //!< the launch itself was refused: grid, block, shared memory, registers, no image, its stream
  earlier_call,  //!< an error no launch returns, left by an earlier runtime call whose status was not checked
  sticky_fault,  //!< the context is broken by an earlier asynchronous fault (an illegal address, a trap...)
};

//! The message of a failed launch check: names the kernel, CUDA's error, and which of
//! the three it is, so an earlier kernel's fault is not read as this kernel's.
inline std::string launch_failure_message(std::string_view kernel, launch_failure kind, std::string_view error_name,
                                          std::string_view error_text, std::string_view file, int line) {
  std::string const error = std::string(error_name) + " (" + std::string(error_text) + ")";
  std::string const at = " [checked at " + std::string(file) + ":" + std::to_string(line) + "]";
  std::string const k(kernel);
  switch (kind) {
    case launch_failure::this_launch:
      return "mpx: the launch of " + k + " was refused: " + error +
             ". This launch's own configuration or context is at fault (grid or block size, shared memory, "
             "registers, no kernel image for this GPU, the stream's state)" + at;
    case launch_failure::sticky_fault:
      return "mpx: CUDA reported " + error + " when " + k +
             " was launched, but this is a sticky error of an earlier asynchronous operation: a kernel or copy "
             "enqueued before " + k + " (on any stream of this device) faulted, not the launch of " + k +
             ". The CUDA context is unusable from here on. To find the operation that faulted, run with "
             "CUDA_LAUNCH_BLOCKING=1 or under compute-sanitizer" + at;
    case launch_failure::earlier_call:
    default:
      return "mpx: the launch check of " + k + " found " + error +
             ", an error that no kernel launch returns: an earlier CUDA runtime call on this thread failed and "
             "its status was not checked (cudaGetLastError reports the latest error of any call). The launch of " +
             k + " itself may have succeeded" + at;
  }
}

//! mpx's kernels need compute capability 8.0 or newer: bfloat16 arithmetic and
//! cuBLASLt's bfloat16 products start there.
inline constexpr int minimum_compute_capability = 80;

//! nvcc's architecture list ("800,860,900") as users write it ("sm_80, sm_86, sm_90").
inline std::string architecture_names(std::string_view built) {
  std::string out;
  while (!built.empty()) {
    std::size_t const comma = built.find(',');
    std::string_view const item = built.substr(0, comma);
    int const value = std::atoi(std::string(item).c_str());
    if (!out.empty()) out += ", ";
    out += "sm_" + std::to_string(value / 10);
    built = comma == std::string_view::npos ? std::string_view{} : built.substr(comma + 1);
  }
  return out;
}

//! What a launch that found no code for the GPU adds to its message: the device, what
//! the program holds, and what to do (rebuild for it, or a GPU mpx cannot use).
inline std::string missing_kernel_image_note(int device, std::string_view device_name, int major, int minor,
                                             std::string_view built) {
  int const capability = major * 10 + minor;
  std::string note = ". GPU " + std::to_string(device) + " (" + std::string(device_name) +
                     ") has compute capability " + std::to_string(major) + "." + std::to_string(minor);
  if (!built.empty()) note += "; this program was compiled for " + architecture_names(built);
  if (capability < minimum_compute_capability)
    return note + ". mpx needs compute capability 8.0 or newer (bfloat16 arithmetic, cuBLASLt's bfloat16 "
                  "products): this GPU cannot run it";
  return note + ". Rebuild for it: meson configure -Dgpu_architectures=native (or a list with " +
         std::to_string(capability) + "), or nvcc -gencode arch=compute_" + std::to_string(capability) +
         ",code=sm_" + std::to_string(capability);
}

//! `f()`, its failure said through `backend.report(what, why)` and never thrown: for
//! what runs in destructors and aborts, where a backend's call (which throws what failed)
//! must not end the program.
template <class Backend, class F>
void report_failure_of(Backend& backend, char const* what, F&& f) noexcept {
  try {
    f();
  } catch (std::exception const& e) {
    backend.report(what, e.what());
  } catch (...) {
    backend.report(what, "an exception of unknown type");
  }
}

#if MPX_HAS_CUDA_RUNTIME
//! For code that must not throw (destructors, deleters): says on stderr that `what`
//! failed when `status` is an error, and clears it from the thread's last error, so no
//! later launch check takes it for its own.
inline void report_if_failed(cudaError_t status, char const* what) noexcept {
  if (status == cudaSuccess) return;
  static_cast<void>(cudaGetLastError());
  std::fprintf(stderr, "mpx: %s failed: %s\n", what, cudaGetErrorString(status));
}

//! The kind of a launch check's error, from its code alone. A sticky error can also be
//! recognised at run time (it survives cudaGetLastError): check_launch does both, so a
//! code this list does not know yet is still classified right.
constexpr launch_failure classify_launch_error(cudaError_t status) noexcept {
  switch (status) {
    // A kernel faulted while running: every later call of the process reports it.
    case cudaErrorIllegalAddress:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorIllegalInstruction:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorExternalDevice:
      return launch_failure::sticky_fault;
    // What cudaLaunchKernel itself returns: the configuration, the kernel's image, the
    // stream it was given, or a device that cannot run anything.
    case cudaErrorInvalidConfiguration:
    case cudaErrorMissingConfiguration:
    case cudaErrorLaunchOutOfResources:
    case cudaErrorCooperativeLaunchTooLarge:
    case cudaErrorInvalidClusterSize:
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDeviceFunction:
    case cudaErrorInvalidKernelImage:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidPtx:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorJitCompilerNotFound:
    case cudaErrorJitCompilationDisabled:
    case cudaErrorSharedObjectSymbolNotFound:
    case cudaErrorSharedObjectInitFailed:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorStreamCaptureWrongThread:
    case cudaErrorLaunchMaxDepthExceeded:
    case cudaErrorLaunchPendingCountExceeded:
    case cudaErrorInitializationError:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStartupFailure:
    case cudaErrorDeviceUninitialized:
    case cudaErrorContextIsDestroyed:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return launch_failure::this_launch;
    default:
      return launch_failure::earlier_call;
  }
}

//! Whether `status` is one of the sticky errors that an asynchronous fault leaves (see
//! launch_failure::sticky_fault).
constexpr bool is_sticky_error(cudaError_t status) noexcept {
  return status != cudaSuccess && classify_launch_error(status) == launch_failure::sticky_fault;
}

inline void check_cuda(cudaError_t status, char const* call, char const* file, int line) {
  if (status == cudaSuccess) return;
  // The runtime also records the error as the thread's last error; clear it, or the
  // next launch check would report this failure a second time, as its own. (A sticky
  // error cannot be cleared: every later call reports it.)
  static_cast<void>(cudaGetLastError());
  throw cuda_error(std::string("mpx: CUDA call failed: ") + call + " returned " + cudaGetErrorName(status) + " (" +
                       cudaGetErrorString(status) + ") at " + file + ":" + std::to_string(line) +
                       (is_sticky_error(status)
                            ? std::string("; a sticky error: an earlier kernel or copy on this device faulted "
                                          "asynchronously, this call only reported it (CUDA_LAUNCH_BLOCKING=1 or "
                                          "compute-sanitizer names the operation)")
                            : std::string()),
                   static_cast<int>(status));
}

//! Whether a launch failed because the program holds no code this GPU can run.
constexpr bool is_missing_kernel_image(cudaError_t status) noexcept {
  return status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction ||
         status == cudaErrorInvalidKernelImage || status == cudaErrorUnsupportedPtxVersion;
}

//! The check after a kernel launch (MPX_CUDA_CHECK_LAUNCH): throws mpx::cuda_error whose
//! message says whether the launch was refused, an earlier call left the error, or an
//! earlier asynchronous fault broke the context (see launch_failure).
inline void check_launch(char const* kernel, char const* file, int line, char const* built_architectures = "") {
  cudaError_t const status = cudaGetLastError();
  if (status == cudaSuccess) return;
  // A sticky error is still there after cudaGetLastError: the context is broken.
  bool const still_set = cudaPeekAtLastError() != cudaSuccess;
  launch_failure const kind = still_set ? launch_failure::sticky_fault : classify_launch_error(status);
  std::string message =
      launch_failure_message(kernel, kind, cudaGetErrorName(status), cudaGetErrorString(status), file, line);
  int device = 0;
  cudaDeviceProp properties{};
  if (!still_set && is_missing_kernel_image(status) && cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&properties, device) == cudaSuccess)
    message += missing_kernel_image_note(device, properties.name, properties.major, properties.minor,
                                         built_architectures);
  throw cuda_error(message, static_cast<int>(status));
}
#endif

}  // namespace detail
}  // namespace mpx
