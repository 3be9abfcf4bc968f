// The host executor's threads: a pass over independent items (elements, rows, a column
// reduction's chunks) is cut into one contiguous range per thread and run on OpenMP's
// threads, the ones oneDNN's products already use, when the program is compiled with
// -fopenmp (mpx's own build is, where the compiler has it); otherwise, and for small
// passes, on the calling thread. No result depends on the cut: items are independent,
// and a reduction adds its per-range results in range order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>

#if __has_include(<unistd.h>)
#include <unistd.h>
#define MPX_HAS_GETPID 1
#else
#define MPX_HAS_GETPID 0
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace mpx::detail {

#if MPX_HAS_GETPID
//! The process this program started as, read when it loads (0 until then: another
//! static initializer that runs mpx first is not taken for a forked child).
inline pid_t const host_process_id = ::getpid();

//! Whether this is a process forked from the one the program started as. OpenMP's
//! threads (mpx's passes', oneDNN's) do not survive fork(): a child that used them
//! would wait for them forever, so a forked child runs everything on its calling thread.
inline bool in_forked_child() noexcept { return host_process_id != 0 && ::getpid() != host_process_id; }
#else
inline bool in_forked_child() noexcept { return false; }
#endif

// Why a floor: waking a second thread and joining it costs a few microseconds, as much as
// a pass over about 2^15 floats; below twice that a pass stays on the calling thread.
inline constexpr std::size_t host_elements_per_thread = std::size_t{1} << 15;

//! How many threads a pass over `elements` elements gets: 1 without OpenMP, inside
//! another parallel region, in a process forked from the one that started OpenMP's
//! threads (they do not survive fork()), or for a small pass.
inline int host_threads_for(std::size_t elements) noexcept {
#if defined(_OPENMP)
  if (elements < 2 * host_elements_per_thread || omp_in_parallel() || in_forked_child()) return 1;
  std::size_t const most = static_cast<std::size_t>(std::max(1, omp_get_max_threads()));
  return static_cast<int>(std::min(most, elements / host_elements_per_thread));
#else
  (void)elements;
  return 1;
#endif
}

//! f(begin, end) over [0, n) cut into contiguous ranges, one per thread, each range's
//! begin a multiple of `align` (so vector loops start aligned); `elements` is the pass's
//! size (n for an elementwise pass, rows x cols for rows). f must write only its own
//! range's items. An exception from f (a scratch allocation that failed) cannot leave an
//! OpenMP thread: the first is caught and rethrown on the calling thread after the join.
template <class F>
void host_parallel_ranges(std::size_t n, std::size_t elements, F const& f, std::size_t align = 1) {
  if (n == 0) return;
  int const threads = n > align ? host_threads_for(elements) : 1;
#if defined(_OPENMP)
  if (threads > 1) {
    std::exception_ptr failure;
#pragma omp parallel num_threads(threads)
    {
      std::size_t const t = static_cast<std::size_t>(omp_get_thread_num());
      std::size_t const count = static_cast<std::size_t>(omp_get_num_threads());
      std::size_t const begin = t == 0 ? 0 : n * t / count / align * align;
      std::size_t const end = t + 1 == count ? n : n * (t + 1) / count / align * align;
      try {
        if (begin < end) f(begin, end);
      } catch (...) {
#pragma omp critical(mpx_host_parallel_failure)
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
#else
  (void)threads;
#endif
  f(std::size_t{0}, n);
}

}  // namespace mpx::detail
