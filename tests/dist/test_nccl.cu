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

#include <cstdio>
#include <limits>

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
  trainer.run_as_replica(dp.hooks(exec));
  for (int step = 0; step < 5; ++step) trainer.step(exec, mpx::view(images), mpx::view(label_tensor));
  auto const records = trainer.history(exec);
  CHECK(records.size() == 5);
  dp.check_parameters_agree(exec);
  gpus->poll();
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
