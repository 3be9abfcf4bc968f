// The host executor's threads (exec/host_threads.hpp): passes large enough to be shared
// among OpenMP's threads give the same bits as on one thread (elementwise, rows, the
// fused bias + activation, column reductions with their chunk order), counters and
// maxima folded from many threads lose nothing, and a forked child runs on one thread.
// Without OpenMP (the CUDA suite, -Dopenmp=disabled) only the one-thread answers apply.
#include "../support/testing.hpp"

#include <mpx/exec/host_threads.hpp>

#include <cstring>
#include <vector>

#if !MPX_HAS_CUDA
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace {

#if !MPX_HAS_CUDA
// Runs f with OpenMP limited to one thread (as -Dopenmp=disabled would), then restores.
template <class F>
void on_one_thread(F&& f) {
#if defined(_OPENMP)
  int const before = omp_get_max_threads();
  omp_set_num_threads(1);
  f();
  omp_set_num_threads(before);
#else
  f();
#endif
}

template <class T>
std::vector<std::uint32_t> bits_of(std::vector<T> const& v) {
  std::vector<std::uint32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<std::uint32_t>(mpx::bits(v[i]));
  return out;
}

struct count_odd_body {
  float const* x;
  unsigned* count;
  unsigned* largest;
  MPX_HD void operator()(std::size_t i) const {
    unsigned const v = static_cast<unsigned>(x[i] * 1000.0f + 5000.0f);
    if (v % 2) mpx::detail::add_to_count(count, 1u);
    mpx::detail::max_into(largest, v);
  }
};
#endif

}  // namespace

