// A run stopped and resumed from its checkpoint continues exactly as if it had not
// stopped: a child process trains N steps, saves, and is killed (SIGKILL); the parent
// resumes from the checkpoint and trains M more. Parameters, master weights, Adam's
// moments and step count (the learning-rate schedule's position), the loss scaler's
// state, batch norm's running statistics, dropout's mask counter, the data order and
// every step's loss must equal those of one uninterrupted N + M step run, bit for bit,
// on the host executor; also when the last step before the save was skipped (a NaN).
#include "../support/testing.hpp"

// Host only: the CUDA suite reaches training_state.hpp through test_model.cpp's round trip.
#if !MPX_HAS_CUDA

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace test_resume {

namespace fs = std::filesystem;
using exec_type = mpx::host_executor;

fs::path scratch(std::string const& name) {
  fs::path const d = fs::temp_directory_path() / ("mpx_test_resume_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// 6x6 one-channel images: noise plus a bright row whose position is the class.
mpx::image_dataset make_data(std::size_t n) {
  mpx::image_dataset d;
  d.num_classes = 3;
  auto noise = mpx_test::random_values<float>(n * 36, 0.0, 0.5, 77);
  d.images = mpx::tensor<float>(mpx::shape{static_cast<std::int64_t>(n), 6, 6, 1});
  for (std::size_t i = 0; i < n; ++i) {
    auto const label = static_cast<std::int32_t>(i % 3);
    d.labels.push_back(label);
    for (std::size_t p = 0; p < 36; ++p)
      d.images.data()[i * 36 + p] = noise[i * 36 + p] + (p / 6 == static_cast<std::size_t>(2 * label) ? 1.0f : 0.0f);
  }
  return d;
}

auto make_model() {
  return mpx::sequential<mpx::mixed_float16>(mpx::flatten<>(), mpx::dense<>(24, mpx::activation::relu),
                                             mpx::batch_norm<>(), mpx::dropout<>(0.3f), mpx::dense<>(3),
                                             mpx::softmax_layer<mpx::float32>());
}

// Adam on a warm-up + cosine schedule (so the schedule's position matters), and a
// dynamic loss scale that grows every 3 finite steps (so the scaler's counters matter).
auto make_optimizer(exec_type const& exec, auto& model) {
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 256.0f;
  rule.growth_interval = 3;
  return mpx::loss_scale_optimizer(
      mpx::adam(exec, model.parameters(exec), mpx::cosine_decay{.peak_rate = 1e-2f, .decay_steps = 40, .warmup_steps = 5}),
      mpx::dynamic_loss_scaler(exec, rule));
}

struct run_log {
  std::vector<mpx::step_record> steps;
  std::vector<std::vector<std::size_t>> samples;  // each step's samples, in order
};

// Runs `count` steps from `from`; the step with global index `poisoned_step` gets a NaN
// in its first image (its update must be skipped). Returns where the run stopped.
template <class Model, class Optimizer>
mpx::training_position train(exec_type const& exec, Model& model, Optimizer& optimizer,
                             mpx::batch_loader<exec_type, mpx::half>& loader, mpx::training_position from,
                             std::size_t count, std::size_t poisoned_step, run_log& log) {
  mpx::classifier_trainer trainer(exec, model, optimizer);
  mpx::training_position at = from;
  loader.start_epoch(at.epoch, at.batch);
  for (std::size_t done = 0; done < count; ++done) {
    auto batch = loader.next();
    if (!batch) {
      ++at.epoch;
      at.batch = 0;
      loader.start_epoch(at.epoch);
      batch = loader.next();
    }
    log.samples.emplace_back(batch->samples.begin(), batch->samples.end());
    if (at.steps == poisoned_step) {
      auto images = mpx::make_tensor<mpx::half>(exec, batch->images.shape());
      mpx::copy(exec, batch->images, images);
      images.data()[0] = mpx::dtype_traits<mpx::half>::quiet_nan();
      trainer.step(exec, mpx::view(std::as_const(images)), batch->labels);
    } else {
      trainer.step(exec, batch->images, batch->labels);
    }
    ++at.batch;
    ++at.steps;
  }
  for (auto const& r : trainer.history(exec)) log.steps.push_back(r);
  return at;
}

std::vector<char> file_bytes(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool same_bits(mpx::step_record const& a, mpx::step_record const& b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// Everything a run's state holds, compared through the files save_training_state
// writes (every parameter, master weight, moment, counter and the scaler's state) and
// through the model's outputs in inference mode.
void require_same_state(fs::path const& a, fs::path const& b) {
  for (std::string const prefix : {"model-", "optimizer-"}) {
    auto find = [&](fs::path const& dir) {
      for (auto const& e : fs::directory_iterator(dir))
        if (e.path().filename().string().starts_with(prefix)) return e.path();
      FAIL("no " << prefix << " file in " << dir);
      return fs::path();
    };
    auto const fa = file_bytes(find(a)), fb = file_bytes(find(b));
    INFO(prefix << " files: " << fa.size() << " and " << fb.size() << " bytes");
    REQUIRE(fa.size() > 100);
    REQUIRE(fa == fb);
  }
}

struct resume_case {
  std::size_t first = 0, second = 0;  // steps before and after the interruption
  std::size_t poisoned = 0;           // global index of the step with a NaN input
};

void check_resume(resume_case const& c) {
  exec_type exec;
  auto const data = make_data(100);  // batches of 16: 7 per epoch, the last one short
  mpx::batch_options const batches{.batch_size = 16, .shuffle = true, .seed = 11};
  fs::path const root = scratch("s" + std::to_string(c.first) + "_" + std::to_string(c.poisoned));
  INFO("N=" << c.first << " M=" << c.second << " NaN at step " << c.poisoned);

  // The uninterrupted run: N + M steps in one process.
  run_log whole;
  {
    auto model = make_model();
    model.build(exec, {6, 6, 1}, 3);
    auto optimizer = make_optimizer(exec, model);
    mpx::batch_loader<exec_type, mpx::half> loader(exec, data, batches);
    auto const end = train(exec, model, optimizer, loader, {}, c.first + c.second, c.poisoned, whole);
    mpx::save_training_state(exec, model, optimizer, root / "whole", end);
  }
  REQUIRE(whole.steps.size() == c.first + c.second);
  REQUIRE(whole.steps[c.poisoned].skipped == 1);

  // The interrupted run: a child trains N steps, saves, and is killed before it can
  // do anything else (no destructor, no flush of anything but the checkpoint).
  ::fflush(nullptr);
  pid_t const child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int status = 0;
    try {
      auto model = make_model();
      model.build(exec, {6, 6, 1}, 3);
      auto optimizer = make_optimizer(exec, model);
      mpx::batch_loader<exec_type, mpx::half> loader(exec, data, batches);
      run_log first;
      auto const at = train(exec, model, optimizer, loader, {}, c.first, c.poisoned, first);
      mpx::save_training_state(exec, model, optimizer, root / "resumed", at);
    } catch (...) {
      status = 3;
    }
    if (status == 0) ::raise(SIGKILL);
    ::_exit(status);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(WTERMSIG(status) == SIGKILL);

  // The resumed run: a fresh process state (another initialisation seed), the
  // checkpoint loaded, M more steps from where it says the run was.
  run_log second;
  {
    auto model = make_model();
    model.build(exec, {6, 6, 1}, 99);
    auto optimizer = make_optimizer(exec, model);
    mpx::batch_loader<exec_type, mpx::half> loader(exec, data, batches);
    mpx::training_position const at = mpx::load_training_state(exec, model, optimizer, root / "resumed");
    CHECK(at.steps == c.first);
    auto const end = train(exec, model, optimizer, loader, at, c.second, c.poisoned, second);
    mpx::save_training_state(exec, model, optimizer, root / "resumed", end);
  }
  REQUIRE(second.steps.size() == c.second);
  for (std::size_t i = 0; i < c.second; ++i) {
    INFO("step " << c.first + i);
    REQUIRE(second.samples[i] == whole.samples[c.first + i]);  // the data order
    auto const& g = second.steps[i];
    auto const& w = whole.steps[c.first + i];
    INFO("resumed: loss " << g.loss << " scale " << g.loss_scale << " skipped " << g.skipped << " norm "
                          << g.gradient_norm << " correct " << g.correct << "; uninterrupted: loss " << w.loss
                          << " scale " << w.loss_scale << " skipped " << w.skipped << " norm " << w.gradient_norm
                          << " correct " << w.correct);
    REQUIRE(same_bits(g, w));  // loss, scale, skip, norm, accuracy
  }
  require_same_state(root / "whole", root / "resumed");
  if (!std::getenv("MPX_KEEP")) fs::remove_all(root);
}

}  // namespace test_resume

TEST_CASE("a run killed after its checkpoint and resumed equals the uninterrupted run bit for bit", "[model][resume]") {
  // Mid-epoch (step 10 of 7-batch epochs), with the NaN step long before.
  test_resume::check_resume({.first = 10, .second = 12, .poisoned = 4});
  // Right after a skipped step: the last step before the save had a NaN.
  test_resume::check_resume({.first = 9, .second = 9, .poisoned = 8});
  // At an epoch boundary, the NaN step after the resume.
  test_resume::check_resume({.first = 7, .second = 8, .poisoned = 11});
}

TEST_CASE("a resumed run without its layer counters would draw other dropout masks", "[model][resume]") {
  // The test above must be able to fail: the same run resumed from the model and
  // optimizer files alone (dropout's counter left at zero) diverges.
  mpx::host_executor exec;
  auto const data = test_resume::make_data(48);
  mpx::batch_options const batches{.batch_size = 16, .shuffle = true, .seed = 11};
  auto const root = test_resume::scratch("counters");
  test_resume::run_log whole, first, second;
  auto model = test_resume::make_model();
  model.build(exec, {6, 6, 1}, 3);
  auto optimizer = test_resume::make_optimizer(exec, model);
  mpx::batch_loader<mpx::host_executor, mpx::half> loader(exec, data, batches);
  auto const at = test_resume::train(exec, model, optimizer, loader, {}, 4, 1000, first);
  mpx::save_training_state(exec, model, optimizer, root, at);
  test_resume::train(exec, model, optimizer, loader, at, 3, 1000, whole);

  auto fresh = test_resume::make_model();
  fresh.build(exec, {6, 6, 1}, 3);
  auto fresh_optimizer = test_resume::make_optimizer(exec, fresh);
  mpx::training_position const loaded = mpx::load_training_state(exec, fresh, fresh_optimizer, root);
  CHECK(loaded == at);
  // Dropout's counter back to where a fresh layer starts, as if it had not been saved.
  auto counters = mpx::detail::model_counters<mpx::host_space>(fresh);
  REQUIRE(counters.size() == 1);
  *counters[0].second.data() = 0;
  mpx::batch_loader<mpx::host_executor, mpx::half> loader2(exec, data, batches);
  test_resume::train(exec, fresh, fresh_optimizer, loader2, loaded, 3, 1000, second);
  bool all_same = true;
  for (std::size_t i = 0; i < 3; ++i) all_same = all_same && test_resume::same_bits(second.steps[i], whole.steps[i]);
  CHECK_FALSE(all_same);
  std::filesystem::remove_all(root);
}

TEST_CASE("load_training_state refuses a damaged or mismatched save and changes nothing", "[model][resume]") {
  mpx::host_executor exec;
  auto const data = test_resume::make_data(48);
  auto const root = test_resume::scratch("refuse");
  auto model = test_resume::make_model();
  model.build(exec, {6, 6, 1}, 3);
  auto optimizer = test_resume::make_optimizer(exec, model);
  mpx::batch_loader<mpx::host_executor, mpx::half> loader(exec, data, {.batch_size = 16});
  test_resume::run_log log;
  auto const at = test_resume::train(exec, model, optimizer, loader, {}, 2, 1000, log);
  CHECK_FALSE(mpx::has_training_state(root));  // resume-if-present: nothing here yet
  mpx::save_training_state(exec, model, optimizer, root, at);
  CHECK(mpx::has_training_state(root));
  CHECK_FALSE(mpx::has_training_state(root / "nothing"));
  // A second save replaces the first pair and removes its files.
  mpx::save_training_state(exec, model, optimizer, root, at);
  std::size_t files = 0;
  for ([[maybe_unused]] auto const& e : std::filesystem::directory_iterator(root)) ++files;
  CHECK(files == 3);

  // A model without dropout keeps no counter: the save does not describe it.
  auto other = mpx::sequential<mpx::mixed_float16>(mpx::flatten<>(), mpx::dense<>(24, mpx::activation::relu),
                                                   mpx::batch_norm<>(), mpx::dense<>(3),
                                                   mpx::softmax_layer<mpx::float32>());
  other.build(exec, {6, 6, 1}, 5);
  auto other_optimizer = test_resume::make_optimizer(exec, other);
  CHECK_THROWS_TYPE_WITH(mpx::load_training_state(exec, other, other_optimizer, root), mpx::checkpoint_error,
                         Catch::Contains("layer counters"));

  // The optimizer's file damaged: refused after the model's was read; the model must be
  // as it was before the load.
  auto fresh = test_resume::make_model();
  fresh.build(exec, {6, 6, 1}, 42);
  auto fresh_optimizer = test_resume::make_optimizer(exec, fresh);
  std::vector<std::vector<std::byte>> const before = mpx::detail::snapshot_model(exec, fresh);
  for (auto const& e : std::filesystem::directory_iterator(root)) {
    if (!e.path().filename().string().starts_with("optimizer-")) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x5a');
  }
  CHECK_THROWS_TYPE_WITH(mpx::load_training_state(exec, fresh, fresh_optimizer, root), mpx::checkpoint_error,
                         Catch::Contains("optimizer-"));
  CHECK(mpx::detail::snapshot_model(exec, fresh) == before);

  // No save at all.
  CHECK_THROWS_TYPE_WITH(mpx::load_training_state(exec, fresh, fresh_optimizer, root / "nothing"),
                         mpx::checkpoint_error, Catch::Contains("training_state.mpx"));
  // A start past the epoch's end is refused by the loader.
  CHECK_THROWS_AS(loader.start_epoch(0, 4), mpx::invalid_argument);
  std::filesystem::remove_all(root);
}
#endif
