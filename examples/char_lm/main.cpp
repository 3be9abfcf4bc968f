// A GPT-style character (byte) language model on the fortune cookies Debian's `fortunes`
// package installs, under float32, mixed_bfloat16 and mixed_float16 with Keras's dynamic
// loss scale (`--policy all`, the default), or bfloat16 (no float master weights) or
// mixed_fp8 (the MLPs and the attention projections in fp8): the transformer workflow
// mixed-precision users train today.
//
//   embedding(256 bytes -> width, + learned positions)
//   repeat(--layers, default 4) [ residual(layer_norm, causal_self_attention(heads)),
//                                 residual(layer_norm, dense(4 width, gelu), dense(width)) ]
//   layer_norm, dense(256), softmax (float32)
//
// Each policy trains from the same seed on the same windows; the run prints the loss and
// loss scale as it goes, then one row per policy (validation loss, tokens per second,
// skipped steps, peak memory) beside the unigram model's loss (what a model that ignores
// context scores), and a short text sampled from each model.
//
//   char_lm [--policy all|float32|mixed_bfloat16|mixed_float16|bfloat16|mixed_fp8|mixed_fp8_current|
//            mixed_fp8_block|mixed_fp8_rowwise|mixed_mxfp8|mixed_nvfp4] [--steps N] [--batch N]
//           [--context N] [--width N] [--heads N] [--layers N] [--preset gpt2-small] [--lr X]
//           [--corpus PATH] [--seed N] [--sample N] [--log-every N] [--eval-batches N]
//           [--executor auto|host|cuda] [--shadow N] [--demo-overflow] [--init keras|torch|gpt2]
//           [--fp8-attention]
//
// --preset gpt2-small is GPT-2 small's shape on bytes, for a GPU: 12 layers, width 768,
// 12 heads, 1,024 tokens of context, GPT-2's initialisation, batch 8, AdamW(6e-4) (the
// flags given beside it win). The table reports tokens per second (from the second step:
// the first builds the plans) and the model's FLOP rate (6 x parameters + 12 x layers x
// context x width per token: the forward's and backward's products, attention's
// included), and on a GPU that rate as a fraction of the device's dense bfloat16
// tensor-core peak at its highest clock (model FLOP utilisation).
//
// --init chooses how the weights start: keras (the default: Keras's defaults, glorot
// uniform kernels, zero biases, embeddings U(±0.05)), torch (what PyTorch's nn.Linear and
// nn.Embedding make by default: U(±1/sqrt(fan in)) kernels and biases, N(0, 1)
// embeddings), or gpt2 (GPT-2's: every weight N(0, 0.02), zero biases, and the
// projections that end a residual branch N(0, 0.02/sqrt(2 x blocks))). A model ported
// from PyTorch trains as it did there with --init torch.
//
// --fp8-attention (with --policy mixed_fp8 or mixed_fp8_current) runs the attention
// between the projections in fp8 too (causal_self_attention_config::fp8_attention:
// cuDNN's fp8 SDPA on a Hopper GPU with heads of 128 values, mpx's fp8 core elsewhere).
//
// --shadow N measures every layer against its float32 twin every N steps (mpx::model_shadow)
// and prints, after training, which layers cost the model its precision.
//
// --demo-overflow shows the transformer failure docs/transformers.md explains: attention
// logits that overflow float16. Large models see their attention logits grow during
// training ("attention logit growth", Dehghani et al. 2023); the demo stands for that by
// multiplying the first block's query/key/value weights by 100. Under mixed_float16,
// without the attention's 1/sqrt(head width), the logits (stored in float16, as under
// autocast) pass 65504: mpx::find_nonfinite names the layer and the tensor and says why;
// with the scaling they are finite. Then it trains that model for --steps twice: without
// help (every step overflows, the loss scale collapses to its floor, nothing is learnt),
// and with mpx::precision_guard over tiered attention layers (mpx::tiered, mixed_float16
// then mixed_bfloat16), which moves the failing attention to bfloat16 and trains.
#include <mpx/mpx.hpp>

