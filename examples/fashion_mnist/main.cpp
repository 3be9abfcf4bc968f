// The main job: the classic small CNN on Fashion-MNIST, in mixed_float16,
// mixed_bfloat16 or float32, the way tf.keras.mixed_precision users write it (and in
// two policies Keras lacks: bfloat16 with bfloat16 weights and no float master copy,
// and mixed_fp8, Transformer Engine's recipe):
//
//   model = Sequential([Conv2D(32, 3, activation="relu"), MaxPool2D(),
//                       Conv2D(64, 3, activation="relu"), MaxPool2D(), Flatten(),
//                       Dense(128, activation="relu"), Dense(10),
//                       Activation("softmax", dtype="float32")])   # under mixed_float16
//
// Under mixed_float16 the optimizer is wrapped in a loss_scale_optimizer with Keras's
// dynamic loss scale (as keras's Model.compile does); under mixed_bfloat16 and float32
// the scale stays 1 (bfloat16 has float32's range), but every step is still checked
// for NaN/inf and skipped if it holds one. Under bfloat16 the weights themselves are
// bfloat16 and Adam's updates are rounded stochastically (mpx::master_weights_for), so
// updates below half a bfloat16 ulp are not lost. Under mixed_fp8 the inner conv and dense
// layers multiply e4m3 activations and weights and e5m2 gradients, each with its own
// scale; the first and last layers stay in bfloat16 (mpx::without_fp8), as Transformer
// Engine advises.
//
//   fashion_mnist [--policy mixed_float16|mixed_bfloat16|float32|bfloat16|mixed_fp8|mixed_fp8_current|
//                  mixed_fp8_block|mixed_fp8_rowwise|mixed_mxfp8|mixed_nvfp4|all] [--epochs N]
//                 [--batch-size N] [--executor auto|host|cuda] [--train-limit N]
//                 [--test-limit N] [--data DIR] [--csv FILE] [--plot FILE.png] [--seed N]
//                 [--cuda-graph] [--probe] [--shadow N] [--data-parallel]
//
// --cuda-graph captures one training step in a CUDA graph and replays it (GPU only).
// --shadow N runs every layer again in float32 every N steps (mpx::model_shadow) and
// prints, after training, each layer's error against its float32 twin: which layer
// costs the model its precision. The training itself is unchanged.
// --probe prints, before training, the share of each parameter's gradients that a
// batch loses at each loss scale (mpx::probe_loss_scales): why a scale is needed.
// --csv FILE writes one log per policy, FILE.<policy>.csv (one row per step); --plot
// FILE.png draws them with scripts/plot_run.py (python3 and matplotlib), one colour per
// policy, writing the logs next to the PNG when --csv is not given.
//
// --data-parallel trains one replica per process, under mpirun: each takes its share of
// every global batch of --batch-size samples, the gradients are averaged over the ranks
// (MPI between host processes; NCCL between GPUs, one per process) and every rank takes
// the same step. Only rank 0 prints. docs/data_parallel.md has the launch lines:
//   mpirun -np 2 build/examples/fashion_mnist --data-parallel
//
// Without a GPU the default is one epoch of the 60,000 training images on the host, about
// 70 seconds on two cores; on a GPU, five epochs.
#include <mpx/mpx.hpp>
#if MPX_EXAMPLE_HAS_MPI
#include <mpx/dist/data_parallel.hpp>
#include <mpx/dist/mpi_communicator.hpp>
#if MPX_HAS_CUDA
#include <mpx/dist/nccl_communicator.hpp>
#endif
#endif

#include "../common/command_line.hpp"
#include "../common/memory_peak.hpp"

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

struct settings {
  std::string policy = "mixed_float16";
  std::string executor = "auto";
  std::size_t epochs = 0;      // 0: 5 on a GPU, 1 on the host
  std::size_t batch_size = 64;
  std::size_t train_limit = 0; // 0: all 60,000
  std::size_t test_limit = 0;  // 0: all 10,000
  std::string data = std::string(mpx::fashion_mnist_default_directory);
  std::string csv;
  std::string plot;  // a PNG drawn from the CSV logs
  std::uint64_t seed = 1;
  bool cuda_graph = false;
  bool probe = false;  // print probe_loss_scales on the first batch before training
  std::size_t shadow = 0;  // measure each layer against its float32 twin every N steps
  bool data_parallel = false;
};

