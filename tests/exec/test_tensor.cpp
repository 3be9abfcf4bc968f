// Shapes, tensors and views: ownership, bounds, reshape, copies between spaces, and the
// errors that name both shapes.
#include "../support/testing.hpp"

static_assert(!std::is_copy_constructible_v<mpx::tensor<float>>);
static_assert(!std::is_copy_assignable_v<mpx::tensor<float>>);
static_assert(std::is_nothrow_move_constructible_v<mpx::tensor<float>>);
static_assert(std::is_trivially_copyable_v<mpx::tensor_view<float>>);
static_assert(std::is_convertible_v<mpx::tensor_view<float>, mpx::tensor_view<float const>>);
static_assert(!std::is_convertible_v<mpx::tensor_view<float const>, mpx::tensor_view<float>>);
static_assert(mpx::can_access_v<mpx::host_executor, mpx::host_space>);
static_assert(!mpx::can_access_v<mpx::host_executor, mpx::device_space>);
#if MPX_HAS_CUDA_RUNTIME
static_assert(mpx::can_access_v<mpx::cuda_executor, mpx::device_space>);
static_assert(!mpx::can_access_v<mpx::cuda_executor, mpx::host_space>);
static_assert(mpx::is_cuda_executor_v<mpx::cuda_executor> && !mpx::is_host_executor_v<mpx::cuda_executor>);
#endif

namespace {
// Each writes through a view of its own local array and returns what the array then
// holds. Not inlined: the array's address reaches the algorithm only inside the view.
// (GCC 12.2 at -O1 dropped these writes while mpx::view took a view by value.)
[[gnu::noinline]] float filled_local(mpx::host_executor const& exec) {
  float x[4] = {};
  mpx::fill(exec, mpx::tensor_view<float>(x, mpx::shape{4}), 3.0f);
  return x[0] + x[3];
}
[[gnu::noinline]] float copied_local(mpx::host_executor const& exec) {
  float x[4] = {};
  float const y[4] = {1, 2, 3, 4};
  mpx::copy(exec, mpx::tensor_view<float const>(y, mpx::shape{4}), mpx::tensor_view<float>(x, mpx::shape{4}));
  return x[0] + x[3];
}
[[gnu::noinline]] float scaled_local(mpx::host_executor const& exec) {
  float x[4] = {1, 2, 3, 4};
  mpx::scale(exec, mpx::tensor_view<float>(x, mpx::shape{4}), 2.0f);
  return x[0] + x[3];
}
[[gnu::noinline]] std::uint64_t copied_scalar(mpx::host_executor const& exec, std::uint64_t const* from) {
  std::uint64_t value = 0;
  mpx::copy(exec, mpx::tensor_view<std::uint64_t const>(from, mpx::shape{1}),
            mpx::tensor_view<std::uint64_t>(&value, mpx::shape{1}));
  return value;
}
}  // namespace

TEST_CASE("algorithms write through a view into a caller's local array", "[tensor]") {
  mpx::host_executor const exec;
  CHECK(filled_local(exec) == 6.0f);
  CHECK(copied_local(exec) == 5.0f);
  CHECK(scaled_local(exec) == 10.0f);
  std::uint64_t const counter = 42;
  CHECK(copied_scalar(exec, &counter) == 42);
}

TEST_CASE("shape: size, rank, printing, equality", "[tensor]") {
  mpx::shape const s{32, 28, 28, 1};
  CHECK(s.rank() == 4);
  CHECK(s.size() == 32u * 28 * 28);
  CHECK(s.to_string() == "[32, 28, 28, 1]");
  CHECK(mpx::shape{}.size() == 1);
  CHECK(mpx::shape{}.to_string() == "[]");
  CHECK(mpx::shape{3, 0}.size() == 0);
  CHECK(s == mpx::shape{32, 28, 28, 1});
  CHECK_FALSE(s == mpx::shape{32, 28, 28});
  CHECK_THROWS_TYPE_WITH((mpx::shape{2, -1}), mpx::invalid_argument, Catch::Matchers::Contains("negative extent -1"));
  CHECK_THROWS_AS((mpx::shape{1, 1, 1, 1, 1, 1, 1, 1, 1}), mpx::invalid_argument);
}

TEST_CASE("host tensor: ownership moves, views see the same memory", "[tensor]") {
  mpx::tensor<float> a(mpx::shape{2, 3});
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  float const* data = a.data();
  mpx::tensor<float> b = std::move(a);
  CHECK(b.data() == data);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  CHECK(a.empty());
  CHECK(a.shape() == mpx::shape{0});
  mpx::tensor<float> c(mpx::shape{5});
  c = std::move(b);
  CHECK(c.data() == data);
  CHECK(c.size() == 6);
  CHECK(b.empty());  // NOLINT(bugprone-use-after-move)
  b = std::move(c);  // and back
  auto v = b.view();
  CHECK(v.data() == data);
  CHECK(v.shape() == mpx::shape{2, 3});
  CHECK(v[4] == 4.0f);
  auto r = v.reshape({3, 2});
  CHECK(r.shape().to_string() == "[3, 2]");
  CHECK(r.data() == v.data());
  CHECK_THROWS_TYPE_WITH(v.reshape({4, 2}), mpx::shape_error,
                       Catch::Matchers::Contains("[2, 3]") && Catch::Matchers::Contains("[4, 2]"));
  auto f = v.flat(2, 3);
  CHECK(f.size() == 3);
  CHECK(f[0] == 2.0f);
  CHECK_THROWS_AS(v.flat(4, 3), mpx::invalid_argument);
  CHECK(v.flat(6, 0).empty());
}