#include "../common/command_line.hpp"
#include "../common/memory_peak.hpp"


#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// How each kind of weight starts, by --init (see the top of this file).
struct initialisation {
  mpx::initializer kernel, bias, residual_kernel, embeddings, positions;
};

struct settings {
  std::string policy = "all";
  std::string executor = "auto";
  std::size_t steps = 0;  // 0: 300 on the host, 2000 on a GPU
  std::size_t batch = 16;
  std::int64_t context = 64;
  std::int64_t width = 128;
  std::int64_t heads = 4;
  std::int64_t layers = 4;  // transformer blocks (mpx::repeat's copies)
  std::string preset;       // "gpt2-small", or none
  float lr = 3e-3f;
  std::string corpus = "/usr/share/games/fortunes";
  std::uint64_t seed = 1;
  std::size_t sample = 160;
  std::size_t log_every = 25;
  std::size_t eval_batches = 40;  // validation batches (of --batch windows) scored at the end
  bool scale_logits = true;
  bool demo_overflow = false;
  bool fp8_attention = false;  // the attention's core in fp8 (per-tensor fp8 policies only)
  std::size_t shadow = 0;  // measure each layer against its float32 twin every N steps
  std::string init = "keras";
  initialisation weights;  // what `init` names (initialisation_of), set once the flags are read
};

struct outcome {
  std::string policy;
  double validation_loss = 0;
  double tokens_per_second = 0;
  double model_flops_per_second = 0;  // see model_flops_per_token
  std::size_t skipped = 0;
  float final_scale = 0;
  double peak_mib = 0;
  char const* memory_kind = "";  // what peak_mib measures
  std::string sample;
  std::string shadow_table;  // --shadow: the layers' errors against their float32 twins
};


initialisation initialisation_of(std::string const& init, std::int64_t layers) {
  using mpx::initializer;
  if (init == "torch")
    return {initializer::torch_linear, initializer::torch_linear, initializer::torch_linear, initializer::normal(1.0),
            initializer::normal(1.0)};
  if (init == "gpt2")
    return {initializer::normal(0.02), initializer::zeros, initializer::gpt2_residual(layers), initializer::normal(0.02),
            initializer::normal(0.02)};
  return {initializer::glorot_uniform, initializer::zeros, initializer::glorot_uniform, initializer::random_uniform,
          initializer::random_uniform};
}

// One pre-norm transformer block is attention, then the MLP, each in a residual branch.
// Under an fp8 policy the MLP's dense layers and attention's two projections run in fp8,
// and the attention between the projections in bfloat16, as in Transformer Engine.
// Guarded (--demo-overflow's second run): each attention layer is tiered, P then
// mixed_bfloat16, for mpx::precision_guard to move.
template <class P, bool Guarded>
auto attention_layer(settings const& s) {
  initialisation const& init = s.weights;
  mpx::causal_self_attention_config const c{.heads = s.heads,
                                            .scale_logits = s.scale_logits,
                                            .kernel_initializer = init.kernel,
                                            .output_kernel_initializer = init.residual_kernel,
                                            .bias_initializer = init.bias,
                                            .fp8_attention = s.fp8_attention};
  if constexpr (Guarded)
    return mpx::tiered<mpx::causal_self_attention, P, mpx::mixed_bfloat16>(c);
  else
    return mpx::causal_self_attention<P>(c);
}

