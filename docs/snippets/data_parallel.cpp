// docs/data_parallel.md: a data-parallel job on the host. Run it under mpirun:
//   mpirun -np 2 build/docs/doc_data_parallel
// Every rank builds the same model (from its own seed: rank 0's weights are broadcast),
// trains on its share of every global batch, and ends with the same parameters.
#include <mpx/mpx.hpp>
#include <mpx/dist/data_parallel.hpp>
#include <mpx/dist/mpi_communicator.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  mpx::mpi_environment mpi(argc, argv);  // MPI_Init; MPI_Finalize at the end
  mpx::mpi_communicator comm;            // every rank of mpirun; collectives time out after 5 minutes
  mpx::host_executor exec;

  // Points in the plane labelled by quadrant, the same on every rank.
  std::size_t const n = 1024;
  mpx::image_dataset points;
  points.images = mpx::tensor<float>(exec, mpx::shape{static_cast<std::int64_t>(n), 2, 1, 1});
  points.num_classes = 4;
  mpx::splitmix64 rng(7);
  for (std::size_t i = 0; i < n; ++i) {
    float const x = static_cast<float>(rng.below(2001)) / 1000.0f - 1.0f;  // in [-1, 1]
    float const y = static_cast<float>(rng.below(2001)) / 1000.0f - 1.0f;
    points.images.data()[2 * i] = x;
    points.images.data()[2 * i + 1] = y;
    points.labels.push_back((x > 0 ? 1 : 0) + (y > 0 ? 2 : 0));
  }

  auto model = mpx::sequential<mpx::mixed_float16>(mpx::flatten<>(), mpx::dense<>(32, mpx::activation::tanh),
                                                   mpx::dense<>(4), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {2, 1, 1}, 1 + static_cast<std::uint64_t>(comm.rank()));
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::data_parallel dp(exec, comm, optimizer);  // same model everywhere? then rank 0's weights

  // A global batch of 64: each rank takes 64 / ranks of it.
  auto const rank = static_cast<std::size_t>(comm.rank()), ranks = static_cast<std::size_t>(comm.size());
  mpx::batch_loader<mpx::host_executor, mpx::half> train(
      exec, points, {.batch_size = 64 / ranks, .seed = 3, .replica = rank, .replicas = ranks});
  mpx::batch_loader<mpx::host_executor, mpx::half> test(
      exec, points, {.batch_size = 100, .shuffle = false, .replica = rank, .replicas = ranks,
                     .shard_by = mpx::sharding::whole_batches});

  mpx::fit_options options;
  options.epochs = 5;
  options.progress = 0;                  // plain lines, printed by rank 0 only
  options.replicas = dp.hooks();         // average the gradients; sum the metrics
  auto const history = mpx::fit(exec, model, optimizer, train, options, &test);

  dp.check_parameters_agree(exec);       // throws unless every rank holds the same bits
  bool const learned = history.back().validation.accuracy > 0.9 && history.back().validation.samples == n;
  if (comm.rank() == 0) std::printf("%zu ranks, validation accuracy %.3f\n", ranks, history.back().validation.accuracy);
  return learned ? 0 : 1;
}