// The job this process belongs to: one rank of one without --data-parallel.
struct cluster {
  int rank = 0;
  int ranks = 1;
#if MPX_EXAMPLE_HAS_MPI
  mpx::mpi_communicator* mpi = nullptr;
#if MPX_HAS_CUDA
  mpx::nccl_communicator* nccl = nullptr;
#endif
#endif
};

// Calls train(hooks) with this process as one replica of the job (MPI on the host, NCCL
// on a GPU), or as the only one.
template <class Exec, class Optimizer, class Train>
void as_replica(Exec const& exec, cluster const& c, Optimizer& optimizer, Train&& train) {
#if MPX_EXAMPLE_HAS_MPI
  if constexpr (mpx::is_host_executor_v<Exec>) {
    if (c.mpi) {
      mpx::data_parallel dp(exec, *c.mpi, optimizer);
      train(dp.hooks());
      return;
    }
  } else {
#if MPX_HAS_CUDA
    if (c.nccl) {
      mpx::data_parallel dp(exec, *c.nccl, optimizer);
      train(dp.hooks());
      return;
    }
#endif
  }
#endif
  static_cast<void>(exec);
  static_cast<void>(c);
  static_cast<void>(optimizer);
  train(mpx::replica_hooks{});
}

struct outcome {
  std::string policy;
  std::string csv;  // its log, if one was written
  double seconds_per_epoch = 0;
  double test_accuracy = 0;
  double test_loss = 0;
  std::size_t skipped_steps = 0;
  float final_scale = 0;
  double peak_memory_mib = 0;
  std::string memory_kind;
  int ranks = 1;
};

// The model of the header comment, under policy P, with Keras's float32 softmax. The
// first and last layers are kept out of fp8 (mpx::without_fp8<P> is P under every other
// policy): the first sees raw pixels through 9-tap windows, the last makes the logits.
template <class P>
auto make_cnn() {
  using mpx::activation;
  using outside_fp8 = mpx::without_fp8<P>;
  return mpx::sequential<P>(mpx::conv2d<outside_fp8>(32, 3, activation::relu), mpx::max_pool2d<>(2),
                            mpx::conv2d<>(64, 3, activation::relu), mpx::max_pool2d<>(2), mpx::flatten<>(),
                            mpx::dense<>(128, activation::relu), mpx::dense<outside_fp8>(10),
                            mpx::softmax_layer<mpx::float32>());
}