TEMPLATE_LIST_TEST_CASE("copy round-trips through the executor's space", "[tensor]", mpx_test::executors) {
  TestType exec;
  for (std::size_t n : mpx_test::awkward_sizes()) {
    auto const values = mpx_test::random_values<float>(n, -10, 10, n);
    auto t = mpx_test::upload(exec, values);
    auto u = mpx::make_tensor<float>(exec, t.shape());
    mpx::fill(exec, u, mpx_test::poison<float>());
    mpx::copy(exec, t, u);
    INFO("n = " << n);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, u), values).empty());
  }
}

TEMPLATE_LIST_TEST_CASE("copy and elementwise ops name both shapes on a mismatch", "[tensor][errors]",
                        mpx_test::executors) {
  TestType exec;
  auto a = mpx::make_tensor<float>(exec, {4, 5});
  auto b = mpx::make_tensor<float>(exec, {5, 4});
  auto c = mpx::make_tensor<mpx::half>(exec, {20});
  CHECK_THROWS_TYPE_WITH(mpx::copy(exec, a, b), mpx::shape_error,
                       Catch::Matchers::Contains("mpx::copy") && Catch::Matchers::Contains("[4, 5]") &&
                           Catch::Matchers::Contains("[5, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::cast(exec, a, c), mpx::shape_error,
                       Catch::Matchers::Contains("[4, 5]") && Catch::Matchers::Contains("[20]"));
  CHECK_THROWS_AS(mpx::axpy(exec, 1.0f, a, b), mpx::shape_error);
  // Nothing was written: the failed operations were refused before any launch.
  CHECK(mpx::shape{4, 5} == a.shape());
}

// cudaMemcpyAsync leaves overlapping ranges undefined, so mpx::copy refuses a partial
// overlap on every executor (the host used to memmove it); the same elements are a no-op.
TEMPLATE_LIST_TEST_CASE("copy refuses overlapping source and destination on every executor", "[tensor][errors]",
                        mpx_test::executors) {
  TestType exec;
  std::vector<float> values(16);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  auto t = mpx_test::upload(exec, values);
  auto const v = t.view();
  CHECK_THROWS_TYPE_WITH(mpx::copy(exec, v.flat(0, 8), v.flat(4, 8)), mpx::invalid_argument,
                         Catch::Matchers::Contains("mpx::copy") && Catch::Matchers::Contains("overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::copy(exec, v.flat(4, 8), v.flat(0, 8)), mpx::invalid_argument,
                         Catch::Matchers::Contains("overlap"));
  CHECK_THROWS_AS(mpx::copy(exec, v.flat(0, 8), v.flat(7, 8)), mpx::invalid_argument);  // one element shared
  mpx::copy(exec, v.flat(2, 5), v.flat(2, 5));  // the same elements: nothing to do
  mpx::copy(exec, v.flat(0, 8), v.flat(8, 8));  // adjacent, not overlapping
  std::vector<float> expected = values;
  for (std::size_t i = 0; i < 8; ++i) expected[8 + i] = values[i];
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, t), expected).empty());
}

#if MPX_HAS_CUDA
// The device's pool keeps what stream-ordered frees return (release threshold raised
// by mpx's first allocation): with the default threshold 0, every synchronisation (the
// batch loader's cudaEventSynchronize, a step's read of its record) would hand the
// memory back to the driver, and the next step would map it again.
TEST_CASE("device memory freed on a stream stays in the pool across synchronisations", "[tensor][cuda]") {
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t event = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess);
  int device = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  cudaMemPool_t pool = nullptr;
  REQUIRE(cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess);
  auto reserved = [&] {
    std::uint64_t bytes = 0;
    REQUIRE(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &bytes) == cudaSuccess);
    return bytes;
  };
  constexpr std::int64_t bytes = std::int64_t{256} << 20;
  {
    mpx::cuda_executor const exec(stream);
    {
      auto big = mpx::make_tensor<std::uint8_t>(exec, {bytes});
      mpx::fill(exec, big, std::uint8_t{1});
    }  // freed on the stream (cudaFreeAsync)
    REQUIRE(cudaEventRecord(event, stream) == cudaSuccess);
    REQUIRE(cudaEventSynchronize(event) == cudaSuccess);  // as the batch loader waits
    INFO("reserved after an event synchronisation: " << reserved());
    CHECK(reserved() >= static_cast<std::uint64_t>(bytes));
    exec.synchronize();
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    INFO("reserved after a device synchronisation: " << reserved());
    CHECK(reserved() >= static_cast<std::uint64_t>(bytes));
    std::uint64_t threshold = 0;
    REQUIRE(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold) == cudaSuccess);
    CHECK(threshold == UINT64_MAX);
  }
  cudaEventDestroy(event);
  cudaStreamDestroy(stream);
}
#endif

#if MPX_HAS_CUDA
TEST_CASE("a failing CUDA call becomes an mpx::cuda_error naming the call", "[errors]") {
  mpx::cuda_executor exec;
  // Asking for more memory than any GPU has.
  CHECK_THROWS_TYPE_WITH((mpx::tensor<float, mpx::device_space>(exec, {std::int64_t{1} << 45})), mpx::cuda_error,
                       Catch::Matchers::Contains("cudaMallocAsync") && Catch::Matchers::Contains("cudaError"));
}
#endif
