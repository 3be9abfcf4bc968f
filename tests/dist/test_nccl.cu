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

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

namespace {
mpx::nccl_communicator* gpus = nullptr;
}

TEST_CASE("nccl_communicator all-reduces on its own stream, ordered by events", "[dist][nccl]") {
  mpx::cuda_executor exec;
  int const ranks = gpus->size();
  mpx_test::for_each_dtype([&](auto t) {
    using T = decltype(t);
    for (std::size_t n : {std::size_t{1}, std::size_t{1021}, std::size_t{65537}}) {
      INFO(mpx::dtype_name<T> << " n=" << n);
      std::vector<T> mine(n, mpx::cast<T>(static_cast<float>(gpus->rank() + 1)));
      mine[n / 2] = gpus->rank() == ranks - 1 ? mpx::cast<T>(std::numeric_limits<float>::quiet_NaN()) : mine[n / 2];
      auto data = mpx_test::upload(exec, mine, {static_cast<std::int64_t>(n)});
      gpus->all_reduce(exec, data, mpx::reduce_op::sum);
      auto const got = mpx_test::download(exec, data);  // on the executor's stream: after the collective
      CHECK(mpx::is_nan(got[n / 2]));
      CHECK(mpx::cast<float>(got[0]) == static_cast<float>(ranks * (ranks + 1) / 2));
    }
  });
  auto values = gpus->all_gather_values(std::vector<double>{static_cast<double>(gpus->rank()), 2.5});
  REQUIRE(values.size() == 2 * static_cast<std::size_t>(ranks));
  CHECK(values[2 * static_cast<std::size_t>(ranks - 1)] == ranks - 1);
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
// With one rank only the keys' round trip is seen; with more, the NaN's crossing too.
TEST_CASE("nccl_communicator's max and min keep a NaN; negative values and signed zeros order right",
          "[dist][nccl]") {
  mpx::cuda_executor exec;
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
      auto data = mpx_test::upload(exec, values, {static_cast<std::int64_t>(values.size())});
      gpus->all_reduce(exec, data, op);
      auto const got = mpx_test::download(exec, data);
      CHECK(mpx::cast<float>(got[0]) == (max ? -1.0f : -static_cast<float>(ranks)));
      CHECK(mpx::cast<float>(got[1]) == (max ? 0.5f * static_cast<float>(ranks) : 0.5f));
      CHECK(mpx::cast<float>(got[2]) == 0.0f);
      CHECK(std::signbit(mpx::cast<float>(got[2])) == (ranks == 1 || !max));  // -0 < +0
      CHECK(mpx::is_nan(got[3]));
      CHECK(mpx::cast<float>(got[4]) == (max ? (ranks == 1 ? -inf : static_cast<float>(last)) : -inf));
      CHECK(mpx::is_nan(got[5]));  // a NaN with its sign bit set is a NaN too
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
    return Catch::Session().run(argc, argv);
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
