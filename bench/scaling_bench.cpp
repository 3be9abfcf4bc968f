// Microbenchmark of loss scaling's two passes over a model's gradients: the fused
// unscale_and_check over a list of K tensors of uneven sizes (in place, and deferred:
// read only), and the fused Adam step with float master weights that reads its verdict
// on the executor. Each row is reported in GB/s beside a copy measured in the same run
// (memcpy on the host, a device-to-device cudaMemcpyAsync on the GPU): every op is
// memory-bound and moves each of its bytes once, so the copy is its ceiling.
//
//   scaling_bench [--elements N] [--tensors K[,K...]] [--repeat R]
//                 [--executor host|cuda|all] [--packed]
//
// --packed carves the list out of one buffer back to back (a flat gradient buffer), so
// most tensors start misaligned for 16-byte accesses. Build with nvcc (scaling_bench.cu)
// for the CUDA rows; bench/NOTES.md has the byte counts, predictions and results.
#include <mpx/mpx.hpp>

#include "executors.hpp"
#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace {

using mpx_bench::median_seconds;

struct options {
  std::size_t elements = std::size_t{1} << 26;
  std::vector<std::size_t> tensors = {200};
  int repeat = 10;
  std::string executor = "all";
  bool packed = false;
};

//! A run whose result would be meaningless (a skipped step, an update that changed
//! nothing): the benchmark stops rather than print a number for it.
struct bench_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- the gradient list -------------------------------------------------------------

//! splitmix64: a seeded stream of uniform floats, fast enough for 2^26 values.
struct random_stream {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  //! Uniform in [lo, hi).
  float uniform(float lo, float hi) noexcept {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * 0x1.0p-24f;
  }
};

//! K sizes summing to `total`: each 0.25 to 1.75 times the mean, drawn from `seed`.
//! The cuts between tensors fall on multiples of 8 (whole 16-byte vectors of a 16-bit
//! type) but every fourth, moved 1 to 7 elements on, so the two tensors beside it (about
//! half of all) end in a partial vector and every kernel's tail path runs.
//! (bench/torch_compare.py draws the same sizes.)
std::vector<std::size_t> uneven_sizes(std::size_t total, std::size_t count, std::uint64_t seed) {
  if (count == 0 || count > total)
    throw bench_failure("--tensors " + std::to_string(count) + " must lie in [1, --elements " + std::to_string(total) +
                        "]");
  random_stream rng{seed};
  std::vector<double> weight(count);
  double sum = 0;
  for (auto& w : weight) sum += (w = rng.uniform(0.25f, 1.75f));
  std::vector<std::size_t> sizes(count);
  std::size_t end = 0;  // where the previous tensor ended, in the list's concatenation
  double cumulative = 0;
  for (std::size_t i = 0; i + 1 < count; ++i) {
    cumulative += weight[i];
    auto cut = static_cast<std::size_t>(static_cast<double>(total) * cumulative / sum) / 8 * 8;
    if (i % 4 == 3) cut += 1 + rng.next() % 7;
    // Every tensor holds at least one element, and leaves one for each one after it.
    cut = std::clamp(cut, end + 1, total - (count - 1 - i));
    sizes[i] = cut - end;
    end = cut;
  }
  sizes[count - 1] = total - end;
  return sizes;
}

//! K tensors of T with the given sizes: separate allocations (each aligned, as a
//! framework's allocator hands them out), or views into one buffer when packed.
template <class T, class Space>
struct tensor_list {
  std::vector<mpx::tensor<T, Space>> owned;
  mpx::tensor<T, Space> flat;
  std::vector<mpx::tensor_view<T, Space>> views;
};

