// Data parallelism between GPUs on NCCL. One process per GPU: under mpirun the NCCL id
// comes from rank 0 through MPI; started alone it is a job of one rank, which still runs
// every code path (the GPU kit runs it so on a one-GPU machine). Exits 77 without a GPU.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <mpx/mpx.hpp>
#include <mpx/dist/data_parallel.hpp>
#include <mpx/dist/mpi_communicator.hpp>
#include <mpx/dist/nccl_communicator.hpp>

#include "support/testing.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace {

mpx::nccl_communicator* gpus = nullptr;

// Holds back the work enqueued on a stream after it until released: a host function at
// the head of the stream waits for a flag (as tests/scaling/test_loss_scaler.cpp holds a
// stream). It lets go by itself after 5 s and says so, so that a collective that waits on
// the host for the held stream fails the test instead of hanging it.
class stream_hold {
 public:
  explicit stream_hold(cudaStream_t stream) : stream_(stream) {
    MPX_CUDA_CHECK(cudaLaunchHostFunc(stream, &stream_hold::wait, this));
  }
  ~stream_hold() {
    release();
    static_cast<void>(cudaStreamSynchronize(stream_));  // the waiting function reads *this
  }
  stream_hold(stream_hold const&) = delete;
  stream_hold& operator=(stream_hold const&) = delete;
  void release() { open_.store(true); }
  [[nodiscard]] bool expired() const { return expired_.load(); }

 private:
  static void wait(void* self) {
    auto* hold = static_cast<stream_hold*>(self);
    auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!hold->open_.load())
      if (std::chrono::steady_clock::now() > deadline) {
        hold->expired_.store(true);
        return;
      }
  }
  std::atomic<bool> open_{false}, expired_{false};
  cudaStream_t stream_;
};

// Runs `collective` on a tensor that a copy on the executor's stream fills with `values`
// just before it, after the tensor held `stale`, with the executor's stream held until
// the collective is enqueued. A collective not ordered after the executor's work would
// run during the hold and read `stale`; while the hold lasts the communicator's stream
// must not finish (it waits for the copy). With one rank an in-place sum changes nothing,
// and that unfinished stream is the only sign of the order. The result is read on the
// executor's stream, which must wait for the collective. `collective` is called with a
// tensor on the stream of `exec`, a non-blocking stream of the test's own (holding the
// legacy default stream would hold every blocking stream too).
template <class T, class Collective>
std::vector<T> collective_after_held_write(mpx::cuda_executor const& exec, std::vector<T> const& values, T stale,
                                           Collective&& collective) {
  auto const n = static_cast<std::int64_t>(values.size());
  {  // once unheld first: kernels load on first use, and loading may synchronise the
     // context (CUDA's lazy loading), which the hold would block
    auto warm = mpx_test::upload(exec, values, {n});
    collective(warm);
    exec.synchronize();
  }
  auto data = mpx_test::upload(exec, std::vector<T>(values.size(), stale), {n});
  auto const source = mpx_test::upload(exec, values, {n});
  exec.synchronize();  // nothing from pageable memory is copied while the stream is held
  {
    stream_hold hold(exec.stream());
    mpx::copy(exec, source, data);
    collective(data);
    bool finished_during_hold = false;
    for (auto const until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
         !finished_during_hold && std::chrono::steady_clock::now() < until;
         std::this_thread::sleep_for(std::chrono::milliseconds(1))) {
      cudaError_t const status = cudaStreamQuery(gpus->stream());
      if (status != cudaErrorNotReady) MPX_CUDA_CHECK(status);
      finished_during_hold = status == cudaSuccess;
    }
    if (finished_during_hold) FAIL_CHECK("the collective ran while the write before it was held back");
    hold.release();
    if (hold.expired()) FAIL_CHECK("the collective waited on the host for the held stream");
  }
  return mpx_test::download(exec, data);
}

// The first element of `got` that differs from `expected` by more than `tolerance`
// (relative; NaN matches NaN only); empty if none does.
template <class T>
std::string first_difference(std::vector<T> const& got, std::vector<T> const& expected, double tolerance) {
  if (tolerance == 0) return mpx_test::first_mismatch(got, expected);
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const g = mpx::detail::to_double(got[i]), e = mpx::detail::to_double(expected[i]);
    if (std::isnan(e) ? !std::isnan(g) : !(std::abs(g - e) <= tolerance * std::abs(e)))
      return "index " + std::to_string(i) + ": got " + mpx_test::describe(got[i]) + ", expected " +
             mpx_test::describe(expected[i]);
  }
  return {};
}