#if !MPX_HAS_CUDA
TEST_CASE("host threads: large passes are shared, small ones and forked children stay on one thread",
          "[host_threads]") {
  using mpx::detail::host_elements_per_thread;
  using mpx::detail::host_threads_for;
  CHECK(host_threads_for(100) == 1);
  CHECK(host_threads_for(2 * host_elements_per_thread - 1) == 1);
#if defined(_OPENMP)
  int const most = omp_get_max_threads();
  CHECK(host_threads_for(std::size_t{1} << 26) == std::min(most, 2048));
  // Each thread records its range; Catch's assertions run after the join.
  std::vector<std::size_t> begins(static_cast<std::size_t>(most), 1), ends(static_cast<std::size_t>(most), 0);
  int team = 0;
  mpx::detail::host_parallel_ranges(
      std::size_t{1} << 20, std::size_t{1} << 26,
      [&](std::size_t begin, std::size_t end) {
        std::size_t const t = static_cast<std::size_t>(omp_get_thread_num());
        begins[t] = begin;
        ends[t] = end;
        if (t == 0) team = omp_get_num_threads();
      },
      64);
  REQUIRE(team >= 1);
  std::size_t expected_begin = 0;
  for (std::size_t t = 0; t < static_cast<std::size_t>(team); ++t) {  // contiguous, aligned, covering
    CHECK(begins[t] == expected_begin);
    CHECK(begins[t] % 64 == 0);
    expected_begin = ends[t];
  }
  CHECK(expected_begin == (std::size_t{1} << 20));
  CHECK(team <= most);
  CHECK((team > 1 || most == 1 || omp_get_dynamic()));  // shared, where there are threads to share with
  // The parent's OpenMP threads exist now; a child that waited for them would hang (the
  // alarm ends it then), so its passes must run on its calling thread.
  pid_t const child = ::fork();
  if (child == 0) {
    ::alarm(60);
    std::size_t covered = 0;
    mpx::detail::host_parallel_ranges(std::size_t{1} << 20, std::size_t{1} << 26,
                                      [&](std::size_t begin, std::size_t end) { covered += end - begin; });
    _exit(host_threads_for(std::size_t{1} << 26) == 1 && covered == (std::size_t{1} << 20) ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
#else
  CHECK(host_threads_for(std::size_t{1} << 26) == 1);
#endif
}

TEST_CASE("host threads: an exception in one range reaches the caller", "[host_threads]") {
  // The last range: another thread's where the pass is shared.
  std::size_t const n = std::size_t{1} << 20;
  CHECK_THROWS_AS(mpx::detail::host_parallel_ranges(n, n << 6,
                                                    [&](std::size_t, std::size_t end) {
                                                      if (end == n) throw mpx::allocation_error("mpx: test scratch");
                                                    }),
                  mpx::allocation_error);
}

TEST_CASE("host threads: shared passes give the bits of one thread", "[host_threads]") {
  mpx::host_executor exec;
  std::size_t const rows = 3001, cols = 97;  // 291,097 elements: several threads' worth
  auto const x = mpx_test::upload(exec, mpx_test::random_values<float>(rows * cols, -3.0, 3.0, 11),
                                  mpx::shape{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)});
  auto const dy = mpx_test::upload(exec, mpx_test::random_values<float>(rows * cols, -1.0, 1.0, 12), x.shape());
  auto const bias = mpx_test::upload(exec, mpx_test::random_values<float>(cols, -0.5, 0.5, 13));
  struct outputs {
    std::vector<float> scaled, soft, act, dx, db, sums;
    std::vector<mpx::bfloat16> act16, cast16;
  };
  auto run = [&] {
    outputs o;
    auto y = mpx::make_tensor<float>(exec, x.shape());
    auto dx = mpx::make_tensor<float>(exec, x.shape());
    auto y16 = mpx::make_tensor<mpx::bfloat16>(exec, x.shape());
    auto db = mpx::make_tensor<float>(exec, bias.shape());
    auto sums = mpx::make_tensor<float>(exec, bias.shape());
    for (auto* t : {&y, &dx}) mpx::fill(exec, *t, mpx_test::poison<float>());
    mpx::fill(exec, y16, mpx_test::poison<mpx::bfloat16>());
    mpx::fill(exec, y, 1.0f);
    mpx::axpy(exec, 0.3f, x, y);
    o.scaled = mpx_test::download(exec, y);
    mpx::cast(exec, x, y16);
    o.cast16 = mpx_test::download(exec, y16);
    mpx::softmax(exec, x, y);
    o.soft = mpx_test::download(exec, y);
    mpx::bias_activation_forward(exec, mpx::act::gelu{}, x, bias, y16);
    o.act16 = mpx_test::download(exec, y16);
    mpx::fill(exec, y, mpx_test::poison<float>());  // an element no range wrote stays NaN
    mpx::bias_activation_forward(exec, mpx::act::gelu{}, x, bias, y);
    o.act = mpx_test::download(exec, y);
    mpx::bias_activation_backward(exec, mpx::act::gelu{}, x, bias, dy, dx, db);
    o.dx = mpx_test::download(exec, dx);
    o.db = mpx_test::download(exec, db);
    mpx::column_sum(exec, dy, sums);
    o.sums = mpx_test::download(exec, sums);
    return o;
  };
  outputs const shared = run();
  outputs one;
  on_one_thread([&] { one = run(); });
  CHECK(bits_of(shared.scaled) == bits_of(one.scaled));
  CHECK(bits_of(shared.cast16) == bits_of(one.cast16));
  CHECK(bits_of(shared.soft) == bits_of(one.soft));
  CHECK(bits_of(shared.act) == bits_of(one.act));
  CHECK(bits_of(shared.act16) == bits_of(one.act16));
  CHECK(bits_of(shared.dx) == bits_of(one.dx));
  CHECK(bits_of(shared.db) == bits_of(one.db));
  CHECK(bits_of(shared.sums) == bits_of(one.sums));
  for (float v : shared.act) REQUIRE(!std::isnan(v));  // every element written
}

TEST_CASE("host threads: counts and maxima folded from many threads lose nothing", "[host_threads]") {
  mpx::host_executor exec;
  std::vector<float> const values = mpx_test::random_values<float>(400'003, -4.0, 4.0, 21);
  unsigned expected_count = 0, expected_max = 0;
  for (float v : values) {
    unsigned const u = static_cast<unsigned>(v * 1000.0f + 5000.0f);
    expected_count += u % 2;
    expected_max = std::max(expected_max, u);
  }
  unsigned count = 0, largest = 0;
  mpx::for_each_index(exec, values.size(), count_odd_body{values.data(), &count, &largest});
  CHECK(count == expected_count);
  CHECK(largest == expected_max);
}
#endif