// The model: an embedding, --layers copies of the pre-norm block, the output layer.
// (mpx::repeat initialises as the copies written out would: the same seeds per layer.)
template <class P, bool Guarded = false>
auto make_gpt(settings const& s) {
  initialisation const& init = s.weights;
  return mpx::sequential<P>(
      mpx::embedding<>({.vocab_size = 256, .width = s.width, .context = s.context,
                        .embeddings_initializer = init.embeddings, .positions_initializer = init.positions}),
      mpx::repeat(s.layers, mpx::residual(mpx::layer_norm<>(), attention_layer<P, Guarded>(s)),
                  mpx::residual(mpx::layer_norm<>(),
                                mpx::dense<>({.units = 4 * s.width, .activation = mpx::activation::gelu,
                                              .kernel_initializer = init.kernel, .bias_initializer = init.bias}),
                                mpx::dense<>({.units = s.width, .kernel_initializer = init.residual_kernel,
                                              .bias_initializer = init.bias}))),
      mpx::layer_norm<>(),
      mpx::dense<mpx::without_fp8<P>>({.units = 256, .kernel_initializer = init.kernel, .bias_initializer = init.bias}),
      mpx::softmax_layer<mpx::float32>());
}

// The first block's attention layer (the demonstrations grow its weights).
template <class Model>
auto& first_attention(Model& model) {
  return model.template layer<1>().block(0).template layer<0>().branch().template layer<1>();
}

// The model's training FLOPs per token, as PaLM's appendix B counts them: 6 per
// parameter (a forward and two backward products, 2 FLOPs a multiply-add) and
// attention's two [context x context] products, 12 x layers x context x width (the
// masked half counted too).
double model_flops_per_token(std::size_t parameters, settings const& s) {
  return 6.0 * static_cast<double>(parameters) +
         12.0 * static_cast<double>(s.layers) * static_cast<double>(s.context) * static_cast<double>(s.width);
}

// The first `limit` batches of a source each epoch (the validation score on a sample of
// the validation text: the whole of it would take longer than the training on the host).
template <class Source>
struct first_batches {
  Source& source;
  std::size_t limit;
  std::size_t given = 0;
  [[nodiscard]] std::size_t batches_per_epoch() const { return std::min(limit, source.batches_per_epoch()); }
  void start_epoch(std::uint64_t epoch) {
    source.start_epoch(epoch);
    given = 0;
  }
  auto next() {
    using batch = decltype(source.next());
    if (given++ >= limit) return batch{};
    return source.next();
  }
};


// The cross-entropy (nats per byte) of a unigram model fitted on `train` (add-one
// smoothing), on `validation`: the loss a model that ignores the context reaches.
double unigram_loss(std::span<std::uint8_t const> train, std::span<std::uint8_t const> validation) {
  std::vector<double> count(256, 1.0);
  for (auto b : train) count[b] += 1;
  double total = 0;
  for (double c : count) total += c;
  double loss = 0;
  for (auto b : validation) loss -= std::log(count[b] / total);
  return loss / static_cast<double>(validation.size());
}

// Text generated by the model from `prompt`: each next byte drawn from the softmax of the
// last position (temperature 0.8), the window sliding over the last `context` bytes.
template <class Exec, class Model>
std::string sample_text(Exec const& exec, Model& model, std::string const& prompt, std::size_t count,
                        std::int64_t context, std::uint64_t seed) {
  using Space = mpx::memory_space_t<Exec>;
  std::vector<std::int32_t> tokens(prompt.begin(), prompt.end());
  mpx::splitmix64 rng(seed);
  auto window = mpx::make_tensor<std::int32_t>(exec, {1, context});
  std::string out = prompt;
  for (std::size_t n = 0; n < count; ++n) {
    std::vector<std::int32_t> w(static_cast<std::size_t>(context), static_cast<std::int32_t>(' '));
    std::size_t const have = std::min<std::size_t>(tokens.size(), static_cast<std::size_t>(context));
    std::copy(tokens.end() - static_cast<std::ptrdiff_t>(have), tokens.end(), w.begin());
    mpx::copy(exec, mpx::tensor_view<std::int32_t const, mpx::host_space>(w.data(), window.shape()), window);
    auto const probabilities = mpx::to_host(exec, model.forward(exec, mpx::tensor_view<std::int32_t const, Space>(window), false));
    float const* last = probabilities.data() + (have - 1) * 256;  // the position of the newest byte
    std::vector<double> p(256);
    double sum = 0;
    for (std::size_t c = 0; c < 256; ++c) sum += p[c] = std::pow(static_cast<double>(last[c]) + 1e-12, 1 / 0.8);
    double r = static_cast<double>(rng.below(1u << 30)) / static_cast<double>(1u << 30) * sum;
    std::size_t next = 0;
    while (next < 255 && (r -= p[next]) > 0) ++next;
    tokens.push_back(static_cast<std::int32_t>(next));
    out += static_cast<char>(next);
  }
  for (char& c : out)
    if (c != '\n' && (static_cast<unsigned char>(c) < 32 || static_cast<unsigned char>(c) > 126)) c = '?';
  return out;
}

