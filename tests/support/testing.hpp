// Test support shared by every test file: the executor list a test case runs over
// (host everywhere; CUDA too in the nvcc-built suite), moving data between a host
// vector and an executor's space, seeded random inputs, poisoning, first-mismatch
// reporting, and scratch directories.
#pragma once

#include <mpx/mpx.hpp>

#include "poison.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

//! Checks that `expr` throws `type` and that the message matches `matcher` (Catch2 v2
//! checks the type and the message in separate macros; this runs the expression twice).
#define CHECK_THROWS_TYPE_WITH(expr, type, matcher) \
  do {                                              \
    CHECK_THROWS_AS(expr, type);                    \
    CHECK_THROWS_WITH(expr, matcher);               \
  } while (false)

//! 1 in a build with AddressSanitizer, which ends the process on an allocation it cannot
//! serve (it does not throw std::bad_alloc) and makes 2^31-element loops too slow and too
//! big: the cases that need either skip themselves there.
#if defined(__SANITIZE_ADDRESS__)
#define MPX_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MPX_TEST_UNDER_ASAN 1
#endif
#endif
#ifndef MPX_TEST_UNDER_ASAN
#define MPX_TEST_UNDER_ASAN 0
#endif

namespace mpx_test {

//! The message of the `Error` that `f()` throws ("" and a failed check when it throws
//! none, or another type). Calls f once: a call that fails may change what it called.
template <class Error, class F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (Error const& e) {
    return e.what();
  } catch (...) {
    FAIL_CHECK("another exception type");
    return "";
  }
  FAIL_CHECK("nothing thrown");
  return "";
}