template <class T>
bool sign_bit(T x) {
  return (mpx::bits(x) & mpx::dtype_traits<T>::sign_mask) != 0;
}

}  // namespace

// Every element is checked, each rank's input depends on its rank and the index: a
// reduction of a prefix, or one that adds the wrong elements, shows with two ranks or
// more. With one rank the sum is the input, and what can still fail is its order after
// the executor's work and before its later work (collective_after_held_write).
TEST_CASE("nccl_communicator all-reduces on its own stream, ordered by events", "[dist][nccl]") {
  mpx::detail::side_stream stream;
  mpx::cuda_executor const exec(stream.stream);
  int const ranks = gpus->size(), rank = gpus->rank();
  mpx_test::for_each_dtype([&](auto t) {
    using T = decltype(t);
    // Partial sums are integers up to 7 * 36: exact in every dtype up to 8 ranks; past
    // that bfloat16's 8 bits round them, in an order only NCCL knows.
    double const tolerance = ranks <= 8 ? 0.0 : ranks * std::ldexp(1.0, -8);
    for (std::size_t n : {std::size_t{1}, std::size_t{1021}, std::size_t{65537}}) {
      INFO(mpx::dtype_name<T> << " n=" << n << " ranks=" << ranks);
      std::vector<T> mine(n), expected(n);
      for (std::size_t i = 0; i < n; ++i) {
        auto const k = static_cast<float>(i % 7 + 1);
        mine[i] = mpx::cast<T>(static_cast<float>(rank + 1) * k);
        expected[i] = mpx::cast<T>(k * static_cast<float>(ranks * (ranks + 1) / 2));
      }
      if (rank == ranks - 1) mine[n / 2] = mpx::cast<T>(std::numeric_limits<float>::quiet_NaN());
      expected[n / 2] = mpx::cast<T>(std::numeric_limits<float>::quiet_NaN());
      auto const got = collective_after_held_write(exec, mine, mpx::cast<T>(-3.0f), [&](auto& data) {
        gpus->all_reduce(exec, data, mpx::reduce_op::sum);
      });
      auto const mismatch = first_difference(got, expected, tolerance);
      INFO(mismatch);
      CHECK(mismatch.empty());
    }
  });
  // The host values (metrics, barrier, agreement checks), every element.
  std::vector<double> sums(5);
  for (std::size_t i = 0; i < sums.size(); ++i) sums[i] = static_cast<double>(rank + 1) * static_cast<double>(i + 1);
  gpus->all_reduce_values(sums, mpx::reduce_op::sum);
  for (std::size_t i = 0; i < sums.size(); ++i) {
    INFO("host sum " << i);
    CHECK(sums[i] == static_cast<double>(i + 1) * ranks * (ranks + 1) / 2);
  }
  auto values = gpus->all_gather_values(std::vector<double>{static_cast<double>(rank), 2.5 + rank});
  REQUIRE(values.size() == 2 * static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    INFO("gathered from rank " << r);
    CHECK(values[2 * static_cast<std::size_t>(r)] == r);
    CHECK(values[2 * static_cast<std::size_t>(r) + 1] == 2.5 + r);
  }
  gpus->barrier();
  gpus->poll();
}

TEST_CASE("data-parallel training on GPUs keeps every replica identical", "[dist][nccl]") {
  mpx::cuda_executor exec;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(16, mpx::activation::tanh), mpx::dense<>(4),
                                                   mpx::softmax_layer<mpx::float32>());
  model.build(exec, {2}, 1 + static_cast<std::uint64_t>(gpus->rank()));
  auto opt = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.5f),
                                       mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::data_parallel dp(exec, *gpus, opt, {.bucket_bytes = 128, .check_replicas_agree = true});
  auto images = mpx_test::upload(exec, mpx_test::random_values<mpx::half>(64, -1, 1, 3 + gpus->rank()), {32, 2});
  std::vector<std::int32_t> labels(32);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 4);
  auto label_tensor = mpx_test::upload(exec, labels, {32});
  mpx::classifier_trainer trainer(exec, model, opt);
  trainer.run_as_replica(dp.hooks());
  for (int step = 0; step < 5; ++step) trainer.step(exec, mpx::view(images), mpx::view(label_tensor));
  auto const records = trainer.history(exec);
  CHECK(records.size() == 5);
  dp.check_parameters_agree(exec);
  gpus->poll();
}