template <class P, class Exec>
outcome train(Exec const& exec, settings const& s, mpx::text_split const& text) {
  using storage = typename P::storage_type;
  mpx_programs::memory_peak<Exec> const peak;  // this run's, from here
  auto model = make_gpt<P>(s);
  model.build(exec, {s.context}, s.seed);
  std::printf("\n== %s on the %s executor: %zu parameters\n", std::string(P::name).c_str(),
              mpx::is_host_executor_v<Exec> ? "host" : "cuda", model.parameter_count());

  mpx::text_batches<Exec> train_batches(exec, text.train,
                                        {.context = static_cast<std::size_t>(s.context), .batch_size = s.batch,
                                         .stride = static_cast<std::size_t>(s.context) / 2, .seed = s.seed});
  mpx::text_batches<Exec> validation(exec, text.validation,
                                     {.context = static_cast<std::size_t>(s.context), .batch_size = s.batch,
                                      .shuffle = false});
  constexpr bool float16 = std::is_same_v<storage, mpx::half>;
  auto adam = mpx::adamw(exec, model.parameters(exec), s.lr, {}, mpx::master_weights_for<P>(true, s.seed));
  outcome o;
  o.policy = std::string(P::name);
  auto run = [&](auto& optimizer) {
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.shadow_every(s.shadow);
    std::vector<mpx::shadow_report> shadows;
    // The clock restarts after the first step, which builds the products' and the fused
    // attention's plans and fills the memory pool: tokens per second is the steady rate.
    auto start = std::chrono::steady_clock::now();
    std::size_t step = 0, epoch = 0, tokens = 0;
    while (step < s.steps) {
      train_batches.start_epoch(epoch++);
      while (step < s.steps) {
        auto b = train_batches.next();
        if (!b) break;
        trainer.step(exec, b->inputs, b->targets);
        tokens += b->targets.size();
        if (step == 0 && !mpx::is_host_executor_v<Exec>)  // (why not fused: on stderr, once)
          std::printf("attention: %s\n", first_attention(model).fused() ? mpx::fused_attention()->name() : "unfused");
        if (step == 0 && s.steps > 1) {
          exec.synchronize();
          start = std::chrono::steady_clock::now();
          tokens = 0;
        }
        if (++step % s.log_every == 0 || step == s.steps) {
          auto const records = trainer.history(exec);
          for (auto& r : trainer.take_shadow_reports()) shadows.push_back(std::move(r));
          for (auto const& r : records) o.skipped += r.skipped;
          std::printf("step %5zu/%zu  loss %.4f  loss scale %g  skipped %zu\n", step, s.steps,
                      static_cast<double>(records.back().loss), static_cast<double>(records.back().loss_scale),
                      o.skipped);
          std::fflush(stdout);
        }
      }
    }
    exec.synchronize();
    o.tokens_per_second = static_cast<double>(tokens) /
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    o.model_flops_per_second = o.tokens_per_second * model_flops_per_token(model.parameter_count(), s);
    first_batches<mpx::text_batches<Exec>> sample{validation, s.eval_batches};
    o.validation_loss = mpx::evaluate(exec, model, sample).loss;
    o.final_scale = optimizer.scaler().scale(exec);
    if (s.shadow) o.shadow_table = mpx::shadow_table(shadows);
  };
  if constexpr (float16) {
    mpx::loss_scale_optimizer optimizer(std::move(adam), mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    run(optimizer);
  } else {
    mpx::loss_scale_optimizer optimizer(std::move(adam), mpx::static_loss_scaler(exec, 1.0f));
    run(optimizer);
  }
  o.peak_mib = peak.mib();
  o.memory_kind = peak.kind();
  o.sample = sample_text(exec, model, "Q: ", s.sample, s.context, s.seed);
  return o;
}

// --demo-overflow: the first training batch through a mixed_float16 model whose first
// attention weights grew 100-fold, without and with the 1/sqrt(head width) scaling.
template <class Exec>
void demonstrate_overflow_once(Exec const& exec, settings s, mpx::text_split const& text) {
  using space = mpx::memory_space_t<Exec>;
  mpx::text_batches<Exec> batches(exec, text.train,
                                  {.context = static_cast<std::size_t>(s.context), .batch_size = s.batch, .seed = s.seed});
  batches.start_epoch(0);
  auto const batch = batches.next();
  for (bool scaled : {false, true}) {
    s.scale_logits = scaled;
    auto model = make_gpt<mpx::mixed_float16>(s);
    model.build(exec, {s.context}, s.seed);
    auto& attention = first_attention(model);
    mpx::scale(exec, attention.query_key_value().template kernel<space>(), 100.0f);
    model.forward(exec, batch->inputs, true);
    std::printf("\n== mixed_float16, attention weights grown 100x, logits %s\n",
                scaled ? "scaled by 1/sqrt(head width)" : "NOT scaled");
    if (auto finding = mpx::find_nonfinite(exec, model))
      std::printf("find_nonfinite: %s\n", finding->explanation().c_str());
    else
      std::printf("find_nonfinite: every activation is finite: the 1/sqrt(head width) scaling, applied inside the\n"
                  "product's float sums before the logits are rounded to float16, keeps them in range.\n");
  }
}

struct demo_run {
  std::string name;
  std::size_t skipped = 0;
  float final_scale = 0;
  double validation_loss = 0;
  std::string moves;  // the precision guard's, in words
};

// --demo-overflow's training runs: the same grown, unscaled attention under
// mixed_float16, trained without and with the precision guard (whose attention layers
// are tiered, mixed_float16 then mixed_bfloat16).
template <bool Guarded, class Exec>
demo_run demo_training(Exec const& exec, settings s, mpx::text_split const& text) {
  using space = mpx::memory_space_t<Exec>;
  s.scale_logits = false;
  auto model = make_gpt<mpx::mixed_float16, Guarded>(s);
  model.build(exec, {s.context}, s.seed);
  auto& attention = first_attention(model);
  if constexpr (Guarded) mpx::scale(exec, attention.template tier<0>().query_key_value().template kernel<space>(), 100.0f);
  else mpx::scale(exec, attention.query_key_value().template kernel<space>(), 100.0f);
  demo_run out;
  out.name = Guarded ? "with the guard" : "without the guard";
  std::printf("\n== training %s: mixed_float16, the first attention's weights grown 100x, logits not scaled\n",
              out.name.c_str());
  mpx::text_batches<Exec> train_batches(exec, text.train,
                                        {.context = static_cast<std::size_t>(s.context), .batch_size = s.batch,
                                         .stride = static_cast<std::size_t>(s.context) / 2, .seed = s.seed});
  mpx::text_batches<Exec> validation(exec, text.validation,
                                     {.context = static_cast<std::size_t>(s.context), .batch_size = s.batch,
                                      .shuffle = false});
  mpx::dynamic_loss_scaler scaler(exec, mpx::keras_loss_scale());
  bool stuck = false;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) {  // said once; the run goes on to show the stall
    if (!stuck) std::printf("loss scaler: %s\n", r.message.c_str());
    stuck = true;
  });
  auto optimizer = mpx::loss_scale_optimizer(
      mpx::adamw(exec, model.parameters(exec), s.lr, {}, mpx::master_weights_for<mpx::mixed_float16>(true, s.seed)),
      std::move(scaler));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  if constexpr (Guarded) trainer.guard({.review_every = 5});  // 3 forward overflows in 200 steps move a layer
  std::size_t step = 0, epoch = 0, moves_shown = 0;
  while (step < s.steps) {
    train_batches.start_epoch(epoch++);
    while (step < s.steps) {
      auto b = train_batches.next();
      if (!b) break;
      trainer.step(exec, b->inputs, b->targets);
      if (auto const* guard = trainer.guard())
        for (; moves_shown < guard->moves().size(); ++moves_shown)
          std::printf("precision guard, step %zu: %s\n", guard->moves()[moves_shown].step,
                      guard->moves()[moves_shown].text().c_str());
      if (++step % s.log_every == 0 || step == s.steps) {
        auto const records = trainer.history(exec);
        for (auto const& r : records) out.skipped += r.skipped;
        std::printf("step %5zu/%zu  loss %.4f  loss scale %g  skipped %zu\n", step, s.steps,
                    static_cast<double>(records.back().loss), static_cast<double>(records.back().loss_scale),
                    out.skipped);
        std::fflush(stdout);
      }
    }
  }
  first_batches<mpx::text_batches<Exec>> sample{validation, s.eval_batches};
  out.validation_loss = mpx::evaluate(exec, model, sample).loss;
  out.final_scale = optimizer.scaler().scale(exec);
  if (auto const* guard = trainer.guard()) out.moves = guard->summary();
  return out;
}