template <class T, class Exec>
tensor_list<T, mpx::memory_space_t<Exec>> make_list(Exec const& exec, std::vector<std::size_t> const& sizes,
                                                     bool packed) {
  tensor_list<T, mpx::memory_space_t<Exec>> list;
  auto extent = [](std::size_t n) { return mpx::shape{static_cast<std::int64_t>(n)}; };
  if (packed) {
    std::size_t total = 0;
    for (auto n : sizes) total += n;
    list.flat = mpx::make_tensor<T>(exec, extent(total));
    std::size_t offset = 0;
    for (auto n : sizes) {
      list.views.emplace_back(list.flat.data() + offset, extent(n));
      offset += n;
    }
  } else {
    list.owned.reserve(sizes.size());
    for (auto n : sizes) {
      list.owned.push_back(mpx::make_tensor<T>(exec, extent(n)));
      list.views.push_back(list.owned.back().view());
    }
  }
  return list;
}

//! Fills every tensor with uniform values in [lo, hi), staged on the host.
template <class T, class Exec, class Space>
void fill_uniform(Exec const& exec, tensor_list<T, Space> const& list, std::uint64_t seed, float lo, float hi) {
  random_stream rng{seed};
  std::vector<T> staging;
  for (auto const& v : list.views) {
    staging.resize(v.size());
    for (auto& x : staging) x = mpx::cast<T>(rng.uniform(lo, hi));
    mpx::copy(exec, mpx::tensor_view<T const, mpx::host_space>(staging.data(), v.shape()), v);
  }
  exec.synchronize();
}

// ---- checks that the measured work was the work meant ------------------------------

//! The verdict must say "apply": a skipped step moves no bytes worth reporting.
template <class Exec>
void require_finite_verdict(Exec const& exec, mpx::gradient_list<Exec> const& gradients, std::string_view op) {
  auto const s = gradients.summary(exec);
  if (s.found_nonfinite != 0 || !std::isfinite(s.norm) || !(s.norm > 0))
    throw bench_failure(std::string(op) + ": the check's verdict was found_nonfinite = " +
                        std::to_string(s.found_nonfinite) + " (first: " +
                        (s.first_nonfinite >= 0 ? gradients.name(static_cast<std::size_t>(s.first_nonfinite))
                                                : std::string("none")) +
                        "), norm = " + std::to_string(s.norm) +
                        "; a skipped or empty step measures nothing, so no row is printed");
}

// ---- the table ---------------------------------------------------------------------

void print_header() {
  std::printf("%-6s %-26s %-9s %7s %11s %6s %10s %9s %9s\n", "exec", "op", "dtype", "tensors", "elements", "B/elem",
              "ms", "GB/s", "of copy");
}

struct row {
  std::string_view exec, op, dtype;
  std::size_t tensors, elements;
  double bytes_per_element, seconds;
};

void print_row(row const& r, double copy_gbps) {
  double const gbps = r.bytes_per_element * static_cast<double>(r.elements) / r.seconds / 1e9;
  std::printf("%-6s %-26s %-9s %7zu %11zu %6.0f %10.4f %9.1f %8.1f%%\n", std::string(r.exec).c_str(),
              std::string(r.op).c_str(), std::string(r.dtype).c_str(), r.tensors, r.elements, r.bytes_per_element,
              r.seconds * 1e3, gbps, 100.0 * gbps / copy_gbps);
  std::fflush(stdout);
}

//! Bytes the optimizer kernel (optim/optimizer.hpp, update_elements) moves per element
//! of Adam: 16-bit T reads the gradient (T), master, m and v (float) and writes master,
//! m, v and the value (T); float reads the value (its own master), gradient, m and v and
//! writes value, m and v. Both come to 28.
template <class T>
constexpr double adam_bytes_per_element() {
  if constexpr (std::is_same_v<T, float>) return 4 * 4 + 3 * 4;
  else return (sizeof(T) + 3 * 4) + (3 * 4 + sizeof(T));
}

// ---- the runs ----------------------------------------------------------------------