// NCCL's own max and min on floats keep the operand that is not NaN; the communicator's
// keep the NaN (an fp8 amax that went NaN on one rank must reach every rank's scale).
// With one rank only the keys' round trip is seen, and its one visible change: a NaN
// leaves a max with its sign bit cleared and a min with it set (from_nan_keeping_max_key),
// so a NaN written just before the collective that comes back with its sign unchanged
// was not read by it. With more ranks, the NaN's crossing too.
TEST_CASE("nccl_communicator's max and min keep a NaN; negative values and signed zeros order right",
          "[dist][nccl]") {
  mpx::detail::side_stream stream;
  mpx::cuda_executor const exec(stream.stream);
  int const ranks = gpus->size(), rank = gpus->rank(), last = ranks - 1;
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  mpx_test::for_each_dtype([&](auto t) {
    using T = decltype(t);
    for (auto op : {mpx::reduce_op::max, mpx::reduce_op::min}) {
      INFO(mpx::dtype_name<T> << " " << mpx::to_string(op));
      bool const max = op == mpx::reduce_op::max;
      std::vector<float> mine = {-static_cast<float>(rank + 1), 0.5f * static_cast<float>(rank + 1),
                                 rank == 0 ? -0.0f : 0.0f, rank == last ? nan : 1.0f, rank == 0 ? -inf : static_cast<float>(rank),
                                 rank == last ? -nan : -1.0f};
      std::vector<T> values(mine.size());
      for (std::size_t i = 0; i < mine.size(); ++i) values[i] = mpx::cast<T>(mine[i]);
      if (rank == last) {  // the NaNs' signs set by bits: a cast need not keep them
        using word = mpx::detail::bits_t<T>;
        constexpr word sign = mpx::dtype_traits<T>::sign_mask;
        auto const positive = static_cast<word>(mpx::bits(mpx::cast<T>(nan)) & static_cast<word>(~sign));
        values[3] = mpx::detail::from_bits<T>(positive);
        values[5] = mpx::detail::from_bits<T>(static_cast<word>(positive | sign));
      }
      auto const got = collective_after_held_write(exec, values, mpx::cast<T>(2.0f),
                                                   [&](auto& data) { gpus->all_reduce(exec, data, op); });
      CHECK(mpx::cast<float>(got[0]) == (max ? -1.0f : -static_cast<float>(ranks)));
      CHECK(mpx::cast<float>(got[1]) == (max ? 0.5f * static_cast<float>(ranks) : 0.5f));
      CHECK(mpx::cast<float>(got[2]) == 0.0f);
      CHECK(std::signbit(mpx::cast<float>(got[2])) == (ranks == 1 || !max));  // -0 < +0
      CHECK(mpx::is_nan(got[3]));
      CHECK(mpx::cast<float>(got[4]) == (max ? (ranks == 1 ? -inf : static_cast<float>(last)) : -inf));
      CHECK(mpx::is_nan(got[5]));  // a NaN with its sign bit set is a NaN too
      CHECK(sign_bit(got[3]) == !max);
      CHECK(sign_bit(got[5]) == !max);
    }
  });
  // The host values' max and min (on_rank_zero's failure flag, metrics) keep NaN too.
  std::vector<double> v = {rank == last ? std::numeric_limits<double>::quiet_NaN() : 1.0, -static_cast<double>(rank + 1)};
  gpus->all_reduce_values(v, mpx::reduce_op::max);
  CHECK(std::isnan(v[0]));
  CHECK(v[1] == -1.0);
  v = {rank == last ? std::numeric_limits<double>::quiet_NaN() : 1.0, -static_cast<double>(rank + 1)};
  gpus->all_reduce_values(v, mpx::reduce_op::min);
  CHECK(std::isnan(v[0]));
  CHECK(v[1] == -static_cast<double>(ranks));
  gpus->poll();
}

namespace {

// An fp8 layer between two bfloat16 ones (fp8 products need K and N multiples of 16 on
// the GPU): its amaxes are max-reduced over the ranks in every step.
auto fp8_middle_model() {
  return mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(16, mpx::activation::tanh),
                                              mpx::dense<mpx::mixed_fp8>(16, mpx::activation::tanh), mpx::dense<>(4),
                                              mpx::softmax_layer<mpx::float32>());
}

}  // namespace