template <class Exec>
void demonstrate_overflow(Exec const& exec, settings const& s, mpx::text_split const& text, double unigram) {
  demonstrate_overflow_once(exec, s, text);
  demo_run const runs[] = {demo_training<false>(exec, s, text), demo_training<true>(exec, s, text)};
  std::printf("\n%-20s %16s %10s %12s\n", "mixed_float16", "validation loss", "skipped", "final scale");
  for (auto const& r : runs)
    std::printf("%-20s %16.4f %10zu %12g\n", r.name.c_str(), r.validation_loss, r.skipped,
                static_cast<double>(r.final_scale));
  std::printf("%-20s %16.4f   (a model that ignores the context; nats per byte)\n", "unigram", unigram);
  std::printf("\nPrecision guard:\n%s", runs[1].moves.empty() ? "no layer was moved\n" : runs[1].moves.c_str());
  if (runs[1].moves.empty())  // what the demonstration shows did not happen: say so, as a failure
    throw mpx::error("--demo-overflow: the precision guard moved no layer; the demonstration failed");
}

constexpr char const* usage_text =
    "[--policy all|float32|mixed_bfloat16|mixed_float16|bfloat16|mixed_fp8|mixed_fp8_current|mixed_fp8_block|mixed_fp8_rowwise|mixed_mxfp8|mixed_nvfp4]\n"
    "          [--steps N] [--batch N]\n"
    "          [--context N] [--width N] [--heads N] [--layers N] [--preset gpt2-small] [--lr X]\n"
    "          [--corpus PATH] [--seed N] [--sample N] [--log-every N] [--eval-batches N]\n"
    "          [--executor auto|host|cuda] [--shadow N] [--demo-overflow] [--init keras|torch|gpt2]\n"
    "          [--fp8-attention]";