//! Whether `condition()` comes true within `limit`, asked every millisecond: for what
//! another thread (a watchdog) makes true.
template <class Condition>
bool eventually(Condition&& condition, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  auto const until = std::chrono::steady_clock::now() + limit;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

#if MPX_HAS_CUDA
// The nvcc-built suite runs every case on the GPU; the host suite covers the host.
using executors = std::tuple<mpx::cuda_executor>;
#else
using executors = std::tuple<mpx::host_executor>;
#endif

// The dtype lists the cases run over, filtered from mpx::dtype_list, so a dtype added
// there reaches every case that its width admits without editing a test.
namespace detail {
template <template <class> class Keep, class List>
struct dtypes_where;
template <template <class> class Keep>
struct dtypes_where<Keep, mpx::type_list<>> {
  using type = std::tuple<>;
};
template <template <class> class Keep, class T, class... Rest>
struct dtypes_where<Keep, mpx::type_list<T, Rest...>> {
  using rest = typename dtypes_where<Keep, mpx::type_list<Rest...>>::type;
  using type = std::conditional_t<Keep<T>::value,
                                  decltype(std::tuple_cat(std::declval<std::tuple<T>>(), std::declval<rest>())), rest>;
};
template <class T>
struct is_storage_dtype : std::bool_constant<!mpx::dtype8<T>> {};
template <class T>
struct is_dtype16 : std::bool_constant<mpx::dtype16<T>> {};
template <class T>
struct is_dtype8 : std::bool_constant<mpx::dtype8<T>> {};
}  // namespace detail

//! The dtypes of mpx::dtype_list that Keep<T>::value admits, in its order, as a
//! std::tuple (a Catch2 TEMPLATE_LIST_TEST_CASE list).
template <template <class> class Keep>
using dtypes_where = typename detail::dtypes_where<Keep, mpx::dtype_list>::type;
//! The 16- and 32-bit dtypes, those tensors store activations in (half, bfloat16, float).
using dtypes = dtypes_where<detail::is_storage_dtype>;
//! The 16-bit dtypes (half, bfloat16).
using dtypes16 = dtypes_where<detail::is_dtype16>;
//! The fp8 dtypes (float8_e4m3, float8_e5m2).
using dtypes8 = dtypes_where<detail::is_dtype8>;

//! Calls f(T{}) for every T of the tuple List: a case body written once per dtype.
template <class List, class F>
void for_each_dtype_in(F&& f) {
  [&]<class... Ts>(std::type_identity<std::tuple<Ts...>>) { (f(Ts{}), ...); }(std::type_identity<List>{});
}
//! Calls f(T{}) for T = half, bfloat16, float (mpx_test::dtypes).
template <class F>
void for_each_dtype(F&& f) {
  for_each_dtype_in<dtypes>(f);
}

//! The seed every random input derives from; fixed, so a failure reproduces.
inline constexpr std::uint64_t seed = 20261122;

//! Sizes that exercise vector heads, bodies and tails: empty, tiny, primes, just
//! around powers of two, and big enough for many blocks.
inline std::vector<std::size_t> awkward_sizes() {
  return {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 127, 255, 256, 257, 1000, 1021, 4099, 65537, 300007};
}

//! A device or host tensor with the contents of `values`.
template <class Exec, class T>
mpx::tensor<T, mpx::memory_space_t<Exec>> upload(Exec const& exec, std::vector<T> const& values,
                                                  mpx::shape shape) {
  auto t = mpx::make_tensor<T>(exec, shape);
  mpx::tensor_view<T const, mpx::host_space> src(values.data(), shape);
  mpx::copy(exec, src, t);
  return t;
}
template <class Exec, class T>
mpx::tensor<T, mpx::memory_space_t<Exec>> upload(Exec const& exec, std::vector<T> const& values) {
  return upload(exec, values, mpx::shape{static_cast<std::int64_t>(values.size())});
}

//! The contents of x as a host vector (synchronises).
template <class Exec, class X>
auto download(Exec const& exec, X&& x) {
  auto host = mpx::to_host(exec, x);
  return std::vector<mpx::value_t<X>>(host.begin(), host.end());
}


//! The allowed error of a float-summed product per unit of the sum of its terms'
//! magnitudes, for K terms, on the executor that sums: the host adds exact products in
//! float ((K + 4) 2^-24); Hopper's fp8 tensor cores add the products within each K-chunk
//! of an instruction with about 14 bits (DeepSeek-V3's measurement) before cuBLASLt
//! promotes the partial sum to float. Shared by the fp8 kernel and layer tests.
template <class Exec>
double fp8_sum_bound(std::int64_t k) {
  if constexpr (mpx::is_host_executor_v<Exec>) return static_cast<double>(k + 4) * std::ldexp(1.0, -24);
  else
    return static_cast<double>(k + 4) * std::ldexp(1.0, -23) +
           static_cast<double>(std::min<std::int64_t>(k, 128)) * std::ldexp(1.0, -14);
}

//! Whether this executor runs block-scaled fp8 products (mpx::fp8_block_gemm): the host
//! always; a GPU, for rowwise, 1x128 and 128x128 blocks only on Hopper (sm_90), and for
//! MXFP8's 1x32 blocks (`mx`) on Blackwell (sm_100) and newer, where cuBLASLt offers
//! those scale modes. Shared by the kernel and layer tests.
template <class Exec>
bool block_fp8_products_here([[maybe_unused]] Exec const& exec, [[maybe_unused]] bool mx = false) {
#if MPX_HAS_CUDA
  if constexpr (!mpx::is_host_executor_v<Exec>) {
    int device = 0, major = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return mx ? major >= 10 : major == 9;
  }
#endif
  return true;
}

//! A tensor of `shape` in the executor's space with every element poisoned.
template <class T, class Exec>
mpx::tensor<T, mpx::memory_space_t<Exec>> poisoned(Exec const& exec, mpx::shape shape) {
  auto t = mpx::make_tensor<T>(exec, shape);
  mpx::fill(exec, t, poison<T>());
  return t;
}

//! The values of v in float64, the dtype every reference computes in.
template <class T>
std::vector<double> widen(std::vector<T> const& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::detail::to_double(v[i]);
  return out;
}

//! The Keras-named preset whose storage dtype is T: float32, mixed_float16 or
//! mixed_bfloat16.
template <class T>
using preset_policy = std::conditional_t<std::is_same_v<T, mpx::half>, mpx::mixed_float16,
                                         std::conditional_t<std::is_same_v<T, mpx::bfloat16>,
                                                            mpx::mixed_bfloat16, mpx::float32>>;

//! Uniform values in [lo, hi), rounded to T, from a seeded generator.
template <class T>
std::vector<T> random_values(std::size_t n, double lo, double hi, std::uint64_t stream = 0) {
  std::mt19937_64 gen(seed + stream);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<T> out(n);
  for (auto& v : out) v = mpx::cast<T>(dist(gen));
  return out;
}

//! Bitwise equality, with every NaN equal to every NaN (NaN payloads are not part of
//! the contract) but never to a number.
template <class T>
bool same_value(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return a == b;
  } else {
    if (mpx::is_nan(a) || mpx::is_nan(b)) return mpx::is_nan(a) && mpx::is_nan(b);
    return mpx::bits(a) == mpx::bits(b);
  }
}