template <class P, class Exec>
outcome train(Exec const& exec, settings const& s, cluster const& job, mpx::image_dataset const& train_set,
              mpx::image_dataset const& test_set) {
  using storage = typename P::storage_type;
  constexpr bool on_gpu = !mpx::is_host_executor_v<Exec>;
  mpx_programs::memory_peak<Exec> const peak;  // this run's, from here

  auto model = make_cnn<P>();
  model.build(exec, {28, 28, 1}, s.seed);
  std::printf("\n== %s on the %s executor\n%s", std::string(P::name).c_str(), on_gpu ? "cuda" : "host",
              model.summary().c_str());

  // With several ranks each takes its share of every global batch (and of the test set).
  auto const rank = static_cast<std::size_t>(job.rank), ranks = static_cast<std::size_t>(job.ranks);
  mpx::batch_loader<Exec, storage> train_batches(
      exec, train_set,
      {.batch_size = s.batch_size / ranks, .shuffle = true, .seed = s.seed, .replica = rank, .replicas = ranks});
  mpx::batch_loader<Exec, storage> test_batches(
      exec, test_set,
      {.batch_size = 500, .shuffle = false, .replica = rank, .replicas = ranks, .shard_by = mpx::sharding::whole_batches});
  if (s.probe) {
    train_batches.start_epoch(0);
    if (auto const first = train_batches.next())
      std::printf("\nThe first batch's gradients at each loss scale (mpx::probe_loss_scales):\n%s",
                  mpx::probe_loss_scales(exec, model, first->images, first->labels).to_string().c_str());
  }

  // Keras scales the loss only for float16; a static scale of 1 keeps the check and skip.
  constexpr bool float16 = std::is_same_v<storage, mpx::half>;
  // The master copy the policy asks for: float, or none (stochastic rounding) under bfloat16.
  auto adam = mpx::adam(exec, model.parameters(exec), 1e-3f, {}, mpx::master_weights_for<P>(true, s.seed));
  outcome o;
  o.policy = std::string(P::name);
  o.ranks = job.ranks;
  auto run = [&](auto& optimizer) {
    mpx::fit_options options;
    options.epochs = s.epochs;
    options.cuda_graph = s.cuda_graph;
    options.shadow_every = s.shadow;
    if (!s.csv.empty()) options.csv_log = o.csv = s.csv + "." + o.policy + ".csv";
    std::vector<mpx::epoch_summary> history;
    as_replica(exec, job, optimizer, [&](mpx::replica_hooks hooks) {
      options.replicas = std::move(hooks);
      history = mpx::fit(exec, model, optimizer, train_batches, options, &test_batches);
    });
    double total = 0;
    for (auto const& e : history) {
      total += e.seconds;
      o.skipped_steps += e.skipped_steps;
    }
    o.seconds_per_epoch = total / static_cast<double>(history.size());
    o.test_accuracy = history.back().validation.accuracy;
    o.test_loss = history.back().validation.loss;
    o.final_scale = history.back().loss_scale;
  };
  if constexpr (float16) {
    mpx::loss_scale_optimizer optimizer(std::move(adam), mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    run(optimizer);
  } else {
    mpx::loss_scale_optimizer optimizer(std::move(adam), mpx::static_loss_scaler(exec, 1.0f));
    run(optimizer);
  }

  o.peak_memory_mib = peak.mib();
  o.memory_kind = peak.kind();
  return o;
}

template <class Exec>
std::vector<outcome> train_policies(Exec const& exec, settings const& s, cluster const& job,
                                    mpx::image_dataset const& train_set, mpx::image_dataset const& test_set) {
  std::vector<outcome> out;
  std::vector<std::string> names = {s.policy};
  if (s.policy == "all")
    names = {"mixed_float16", "mixed_bfloat16", "float32", "bfloat16", "mixed_fp8", "mixed_fp8_current", "mixed_fp8_block", "mixed_fp8_rowwise", "mixed_mxfp8", "mixed_nvfp4"};
  for (auto const& name : names) {
    try {
      mpx::with_policy(name, [&](auto p) { out.push_back(train<typename decltype(p)::type>(exec, s, job, train_set, test_set)); });
    } catch (mpx::invalid_argument const& e) {
      // Under --policy all a preset this device cannot run (the block-scaled ones want a
      // given GPU generation, refused before anything runs) is reported and skipped, so
      // the others still make the table.
      if (s.policy != "all") throw;
      std::printf("%s skipped on this device: %s\n", name.c_str(), e.what());
    }
  }
  return out;
}

constexpr char const* usage_text =
    "[--policy mixed_float16|mixed_bfloat16|float32|bfloat16|mixed_fp8|mixed_fp8_current|mixed_fp8_block|mixed_fp8_rowwise|mixed_mxfp8|mixed_nvfp4|all]\n"
    "          [--epochs N] [--batch-size N] [--executor auto|host|cuda] [--train-limit N] [--test-limit N]\n"
    "          [--data DIR] [--csv FILE] [--plot FILE.png] [--seed N] [--cuda-graph] [--probe]\n"
    "          [--shadow N] [--data-parallel]";

settings parse(int argc, char** argv) {
  settings s;
  mpx_programs::command_line args(argc, argv, usage_text);
  while (args.next()) {
    if (args.is("--policy"))
      s.policy = args.choice({"mixed_float16", "mixed_bfloat16", "float32", "bfloat16", "mixed_fp8", "mixed_fp8_current", "mixed_fp8_block",
                              "mixed_fp8_rowwise", "mixed_mxfp8", "mixed_nvfp4", "all"});
    else if (args.is("--epochs")) s.epochs = args.whole<std::size_t>(1, 1000);
    else if (args.is("--batch-size")) s.batch_size = args.whole<std::size_t>(1, 60000, " (the training set's size)");
    else if (args.is("--executor")) s.executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--train-limit")) s.train_limit = args.whole<std::size_t>(1, 60000, " (the training set's size)");
    else if (args.is("--test-limit")) s.test_limit = args.whole<std::size_t>(1, 10000, " (the test set's size)");
    else if (args.is("--data")) s.data = args.text();
    else if (args.is("--csv")) s.csv = args.text();
    else if (args.is("--plot")) s.plot = args.text();
    else if (args.is("--seed")) s.seed = args.whole<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max());
    else if (args.is("--cuda-graph")) s.cuda_graph = true;
    else if (args.is("--probe")) s.probe = true;
    else if (args.is("--shadow")) s.shadow = args.whole<std::size_t>(1, 1000000);
    else if (args.is("--data-parallel")) s.data_parallel = true;
    else args.unknown();
  }
  if (!s.plot.empty() && s.csv.empty()) {  // the logs go next to the PNG: run.png -> run.<policy>.csv
    std::filesystem::path const png = s.plot;
    s.csv = (png.parent_path() / png.stem()).string();
  }
  return s;
}

// scripts/plot_run.py: where the build says the source tree has it, else next to this
// program (an installed copy).
std::filesystem::path plot_script() {
#ifdef MPX_PLOT_RUN_SCRIPT
  if (std::filesystem::exists(MPX_PLOT_RUN_SCRIPT)) return MPX_PLOT_RUN_SCRIPT;
#endif
  std::error_code ec;
  auto const beside = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "plot_run.py";
  return !ec && std::filesystem::exists(beside) ? beside : std::filesystem::path{};
}

std::string shell_quoted(std::string const& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Draws the runs' logs into one PNG. A missing python3, matplotlib or script is said
// plainly and does not fail the program: the training it reports has already happened.
void draw_plot(std::vector<outcome> const& results, std::string const& png, std::string const& title) {
  auto const script = plot_script();
  if (script.empty()) {
    std::printf("\n--plot: scripts/plot_run.py was not found; not drawing %s (the CSV logs are written)\n", png.c_str());
    return;
  }
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) {
    std::printf("\n--plot: python3 is not on PATH; not drawing %s (the CSV logs are written)\n", png.c_str());
    return;
  }
  std::string command = "python3 " + shell_quoted(script.string());
  for (auto const& r : results) command += " " + shell_quoted(r.csv);
  command += " -o " + shell_quoted(png) + " --title " + shell_quoted(title);
  std::printf("\n");
  std::fflush(stdout);
  int const status = std::system(command.c_str());
  int const code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 3)
    std::printf("--plot: matplotlib is missing (pip install matplotlib); the CSV logs are written\n");
  else if (code != 0)
    std::printf("--plot: %s failed (exit %d); the CSV logs are written\n", script.c_str(), code);
}