template <class T, class Exec>
void run_list(Exec const& exec, options const& opt, std::vector<std::size_t> const& sizes, double copy_gbps,
              std::uint64_t seed) {
  using space = mpx::memory_space_t<Exec>;
  auto const dtype = mpx::dtype_name<T>;
  std::size_t const k = sizes.size(), n = opt.elements;
  auto values = make_list<T>(exec, sizes, opt.packed);
  auto grads = make_list<T>(exec, sizes, opt.packed);
  fill_uniform(exec, values, seed + 1, -1.0f, 1.0f);
  fill_uniform(exec, grads, seed + 2, -1e-2f, 1e-2f);

  std::vector<mpx::parameter<space>> params;
  params.reserve(k);
  for (std::size_t i = 0; i < k; ++i) params.push_back({"layer_" + std::to_string(i), values.views[i], grads.views[i]});
  // Owns the float master weights and both moments; its gradient_list is the one the
  // loss-scaling rows check.
  mpx::adam optimizer(exec, std::move(params), 1e-3f);
  auto& gradients = optimizer.gradients();
  // In place, a scale of 1 leaves the gradients as they were, so every repeat reads the
  // same values; deferred only reads, so a real loss scale costs nothing to repeat.
  mpx::resident<float, space> unit_scale(exec, 1.0f), loss_scale(exec, 32768.0f);
  exec.synchronize();

  double const tsize = sizeof(T);
  double t = median_seconds(exec, opt.repeat, [&] {
    mpx::unscale_and_check(exec, gradients, unit_scale.get(), 0.0f, mpx::unscaling::in_place);
  });
  require_finite_verdict(exec, gradients, "unscale_and_check (in_place)");
  print_row({Exec::name, "unscale_and_check in_place", dtype, k, n, 2 * tsize, t}, copy_gbps);

  t = median_seconds(exec, opt.repeat, [&] {
    mpx::unscale_and_check(exec, gradients, loss_scale.get(), 0.0f, mpx::unscaling::deferred);
  });
  require_finite_verdict(exec, gradients, "unscale_and_check (deferred)");
  print_row({Exec::name, "unscale_and_check deferred", dtype, k, n, tsize, t}, copy_gbps);

  // The Adam step alone, reading the verdict the deferred check just left (apply()
  // does not advance the step count, so every repeat uses step 1's constants).
  auto const before = mpx::to_host(exec, values.views[0]);
  t = median_seconds(exec, opt.repeat, [&] { optimizer.apply(exec, gradients.summary_data()); });
  require_finite_verdict(exec, gradients, "adam apply");
  double const adam_bytes = adam_bytes_per_element<T>();
  print_row({Exec::name, "adam apply (f32 master)", dtype, k, n, adam_bytes, t}, copy_gbps);

  // Both passes, as loss_scale_optimizer::step runs them (less the scale update).
  t = median_seconds(exec, opt.repeat, [&] {
    mpx::unscale_and_check(exec, gradients, loss_scale.get(), 0.0f, mpx::unscaling::deferred);
    optimizer.apply(exec, gradients.summary_data());
  });
  require_finite_verdict(exec, gradients, "deferred check + adam");
  print_row({Exec::name, "deferred check + adam", dtype, k, n, tsize + adam_bytes, t}, copy_gbps);

  // The updates happened: the first parameter moved, and every value is still finite.
  auto const after = mpx::to_host(exec, values.views[0]);
  std::size_t moved = 0;
  for (std::size_t i = 0; i < after.size(); ++i)
    moved += std::memcmp(&before.data()[i], &after.data()[i], sizeof(T)) != 0 ? 1 : 0;
  if (moved == 0)
    throw bench_failure(std::string("adam on ") + std::string(dtype) +
                        ": the first parameter did not change; the timed steps did no work");
  for (std::size_t i = 0; i < k; ++i)
    if (!mpx::all_finite(exec, values.views[i]))
      throw bench_failure(std::string("adam on ") + std::string(dtype) + ": parameter " + std::to_string(i) +
                          " holds NaN or inf after the timed steps");
}