settings parse(int argc, char** argv) {
  settings s;
  mpx_programs::command_line args(argc, argv, usage_text);
  std::vector<std::string> given;  // the flags on the command line: a preset does not override them
  while (args.next()) {
    given.push_back(args.flag());
    if (args.is("--policy"))
      s.policy = args.choice({"all", "float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "mixed_fp8",
                              "mixed_fp8_current", "mixed_fp8_block", "mixed_fp8_rowwise", "mixed_mxfp8",
                              "mixed_nvfp4"});
    else if (args.is("--steps")) s.steps = args.whole<std::size_t>(1, 1'000'000);
    else if (args.is("--batch")) s.batch = args.whole<std::size_t>(1, 4096);
    else if (args.is("--context"))
      s.context = args.whole<std::int64_t>(1, 2048, " (each attention holds --batch x --heads x context^2 scores)");
    else if (args.is("--width")) s.width = args.whole<std::int64_t>(1, 4096);
    else if (args.is("--heads")) s.heads = args.whole<std::int64_t>(1, 64);
    else if (args.is("--layers")) s.layers = args.whole<std::int64_t>(1, 256);
    else if (args.is("--preset")) s.preset = args.choice({"gpt2-small"});
    else if (args.is("--lr")) s.lr = static_cast<float>(args.real(0, 1, true));
    else if (args.is("--corpus")) s.corpus = args.text();
    else if (args.is("--seed")) s.seed = args.whole<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max());
    else if (args.is("--sample")) s.sample = args.whole<std::size_t>(1, 1'000'000);
    else if (args.is("--log-every")) s.log_every = args.whole<std::size_t>(1, 1'000'000);
    else if (args.is("--eval-batches")) s.eval_batches = args.whole<std::size_t>(1, 100'000);
    else if (args.is("--executor")) s.executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--demo-overflow")) s.demo_overflow = true;
    else if (args.is("--shadow")) s.shadow = args.whole<std::size_t>(1, 1'000'000);
    else if (args.is("--init")) s.init = args.choice({"keras", "torch", "gpt2"});
    else if (args.is("--fp8-attention")) s.fp8_attention = true;
    else args.unknown();
  }
  if (s.preset == "gpt2-small") {
    auto unless_given = [&](char const* flag, auto& field, auto value) {
      if (std::find(given.begin(), given.end(), flag) == given.end()) field = value;
    };
    unless_given("--layers", s.layers, std::int64_t{12});
    unless_given("--width", s.width, std::int64_t{768});
    unless_given("--heads", s.heads, std::int64_t{12});
    unless_given("--context", s.context, std::int64_t{1024});
    unless_given("--batch", s.batch, std::size_t{8});
    unless_given("--init", s.init, std::string("gpt2"));
    unless_given("--lr", s.lr, 6e-4f);  // GPT-2 small's; 3e-3 is for the small default model
  }
  if (s.fp8_attention && s.policy != "mixed_fp8" && s.policy != "mixed_fp8_current")
    throw mpx_programs::usage_error("--fp8-attention needs --policy mixed_fp8 or mixed_fp8_current (per-tensor fp8 "
                                    "scales), not " + s.policy);
  if (s.fp8_attention && s.demo_overflow)
    throw mpx_programs::usage_error("--fp8-attention and --demo-overflow do not go together (the demonstration runs "
                                    "under mixed_float16)");
  if (s.width % s.heads != 0)
    throw mpx_programs::usage_error("--width " + std::to_string(s.width) + " must be a multiple of --heads " +
                                    std::to_string(s.heads));
  s.weights = initialisation_of(s.init, s.layers);
  return s;
}