template <class T>
std::string describe(T x) {
  std::ostringstream os;
  if constexpr (std::is_integral_v<T>)
    os << +x;
  else
    os << mpx::detail::to_double(x) << " (bits 0x" << std::hex << static_cast<std::uint64_t>(mpx::bits(x)) << ")";
  return os.str();
}

//! Empty when got == expected element for element (same_value), else a description of
//! the first mismatch and how many there are.
template <class T>
std::string first_mismatch(std::vector<T> const& got, std::vector<T> const& expected) {
  if (got.size() != expected.size())
    return "sizes differ: " + std::to_string(got.size()) + " vs " + std::to_string(expected.size());
  std::size_t count = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same_value(got[i], expected[i]) && count++ == 0) first = i;
  if (!count) return {};
  return std::to_string(count) + " mismatches; first at index " + std::to_string(first) + ": got " +
         describe(got[first]) + ", expected " + describe(expected[first]);
}

//! A fresh directory for one test case, removed afterwards (also when a check fails).
//! The host and CUDA suites may run at once: the name holds the tag and the process id.
struct scratch_dir {
  std::filesystem::path path;
  explicit scratch_dir(std::string const& tag)
      : path(std::filesystem::temp_directory_path() / ("mpx_test_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  scratch_dir(scratch_dir const&) = delete;
  scratch_dir& operator=(scratch_dir const&) = delete;
  [[nodiscard]] std::filesystem::path operator/(std::string const& name) const { return path / name; }
};

//! Holds back everything enqueued on the executor's stream until released (or destroyed):
//! a host function at the head of the stream waits for a flag, so a test can enqueue work
//! behind it and show that what must wait for that work does. The host executor runs
//! each call at once, so there the hold does nothing. While held, nothing may wait for
//! the stream.
template <class Exec>
class stream_hold {
 public:
  explicit stream_hold([[maybe_unused]] Exec const& exec) {
#if MPX_HAS_CUDA
    if constexpr (!mpx::is_host_executor_v<Exec>) {
      MPX_CUDA_CHECK(cudaLaunchHostFunc(exec.stream(), &stream_hold::wait, &open_));
      stream_ = exec.stream();
      held_ = true;
    }
#endif
  }
  ~stream_hold() {
    release();
#if MPX_HAS_CUDA
    // The waiting function reads open_: let it return before the flag goes.
    if (held_) static_cast<void>(cudaStreamSynchronize(stream_));
#endif
  }
  stream_hold(stream_hold const&) = delete;
  stream_hold& operator=(stream_hold const&) = delete;
  void release() { open_.store(true); }
  [[nodiscard]] bool held() const { return held_; }

 private:
  static void wait(void* flag) {
    auto const* open = static_cast<std::atomic<bool> const*>(flag);
    while (!open->load()) std::this_thread::yield();
  }
  std::atomic<bool> open_{false};
  bool held_ = false;
#if MPX_HAS_CUDA
  cudaStream_t stream_ = nullptr;
#endif
};


}  // namespace mpx_test
