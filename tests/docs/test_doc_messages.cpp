// Every message docs/ quotes, made by the code and held to the quote
// (support/doc_quotes.hpp): optimizers and their checkpoints, the order of a training
// step, models run where they were built, the stuck loss scale, fp8 placement notes,
// tensors, data files and the attention diagnosis.
#include "../support/doc_quotes.hpp"
#include "../support/testing.hpp"

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/policy_names.hpp>
#include <mpx/data/dataset.hpp>
#include <mpx/data/idx.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/kernels/lstm.hpp>
#include <mpx/layers/attention.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/model/diagnostics.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

// One translation unit per folder under nvcc: this file's names live in its namespace.
namespace doc_messages {

namespace fs = std::filesystem;
using mpx_test::check_doc_quote;
using mpx_test::message_of;

fs::path scratch(std::string const& name) {
  fs::path const d = fs::temp_directory_path() / ("mpx_test_doc_messages_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

template <class Exec>
auto trained_model(Exec const& exec) {
  auto model = mpx::sequential<mpx::float32>(mpx::dense<>(4, mpx::activation::relu), mpx::dense<>(3));
  model.build(exec, {2}, 1);
  return model;
}

template <class Exec, class Model>
void forward_and_backward(Exec const& exec, Model& model) {
  auto const x = mpx_test::upload(exec, std::vector<float>{0.5f, -1.0f, 2.0f, 0.25f}, mpx::shape{2, 2});
  auto const dy = mpx_test::upload(exec, std::vector<float>{0.1f, -0.2f, 0.3f, 0.4f, 0.5f, -0.6f}, mpx::shape{2, 3});
  model.forward(exec, x.view(), true);
  model.backward_from_logits(exec, dy.view());
}

TEMPLATE_LIST_TEST_CASE("docs/optimizers.md: the parameter checks and the step that needs a backward",
                        "[docs]", mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  using params = std::vector<mpx::parameter<Space>>;
  auto w = mpx::make_tensor<float>(exec, {4, 3});
  auto transposed = mpx::make_tensor<float>(exec, {3, 4});
  check_doc_quote("optimizers.md",
                  "mpx::sgd: parameter 'dense/kernel' has shape [4, 3] but its gradient has shape [3, 4] (at ...)",
                  message_of([&] { mpx::sgd(exec, params{{"dense/kernel", w, transposed}}, 0.1f); }));
  auto h = mpx::make_tensor<mpx::half>(exec, {4, 3});
  check_doc_quote("optimizers.md", "mpx::adam: parameter 'dense/kernel' is float16 but its gradient is float32 (at ...)",
                  message_of([&] { mpx::adam(exec, params{{"dense/kernel", h, w}}, 0.1f); }));

  auto g = mpx::make_tensor<float>(exec, {4, 3});
  auto g2 = mpx::make_tensor<float>(exec, {4, 3});
  check_doc_quote("optimizers.md",
                  "mpx::sgd: the value of 'a' and the value of 'b' overlap in memory (a parameter listed twice? each "
                  "value and gradient needs memory of its own) (at ...)",
                  message_of([&] { mpx::sgd(exec, params{{"a", w, g}, {"b", w, g2}}, 0.1f); }));
  check_doc_quote("optimizers.md", "weight_decay must be finite and >= 0, got nan", message_of([&] {
                    mpx::adamw(exec, params{{"w", w, g}}, 0.1f, {.weight_decay = std::nanf("")});
                  }));
  check_doc_quote("optimizers.md", "dampening must be finite, got inf", message_of([&] {
                    mpx::sgd(exec, params{{"w", w, g}}, 0.1f, {.momentum = 0.9f, .dampening = HUGE_VALF});
                  }));

  auto model = trained_model(exec);
  mpx::adam optimizer(exec, model.parameters(exec), 1e-3f);
  check_doc_quote("optimizers.md",
                  "mpx::adam: a step before any backward: the gradients (e.g. 'dense/kernel') are the zeros the model "
                  "was built with. Run forward(exec, x, true) and backward before each step, or call "
                  "allow_step_without_backward(true) if you wrote the gradients yourself (at ...)",
                  message_of([&] { optimizer.step(exec); }));
  forward_and_backward(exec, model);
  optimizer.step(exec);
  check_doc_quote("optimizers.md",
                  "mpx::adam: a second step with no backward since the last one: the gradients (e.g. 'dense/kernel') "
                  "are the ones the last step already applied. ...",
                  message_of([&] { optimizer.step(exec); }));
}

TEST_CASE("docs/pytorch.md: a refused Adam option", "[docs]") {
  mpx::host_executor exec;
  auto model = trained_model(exec);
  check_doc_quote("pytorch.md", "mpx::adam: beta1 and beta2 must lie in [0, 1), got 1 and 0.999 (at ...)",
                  message_of([&] { mpx::adam(exec, model.parameters(exec), 1e-3f, {.beta1 = 1.0f}); }));
}

TEST_CASE("docs/optimizers.md: every checkpoint refusal in its table says what the table says", "[docs]") {
  mpx::host_executor exec;
  auto const dir = scratch("checkpoints");
  auto model = trained_model(exec);
  auto adam_lso = [&](auto& m) {
    return mpx::loss_scale_optimizer(mpx::adam(exec, m.parameters(exec), 1e-3f),
                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  };
  auto saved = adam_lso(model);
  forward_and_backward(exec, model);
  saved.step(exec);
  fs::path const good = dir / "good.mpx";
  saved.save(exec, good);
  std::string const prefix = "mpx::checkpoint: refusing '<path>': ";
  auto refusal = [&](std::string const& row, auto&& load) {
    std::string const message = message_of(load);
    CHECK(mpx_test::message_matches_quote(message, prefix));
    check_doc_quote("optimizers.md", row, message);
  };

  auto fresh = trained_model(exec);
  auto receiver = adam_lso(fresh);
  refusal("cannot open it: No such file or directory", [&] { receiver.load(exec, dir / "missing.mpx"); });
  refusal("it is a directory", [&] { receiver.load(exec, dir); });
  std::ofstream(dir / "text.mpx") << "not a checkpoint";
  refusal("it is not an mpx checkpoint (no MPXCKPT header)", [&] { receiver.load(exec, dir / "text.mpx"); });
  fs::copy_file(good, dir / "short.mpx");
  fs::resize_file(dir / "short.mpx", fs::file_size(good) - 5);
  refusal("its checksum does not match: the file is truncated: its contents claim <n> bytes, it holds <m>",
          [&] { receiver.load(exec, dir / "short.mpx"); });
  CHECK_THAT(message_of([&] { receiver.load(exec, dir / "short.mpx"); }),
             Catch::Contains("claim " + std::to_string(fs::file_size(good)) + " bytes, it holds " +
                             std::to_string(fs::file_size(good) - 5)));
  fs::copy_file(good, dir / "changed.mpx");
  {
    std::fstream f(dir / "changed.mpx", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(good) / 2));
    f.put('\x77');
  }
  refusal("its checksum does not match: the file is corrupt (a byte changed)",
          [&] { receiver.load(exec, dir / "changed.mpx"); });
  fs::copy_file(good, dir / "version2.mpx");
  {
    std::fstream f(dir / "version2.mpx", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);  // "MPXCKPT\0", then the version, little-endian
    f.put('\x02');
  }
  refusal("it has format version 2; this mpx reads version 1", [&] { receiver.load(exec, dir / "version2.mpx"); });
  {
    mpx::adam plain(exec, model.parameters(exec), 1e-3f);
    plain.save(exec, dir / "plain.mpx");
  }
  refusal("it holds a <kind>, not a mpx::loss_scale_optimizer", [&] { receiver.load(exec, dir / "plain.mpx"); });
  auto sgd_model = trained_model(exec);
  mpx::loss_scale_optimizer with_sgd(mpx::sgd(exec, sgd_model.parameters(exec), 0.1f),
                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  refusal("the checkpoint's optimizer differs from this one's:", [&] { with_sgd.load(exec, good); });
  // The location is the line of mpx that refused, not the checkpoint reader's helper.
  CHECK_THAT(message_of([&] { with_sgd.load(exec, good); }), Catch::Contains("optim/optimizer.hpp:"));
  check_doc_quote("optimizers.md",
                  "mpx::checkpoint: refusing '<path>': the checkpoint's optimizer differs from this one's: mpx::adam "
                  "expected: mpx::sgd (at ...)",
                  message_of([&] { with_sgd.load(exec, good); }));
  check_doc_quote("optimizers.md", "it holds a mpx::loss_scale_optimizer, not a mpx::optimizer", message_of([&] {
                    mpx::adam plain(exec, fresh.parameters(exec), 1e-3f);
                    plain.load(exec, good);
                  }));
  auto wider = mpx::sequential<mpx::float32>(mpx::dense<>(5, mpx::activation::relu), mpx::dense<>(3));
  wider.build(exec, {2}, 1);
  auto other_parameters = adam_lso(wider);
  refusal("the checkpoint's parameter list differs from this one's:", [&] { other_parameters.load(exec, good); });
  auto rounded_model = mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(4, mpx::activation::relu), mpx::dense<>(3));
  rounded_model.build(exec, {2}, 1);
  mpx::loss_scale_optimizer kept(mpx::sgd(exec, rounded_model.parameters(exec), 0.1f),
                                 mpx::static_loss_scaler(exec, 1.0f));
  kept.save(exec, dir / "kept.mpx");
  mpx::loss_scale_optimizer rounding(
      mpx::sgd(exec, rounded_model.parameters(exec), 0.1f, {},
               mpx::master_weight_options{.master = mpx::master_weights::none, .stochastic_rounding = true}),
      mpx::static_loss_scaler(exec, 1.0f));
  std::string const masters = message_of([&] { rounding.load(exec, dir / "kept.mpx"); });
  refusal("it was saved by an optimizer with master weights \"...\"; this one has \"...\"",
          [&] { rounding.load(exec, dir / "kept.mpx"); });
  check_doc_quote("optimizers.md",
                  "mpx::checkpoint: refusing '<path>': it was saved by an optimizer with master weights \"float32\"; "
                  "this one has \"none, stochastic rounding\" (make the optimizer with the same "
                  "mpx::master_weight_options)",
                  masters);
  auto momentum_model = trained_model(exec);
  mpx::loss_scale_optimizer momentum(mpx::sgd(exec, momentum_model.parameters(exec), 0.1f, {.momentum = 0.9f}),
                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  momentum.save(exec, dir / "momentum.mpx");
  refusal("the checkpoint's state kept per parameter differs from this one's:",
          [&] { with_sgd.load(exec, dir / "momentum.mpx"); });
  mpx::loss_scale_optimizer fixed_scale(mpx::adam(exec, fresh.parameters(exec), 1e-3f), mpx::static_loss_scaler(exec, 1.0f));
  fixed_scale.save(exec, dir / "static.mpx");
  refusal("the checkpoint's loss scaler is a mpx::static_loss_scaler, this one is a mpx::dynamic_loss_scaler; nothing "
          "was loaded",
          [&] { receiver.load(exec, dir / "static.mpx"); });
  {
    mpx::detail::checkpoint_writer hand_made("mpx::loss_scale_optimizer");
    hand_made.add("scaler/kind", mpx::detail::text_bytes("mpx::dynamic_loss_scaler"));
    hand_made.commit(dir / "no_state.mpx");
  }
  refusal("it has no section '...'", [&] { receiver.load(exec, dir / "no_state.mpx"); });
  {
    mpx::detail::checkpoint_writer hand_made("mpx::loss_scale_optimizer");
    hand_made.add("scaler/kind", mpx::detail::text_bytes("mpx::dynamic_loss_scaler"));
    std::vector<std::byte> const three(3);
    hand_made.add("scaler/state", three);
    hand_made.commit(dir / "small_state.mpx");
  }
  refusal("section '...' holds <n> bytes where <m> were expected", [&] { receiver.load(exec, dir / "small_state.mpx"); });
  check_doc_quote("optimizers.md",
                  "mpx::checkpoint: cannot write '<path>': cannot create <path>.tmp-<pid>: No such file or directory "
                  "(the previous file, if any, is unchanged) (at ...)",
                  message_of([&] { saved.save(exec, dir / "no" / "such" / "folder.mpx"); }));
  fs::remove_all(dir);
}

TEMPLATE_LIST_TEST_CASE("docs/models.md: the order of a step, and a model run where it was built", "[docs]",
                        mpx_test::executors) {
  TestType exec;
  auto model = trained_model(exec);
  forward_and_backward(exec, model);
  auto const dy = mpx_test::upload(exec, std::vector<float>(6, 0.5f), mpx::shape{2, 3});
  check_doc_quote("models.md",
                  "sequential::backward_from_logits: no forward since the previous backward: this would backpropagate "
                  "the previous batch's activations again ...",
                  message_of([&] { model.backward_from_logits(exec, dy.view()); }));

  mpx::host_executor host;
  auto on_host = trained_model(host);
  std::string const built_where = "the model was built with mpx::host_executor (its parameters are in host_space) but";
  check_doc_quote("models.md", built_where,
                  message_of([&] { (void)on_host.template parameters<mpx::device_space>(); }));
#if MPX_HAS_CUDA
  auto const x = mpx_test::upload(exec, std::vector<float>(4, 1.0f), mpx::shape{2, 2});
  check_doc_quote("models.md",
                  built_where + " is run with mpx::cuda_executor: build it with the executor that runs it",
                  message_of([&] { on_host.forward(exec, x.view(), true); }));
#endif
}

TEMPLATE_LIST_TEST_CASE("docs/loss_scaling.md: the stuck loss scale's message", "[docs]", mpx_test::executors) {
  TestType exec;
  // As the snippet's part 3: every value of dense_1/bias NaN, a scale from 4 down to 1,
  // reported after 3 overflowing steps at the minimum.
  auto k1 = mpx::make_tensor<float>(exec, {4});
  auto b1 = mpx::make_tensor<float>(exec, {2});
  auto k2 = mpx::make_tensor<float>(exec, {3});
  mpx::fill(exec, k1, 0.5f);
  mpx::fill(exec, b1, std::numeric_limits<float>::quiet_NaN());
  mpx::fill(exec, k2, 0.5f);
  mpx::gradient_list<TestType> list(exec, {k1, b1, k2}, {"dense_1/kernel", "dense_1/bias", "dense_2/kernel"});
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 4.0f;
  rule.min_scale = 1.0f;
  rule.report_after = 3;
  mpx::dynamic_loss_scaler scaler(exec, rule);
  std::string message;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) { message = r.message; });
  for (int step = 0; step < 5 && message.empty(); ++step) {
    scaler.unscale_and_check(exec, list);
    scaler.update(exec, list);
    exec.synchronize();
    scaler.poll();
  }
  check_doc_quote("loss_scaling.md",
                  "the loss scale is at its minimum (1) and 3 step(s) in a row still produced NaN or inf gradients (the "
                  "first the backward pass wrote: 'dense_1/bias'): they are not finite even unscaled, so the batches "
                  "hold NaN or inf or the model itself diverged. To find which, and the layer and the operation, run "
                  "mpx::find_nonfinite(exec, model) after a forward and backward on such a batch (it names \"(model "
                  "input)\" when the input already was). Then clean the inputs, lower the learning rate, keep softmax, "
                  "norms and losses in float32",
                  message);
}

TEST_CASE("docs/fp8_training.md: the summary's note on an fp8 first layer", "[docs]") {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_fp8>(mpx::dense<>(32, mpx::activation::relu), mpx::dense<>(16));
  model.build(exec, {16}, 1);
  check_doc_quote("fp8_training.md",
                  "Note: dense (the first layer, it reads the raw inputs) computes in fp8; keep it in bfloat16 with "
                  "mpx::without_fp8<mpx::mixed_fp8> as Transformer Engine advises (docs/fp8_training.md)",
                  model.summary());
}

// An IDX file of the given bytes.
fs::path idx_file(fs::path const& dir, std::string const& name, std::vector<unsigned char> const& bytes) {
  std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<char const*>(bytes.data()),
                                                   static_cast<std::streamsize>(bytes.size()));
  return dir / name;
}

TEST_CASE("docs/data.md: every IDX reader and data set refusal in its table says what the table says", "[docs]") {
  auto const dir = scratch("data");
  std::string const prefix = "mpx::read_idx: '<path>': ";
  auto refusal = [&](std::string const& row, fs::path const& file) {
    std::string const message = message_of([&] { (void)mpx::read_idx(file); });
    CHECK(mpx_test::message_matches_quote(message, prefix + row));
    check_doc_quote("data.md", row, message);
  };
  refusal("cannot open it: No such file or directory", dir / "missing");
  refusal("it is a directory, not a file", dir);
  refusal("truncated: dimensions [3, 4] need 12 data bytes after the header, found 10",
          idx_file(dir, "short", {0, 0, 8, 2, 0, 0, 0, 3, 0, 0, 0, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  refusal("truncated: the header of 3 dimensions needs 16 bytes, found 10", idx_file(dir, "header", {0, 0, 8, 3, 0, 0, 0, 3, 0, 0}));
  refusal("trailing garbage: 2 bytes after the 2 data bytes that dimensions [2] describe",
          idx_file(dir, "trailing", {0, 0, 8, 1, 0, 0, 0, 2, 7, 7, 9, 9}));
  refusal("not an IDX file: wrong magic: it starts with 0x50 0x4B 0x03 0x04, not 0x00 0x00 <type> <dimensions>",
          idx_file(dir, "zip", {0x50, 0x4B, 0x03, 0x04, 0, 0, 0, 0}));
  refusal("element type float32 (0x0D) is not supported: mpx reads IDX files of unsigned bytes (0x08)",
          idx_file(dir, "floats", {0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0}));
  refusal("bad number of dimensions 0 in the magic (mpx reads 1 to 8)", idx_file(dir, "dims", {0, 0, 8, 0}));

  std::vector<unsigned char> images = {0, 0, 8, 3, 0, 0, 0, 12, 0, 0, 0, 1, 0, 0, 0, 1};
  images.insert(images.end(), 12, 0);
  std::vector<unsigned char> labels = {0, 0, 8, 1, 0, 0, 0, 11};
  labels.insert(labels.end(), 11, 1);
  auto const twelve = idx_file(dir, "images", images), eleven = idx_file(dir, "labels", labels);
  check_doc_quote("data.md",
                  "mpx::load_idx_dataset: the image and label counts differ: '<images>' holds 12 images, '<labels>' "
                  "holds 11 labels",
                  message_of([&] { (void)mpx::load_idx_dataset(twelve, eleven); }));
  labels[7] = 12;
  labels.push_back(1);
  labels[8 + 2] = 10;
  auto const bad_label = idx_file(dir, "bad_label", labels);
  check_doc_quote("data.md", "mpx::load_idx_dataset: '<labels>': label 10 of sample 2 is outside [0, 10)",
                  message_of([&] { (void)mpx::load_idx_dataset(twelve, bad_label); }));
  std::vector<unsigned char> flat = {0, 0, 8, 1, 0, 0, 0, 12};
  flat.insert(flat.end(), 12, 0);
  auto const flat_images = idx_file(dir, "flat", flat);
  check_doc_quote("data.md",
                  "mpx::load_idx_dataset: '<images>': an image file has 3 dimensions [N, H, W] or 4 [N, H, W, C], not "
                  "[12] (is it a label file?)",
                  message_of([&] { (void)mpx::load_idx_dataset(flat_images, bad_label); }));
  check_doc_quote("data.md",
                  "mpx::load_fashion_mnist: Fashion-MNIST: neither 'train-images-idx3-ubyte' nor "
                  "'train-images-idx3-ubyte.gz' is in '<dir>'; install Debian's dataset-fashion-mnist package (apt-get "
                  "install dataset-fashion-mnist) or pass the directory that holds the files",
                  message_of([&] { (void)mpx::load_fashion_mnist(dir / "nothing"); }));
  fs::remove_all(dir);
}

TEST_CASE("docs/gemm.md, docs/lstm.md, docs/policies.md: shapes that do not agree, an unknown policy name",
          "[docs]") {
  mpx::host_executor exec;
  auto a = mpx::make_tensor<float>(exec, {32, 100});
  auto b = mpx::make_tensor<float>(exec, {32, 100});
  auto c = mpx::make_tensor<float>(exec, {32, 24});
  check_doc_quote("gemm.md",
                  "mpx::gemm: shapes do not agree: A [32, 100], B [32, 100], C [32, 24]: the inner extents differ (100 "
                  "in A, 32 in B)",
                  message_of([&] { mpx::gemm<mpx::float32>(exec, a, b, c); }));
  auto const c_over_a = mpx::view(a).flat(100, 32 * 24).reshape(mpx::shape{32, 24});
  auto const b_in = mpx::make_tensor<float>(exec, {100, 24});
  check_doc_quote("gemm.md", "mpx::gemm: C and A overlap in memory; give them separate buffers",
                  message_of([&] { mpx::gemm<mpx::float32>(exec, a, b_in, c_over_a); }));

  auto x = mpx::make_tensor<float>(exec, {4, 6, 3});
  auto kernel = mpx::make_tensor<float>(exec, {8, 32});
  auto recurrent = mpx::make_tensor<float>(exec, {8, 32});
  auto bias = mpx::make_tensor<float>(exec, {32});
  auto h = mpx::make_tensor<float>(exec, {4, 8});
  auto workspace = mpx::make_tensor<float>(exec, {100000});
  check_doc_quote("lstm.md",
                  "mpx::lstm_forward: kernel of shape [8, 32] does not match x of shape [4, 6, 3] (kernel must be [3, "
                  "32]) (at ...)",
                  message_of([&] { mpx::lstm_forward<mpx::float32>(exec, x, kernel, recurrent, bias, h, workspace); }));

  std::string const unknown = message_of([&] { mpx::with_policy("mixed_float8", [](auto) { return 0; }); });
  check_doc_quote("policies.md",
                  "mpx::with_policy: unknown policy \"mixed_float8\"; the presets are float32, mixed_float16, "
                  "mixed_bfloat16, bfloat16, mixed_fp8, mixed_fp8_current, mixed_fp8_block, mixed_fp8_rowwise, mixed_mxfp8 and mixed_nvfp4 (at "
                  "<your file>:<line>)",
                  unknown);
  CHECK_THAT(unknown, Catch::Contains("test_doc_messages.cpp:"));  // the caller's line
}

TEST_CASE("docs/fp8_training.md: an fp8 layer whose width cuBLASLt's fp8 products cannot take", "[docs]") {
  mpx::host_executor exec;
  mpx::dense<mpx::mixed_fp8> hidden(24);
  hidden.set_name("hidden");
  check_doc_quote("fp8_training.md",
                  "mpx::hidden: under mixed_fp8 N must be a multiple of 16 in every fp8 product (cuBLASLt's fp8 "
                  "kernels tile N by 16, as PyTorch's _scaled_mm requires); N is this layer's unit count, got N = "
                  "24. Make it a multiple of 16, or give this layer mpx::without_fp8<Policy>",
                  message_of([&] { hidden.build(exec, mpx::shape{32}, 1); }));
}

TEST_CASE("docs/executors_and_tensors.md, docs/data.md: refused views and a truncated data file", "[docs]") {
  std::vector<float> values(6);
  mpx::tensor_view<float> v(values.data(), {2, 3});
  check_doc_quote("executors_and_tensors.md", "mpx::tensor_view::reshape: cannot view [2, 3] (6 elements) as [4, 2] (at ...)",
                  message_of([&] { (void)v.reshape({4, 2}); }));
  check_doc_quote("executors_and_tensors.md",
                  "mpx::tensor_view::flat: elements [4, 7) of a view of shape [2, 3] are out of range (at ...)",
                  message_of([&] { (void)v.flat(4, 3); }));
  std::vector<float> other(6);
  check_doc_quote("executors_and_tensors.md", "mpx::copy: src has shape [2, 3] but dst has shape [3, 2] (at .../copy.hpp:<line>)",
                  message_of([&] {
                    mpx::copy(mpx::host_executor{}, mpx::tensor_view<float const>(values.data(), {2, 3}),
                              mpx::tensor_view<float>(other.data(), {3, 2}));
                  }));

  auto const dir = scratch("idx");
  {
    std::ofstream f(dir / "short", std::ios::binary);
    unsigned char const header[] = {0, 0, 0x08, 1, 0, 0, 0, 100};  // unsigned bytes, one dimension of 100
    f.write(reinterpret_cast<char const*>(header), sizeof header);
    f << std::string(42, 'x');
  }
  check_doc_quote("data.md", "truncated: dimensions [100] need 100 data bytes after the header, found 42 (at ...)",
                  message_of([&] { (void)mpx::read_idx(dir / "short"); }));
  fs::remove_all(dir);
}

TEMPLATE_LIST_TEST_CASE("docs/transformers.md: float16 attention logits that overflow, as find_nonfinite explains them",
                        "[docs]", mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  std::int64_t const tokens = 8, width = 64;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::causal_self_attention<>(1, false));
  model.build(exec, {tokens, width}, 4);
  auto x = mpx_test::upload(exec, mpx_test::random_values<float>(static_cast<std::size_t>(tokens * width), 200, 240, 3),
                            {1, tokens, width});
  model.forward(exec, mpx::tensor_view<float const, Space>(mpx::view(x)), false);
  auto const f = mpx::find_nonfinite(exec, model);
  REQUIRE(f);
  check_doc_quote("transformers.md",
                  "In an attention layer stored in float16, NaN from finite inputs is its logits q·kᵀ overflowing "
                  "float16 (65504) inside the layer: the softmax of a row holding inf computes inf - inf. Keep the "
                  "logits scaled by 1/sqrt(head width) (causal_self_attention's scale_logits, on by default), store "
                  "the layer in bfloat16 (mpx::mixed_bfloat16 has float32's range), or give the attention layer the "
                  "float32 policy.",
                  f->explanation());
}

}  // namespace doc_messages