bool gpu_available() {
#if MPX_HAS_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

// The GPU's dense bfloat16 tensor-core peak in FLOP/s at its highest SM clock: SMs x that
// clock x the FLOPs an SM does per clock (sm_80 2,048, sm_90 4,096, sm_100 8,192). The
// vendor's figures use a lower boost clock (989 TFLOP/s for an H100 SXM, where this gives
// about 1,070), so the MFU against it is the smaller, cautious one. 0 where unknown (the
// host, other GPUs: sm_86 and sm_89 do fewer per clock).
double dense_bf16_peak() {
#if MPX_HAS_CUDA
  int device = 0, major = 0, minor = 0, sms = 0, khz = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device) != cudaSuccess)
    return 0;
  int const sm = 10 * major + minor;
  double const per_clock = sm == 80 ? 2048 : sm == 90 ? 4096 : sm == 100 ? 8192 : 0;
  return per_clock * sms * khz * 1e3;
#else
  return 0;
#endif
}

template <class Exec>
std::vector<outcome> train_policies(Exec const& exec, settings const& s, mpx::text_split const& text) {
  std::vector<outcome> out;
  std::vector<std::string> names = {s.policy};
  if (s.policy == "all") names = {"float32", "mixed_bfloat16", "mixed_float16"};
  for (auto const& name : names)
    mpx::with_policy(name, [&](auto p) { out.push_back(train<typename decltype(p)::type>(exec, s, text)); });
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  settings s = parse(argc, argv);
  bool const use_gpu = s.executor == "cuda" || (s.executor == "auto" && gpu_available());
  if (s.executor == "cuda" && !gpu_available()) throw mpx::error("--executor cuda: no GPU is visible to this process");
  if (s.steps == 0) s.steps = use_gpu ? 2000 : 300;

  mpx::text_corpus const corpus = mpx::read_text_corpus(s.corpus);
  mpx::text_split const text = mpx::split_text(corpus, 0.1);
  std::printf("corpus: %zu bytes from %zu file(s) under %s; %zu for training, %zu for validation\n", corpus.size(),
              corpus.files.size(), s.corpus.c_str(), text.train.size(), text.validation.size());
  std::printf("model: %lld blocks, width %lld, %lld heads, context %lld; batch %zu, %zu steps, AdamW(%g); %s "
              "initialisation\n",
              static_cast<long long>(s.layers), static_cast<long long>(s.width), static_cast<long long>(s.heads),
              static_cast<long long>(s.context), s.batch, s.steps, static_cast<double>(s.lr), s.init.c_str());
  double const unigram = unigram_loss(text.train, text.validation);
  if (s.demo_overflow) {
    if (use_gpu) {
#if MPX_HAS_CUDA
      demonstrate_overflow(mpx::cuda_executor{}, s, text, unigram);
#endif
    } else {
      demonstrate_overflow(mpx::host_executor{}, s, text, unigram);
    }
    return 0;
  }

  std::vector<outcome> results;
  if (use_gpu) {
#if MPX_HAS_CUDA
    results = train_policies(mpx::cuda_executor{}, s, text);
#endif
  } else {
    results = train_policies(mpx::host_executor{}, s, text);
  }

  double const peak = use_gpu ? dense_bf16_peak() : 0;
  std::printf("\n%-16s %16s %14s %14s %8s %10s %12s %14s\n", "policy", "validation loss", "tokens / s",
              "model TFLOP/s", "MFU", "skipped", "final scale", "peak memory");
  for (auto const& r : results) {
    std::string const mfu = peak > 0 ? std::to_string(static_cast<int>(std::lround(100 * r.model_flops_per_second / peak))) + "%" : "-";
    std::printf("%-16s %16.4f %14.0f %14.3f %8s %10zu %12g %10.0f MiB\n", r.policy.c_str(), r.validation_loss,
                r.tokens_per_second, r.model_flops_per_second / 1e12, mfu.c_str(), r.skipped,
                static_cast<double>(r.final_scale), r.peak_mib);
  }
  if (peak > 0)
    std::printf("(MFU: the model's FLOP rate over this GPU's dense bfloat16 peak at its highest clock, %.0f TFLOP/s)\n",
                peak / 1e12);
  if (!results.empty()) std::printf("(peak memory: %s)\n", results.front().memory_kind);
  std::printf("%-16s %16.4f   (a model that ignores the context; nats per byte)\n", "unigram", unigram);
  for (auto const& r : results) std::printf("\n-- sampled from %s:\n%s\n", r.policy.c_str(), r.sample.c_str());
  for (auto const& r : results)
    if (!r.shadow_table.empty()) std::printf("\n-- %s: %s", r.policy.c_str(), r.shadow_table.c_str());
  return 0;
} catch (...) {
  return mpx_programs::report_failure("char_lm");
}