TEST_CASE("an fp8 amax that is NaN on one rank is NaN on every rank", "[dist][nccl][fp8]") {
  mpx::cuda_executor exec;
  auto model = fp8_middle_model();
  model.build(exec, {2}, 1);
  auto opt = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f),
                                       mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::data_parallel dp(exec, *gpus, opt);
  auto const hooks = dp.hooks();
  std::vector<float> amax = {gpus->rank() == gpus->size() - 1 ? std::numeric_limits<float>::quiet_NaN() : 3.0f};
  auto on_gpu = mpx_test::upload(exec, amax, {1});
  hooks.max_in_place(mpx::step_executor(exec), on_gpu.data());
  CHECK(std::isnan(mpx_test::download(exec, on_gpu)[0]));
  gpus->poll();
}

// The gradients' all-reduce, their averaging and the fp8 amax reductions run on the
// step's stream: in graph mode the trainer's own, captured with the step. Replays must
// train exactly as eager steps do; a captured collective is not polled afterwards
// (its event cannot be queried).
TEST_CASE("data-parallel training replayed from a CUDA graph matches eager training bit for bit", "[dist][nccl]") {
  mpx::cuda_executor exec;
  using space = mpx::device_space;
  auto images = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(64, -1, 1, 5 + gpus->rank()), {32, 2});
  std::vector<std::int32_t> labels(32);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 4);
  auto label_tensor = mpx_test::upload(exec, labels, {32});
  auto train = [&](bool graph) {
    auto model = fp8_middle_model();
    model.build(exec, {2}, 1 + static_cast<std::uint64_t>(gpus->rank()));
    auto opt = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.5f),
                                         mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    // Small buckets: several all-reduces, started during the backward pass.
    mpx::data_parallel dp(exec, *gpus, opt, {.bucket_bytes = 256, .check_replicas_agree = true});
    mpx::classifier_trainer trainer(exec, model, opt);
    trainer.use_cuda_graph(graph);
    trainer.run_as_replica(dp.hooks());
    for (int step = 0; step < 6; ++step) trainer.step(exec, mpx::view(images), mpx::view(label_tensor));
    auto records = trainer.history(exec);
    dp.check_parameters_agree(exec);
    gpus->poll();  // after a capture: no captured event in flight
    return std::pair(records, mpx_test::download(exec, model.template layer<1>().template kernel<space>()));
  };
  auto const [eager_records, eager_weights] = train(false);
  auto const [graph_records, graph_weights] = train(true);
  REQUIRE(eager_records.size() == 6);
  REQUIRE(graph_records.size() == 6);
  for (std::size_t i = 0; i < 6; ++i) {
    INFO("step " << i);
    CHECK(graph_records[i].loss == eager_records[i].loss);
    CHECK(graph_records[i].loss_scale == eager_records[i].loss_scale);
    CHECK(graph_records[i].gradient_norm == eager_records[i].gradient_norm);
    CHECK(graph_records[i].correct == eager_records[i].correct);
  }
  CHECK(mpx_test::first_mismatch(graph_weights, eager_weights).empty());
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("mpx nccl tests: no usable GPU; skipped\n");
    return 77;
  }
  mpx::communicator_options const patience{std::chrono::seconds(60)};
  if (!mpx::mpi_environment::launched_as_replica()) {  // alone: a job of one rank, no MPI runtime needed
    ncclUniqueId id{};
    mpx::detail::check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", "bootstrap");
    mpx::nccl_communicator communicator(mpx::cuda_executor{}, id, 0, 1, patience);
    gpus = &communicator;
    std::printf(
        "mpx nccl tests: one rank: every collective is an identity here; checked are the order of each collective "
        "after the executor's work and before its later work, every element, the NaN marks of max and min and "
        "the host-value round trips. Sums across ranks, the NaN's crossing, the max/min of different values and "
        "replicas that agree after starting apart need mpirun -np 2 or more (scripts/gpu_run.sh on >= 2 GPUs)\n");
    return Catch::Session().run(argc, argv) == 0 ? 0 : 1;  // (Catch2's count of failures could read as 77)
  }
  mpx::mpi_environment mpi(argc, argv);
  mpx::mpi_communicator world;
  MPX_CUDA_CHECK(cudaSetDevice(world.rank() % devices));
  int failed = 0;
  {
    mpx::nccl_communicator communicator(mpx::cuda_executor{}, world, patience);
    gpus = &communicator;
    failed = Catch::Session().run(argc, argv);
    gpus = nullptr;
  }
  double any[1] = {static_cast<double>(failed)};
  world.all_reduce_values(any, mpx::reduce_op::max);
  return any[0] != 0 ? 1 : 0;
}