//! How a list of these sizes is launched: chunks of multi_tensor_chunk elements, one
//! block each (mpx::detail, read for the report only).
void describe_list(std::vector<std::size_t> const& sizes) {
  std::size_t chunks = 0, odd = 0;
  for (auto n : sizes) {
    chunks += (n + mpx::detail::multi_tensor_chunk - 1) / mpx::detail::multi_tensor_chunk;
    odd += n % 8 != 0 ? 1 : 0;
  }
  auto const [lo, hi] = std::minmax_element(sizes.begin(), sizes.end());
  auto launches = [&](std::size_t capacity) { return (sizes.size() + capacity - 1) / capacity; };
  std::printf("list of %zu tensors: %zu to %zu elements, %zu not a multiple of 8; %zu blocks of %zu elements; "
              "launches per dtype: check %zu, adam %zu\n",
              sizes.size(), *lo, *hi, odd, chunks, mpx::detail::multi_tensor_chunk,
              launches(mpx::detail::tensor_table<1>::capacity), launches(mpx::detail::tensor_table<5>::capacity));
}

template <class Exec>
void run_all(Exec const& exec, options const& opt) {
  auto const n = static_cast<std::int64_t>(opt.elements);
  double copy_gbps = 0;
  {
    // The ceiling: N floats read once and written once, both counted.
    auto src = mpx::make_tensor<float>(exec, {n});
    auto dst = mpx::make_tensor<float>(exec, {n});
    mpx::fill(exec, src, 0.5f);
    mpx::fill(exec, dst, 0.0f);
    double const s = median_seconds(exec, opt.repeat, [&] { mpx::copy(exec, src, dst); });
    copy_gbps = 2.0 * static_cast<double>(src.size_bytes()) / s / 1e9;
    print_row({Exec::name, "copy (ceiling)", "float32", 1, opt.elements, 8, s}, copy_gbps);
  }
  for (std::size_t k : opt.tensors) {
    std::uint64_t const seed = 20240601u + k;
    auto const sizes = uneven_sizes(opt.elements, k, seed);
    describe_list(sizes);
    run_list<mpx::half>(exec, opt, sizes, copy_gbps, seed);
    run_list<mpx::bfloat16>(exec, opt, sizes, copy_gbps, seed);
    run_list<float>(exec, opt, sizes, copy_gbps, seed);
  }
  exec.synchronize();
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  mpx_programs::command_line args(argc, argv,
                                  "[--elements N] [--tensors K[,K...]] [--repeat R] [--executor host|cuda|all] [--packed]");
  while (args.next()) {
    if (args.is("--elements")) opt.elements = args.whole<std::size_t>(1, std::size_t{1} << 32);
    else if (args.is("--tensors")) opt.tensors = args.wholes<std::size_t>(1, std::size_t{1} << 20);
    else if (args.is("--repeat")) opt.repeat = args.whole<int>(1, 10'000);
    else if (args.is("--executor")) opt.executor = args.choice({"host", "cuda", "all"});
    else if (args.is("--packed")) opt.packed = true;
    else args.unknown();
  }
  for (std::size_t k : opt.tensors)
    if (k > opt.elements)
      throw mpx_programs::usage_error("--tensors " + std::to_string(k) + " exceeds --elements " +
                                      std::to_string(opt.elements) + ": every tensor holds at least one element");
#if !MPX_HAS_CUDA
  if (opt.executor == "cuda") throw mpx::error("--executor cuda: built without nvcc: no CUDA rows");
#endif
  std::printf("scaling_bench: %zu gradient elements in all, in lists of uneven sizes (%s); median of %d runs "
              "after a warm-up\n",
              opt.elements, opt.packed ? "packed into one buffer" : "one allocation each", opt.repeat);
  std::printf("GB/s = (bytes read + bytes written) / time, each byte once; the copy counts its read and its "
              "write (8 B per float element), as numerics_bench does.\n"
              "B/elem: unscale in_place 2*sizeof(T) (read, write); deferred sizeof(T) (read only); adam (float "
              "master, m, v): 16-bit T reads g, master, m, v and writes master, m, v, value = 28; float reads "
              "value, g, m, v and writes value, m, v = 28.\n");
  print_header();
  return mpx_bench::run_on_executors(opt.executor, [&](auto const& exec) { run_all(exec, opt); });
} catch (...) {
  return mpx_programs::report_failure("scaling_bench");
}