bool gpu_available() {
#if MPX_HAS_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) try {
  settings s = parse(argc, argv);
  bool const gpu = gpu_available();
  if (s.executor == "cuda" && !gpu) {
#if MPX_HAS_CUDA
    throw mpx::error("--executor cuda: no GPU is visible to this process");
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc; rebuild with -Dcuda=enabled");
#endif
  }
  bool const use_gpu = s.executor == "cuda" || (s.executor == "auto" && gpu);
  if (s.epochs == 0) s.epochs = use_gpu ? 5 : 1;

  cluster job;
#if MPX_EXAMPLE_HAS_MPI
  std::optional<mpx::mpi_environment> mpi;
  std::optional<mpx::mpi_communicator> world;
#if MPX_HAS_CUDA
  std::optional<mpx::nccl_communicator> gpus;
#endif
  if (s.data_parallel) {
    mpi.emplace(argc, argv);
    world.emplace();
    job.mpi = &*world;
    job.rank = world->rank();
    job.ranks = world->size();
    if (s.batch_size % static_cast<std::size_t>(job.ranks) != 0)
      throw mpx::invalid_argument("--batch-size " + std::to_string(s.batch_size) + " is the global batch: it must split evenly over " +
                                  std::to_string(job.ranks) + " ranks");
#if MPX_HAS_CUDA
    if (use_gpu) {
      int devices = 0;
      MPX_CUDA_CHECK(cudaGetDeviceCount(&devices));
      MPX_CUDA_CHECK(cudaSetDevice(job.rank % devices));  // one GPU per rank (a node's ranks share them out)
      gpus.emplace(mpx::cuda_executor{}, *world);
      job.nccl = &*gpus;
    }
#endif
    // Only rank 0 speaks; the others' errors still reach stderr.
    if (job.rank != 0 && !std::freopen("/dev/null", "w", stdout))
      throw mpx::error("rank " + std::to_string(job.rank) + ": cannot silence stdout");
  }
#else
  if (s.data_parallel)
    throw mpx::error("--data-parallel: this binary was built without MPI (install libopenmpi-dev: scripts/setup.sh does)");
#endif
  if (s.train_limit == 0) s.train_limit = 60000;

  auto const t0 = std::chrono::steady_clock::now();
  mpx::image_dataset const train_set =
      mpx::load_fashion_mnist(s.data, mpx::dataset_split::train, {.limit = s.train_limit});
  mpx::image_dataset const test_set =
      mpx::load_fashion_mnist(s.data, mpx::dataset_split::test, {.limit = s.test_limit ? s.test_limit : 10000});
  std::printf("Fashion-MNIST: %zu training and %zu test images of 28x28 from %s (%.1f s to load)\n", train_set.size(),
              test_set.size(), s.data.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("policy %s, %zu epoch(s), batch %zu, Adam(1e-3), %s executor\n", s.policy.c_str(), s.epochs,
              s.batch_size, use_gpu ? "cuda" : "host");
  if (s.data_parallel)
    std::printf("data-parallel: %d rank(s) (%s), each takes %zu samples of every global batch of %zu\n", job.ranks,
                use_gpu ? "NCCL between GPUs" : "MPI between host processes", s.batch_size / static_cast<std::size_t>(job.ranks),
                s.batch_size);

  std::vector<outcome> results;
  if (use_gpu) {
#if MPX_HAS_CUDA
    results = train_policies(mpx::cuda_executor{}, s, job, train_set, test_set);
#endif
  } else {
    results = train_policies(mpx::host_executor{}, s, job, train_set, test_set);
  }

  std::printf("\n%-16s %6s %14s %14s %12s %10s %12s  %s\n", "policy", "ranks", "s / epoch", "test accuracy",
              "test loss", "skipped", "final scale", "peak memory");
  for (auto const& r : results)
    std::printf("%-16s %6d %14.2f %13.2f%% %12.4f %10zu %12g  %.0f MiB %s%s\n", r.policy.c_str(), r.ranks,
                r.seconds_per_epoch, 100 * r.test_accuracy, r.test_loss, r.skipped_steps,
                static_cast<double>(r.final_scale), r.peak_memory_mib, r.memory_kind.c_str(),
                r.ranks > 1 ? " (rank 0)" : "");
  if (!use_gpu)
    std::printf("\nNo GPU was used: this ran on the host executor (%zu training images, %zu epoch(s)).\n"
                "On a GPU the same program, built with nvcc, runs the products on tensor cores through cuBLASLt\n"
                "and trains 5 epochs by default; the target is at least 90%% test accuracy under each policy, the\n"
                "mixed ones within half a point of float32 (docs/performance.md says what has been measured).\n",
                train_set.size(), s.epochs);
  if (!s.plot.empty())
    draw_plot(results, s.plot,
              "Fashion-MNIST CNN: " + std::to_string(train_set.size()) + " images, " + std::to_string(s.epochs) +
                  " epoch(s), batch " + std::to_string(s.batch_size) + ", " + (use_gpu ? "cuda" : "host") +
                  " executor");
  return 0;
} catch (...) {
#if MPX_EXAMPLE_HAS_MPI
  // Other ranks may be waiting for this one in a collective: end the whole job.
  if (mpx::mpi_environment::active())
    mpx::mpi_environment::abort(1, "fashion_mnist: " + mpx_programs::current_failure().what);
#endif
  return mpx_programs::report_failure("fashion_mnist");
}
