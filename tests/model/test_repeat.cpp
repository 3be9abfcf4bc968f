// mpx::repeat (model/repeat.hpp): n copies of a block as one layer, chosen at run time.
// The reference is the same model with the copies written out: a repeat must initialise,
// compute, train and name its layers as that model does, bit for bit.
#include "support/testing.hpp"

#include <mpx/model/repeat.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr std::int64_t tokens = 6, width = 8, classes = 5;

// One pre-norm transformer block: attention, then an MLP with dropout, each in a residual.
auto attention_half() { return mpx::residual(mpx::layer_norm<>(), mpx::causal_self_attention<>(2)); }
auto mlp_half() {
  return mpx::residual(mpx::layer_norm<>(), mpx::dense<>(2 * width, mpx::activation::gelu), mpx::dense<>(width),
                       mpx::dropout<>(0.25f));
}
auto head() { return std::make_tuple(mpx::layer_norm<>(), mpx::dense<>(classes), mpx::softmax_layer<mpx::float32>()); }

template <class P>
auto repeated_model(std::int64_t copies) {
  return std::apply([&](auto&&... h) { return mpx::sequential<P>(mpx::dense<>(width), mpx::repeat(copies, attention_half(), mlp_half()), std::move(h)...); },
                    head());
}
template <class P>
auto written_out_model() {
  return std::apply(
      [](auto&&... h) {
        return mpx::sequential<P>(mpx::dense<>(width), attention_half(), mlp_half(), attention_half(), mlp_half(),
                                  attention_half(), mlp_half(), std::move(h)...);
      },
      head());
}

//! The bytes of every parameter value (or gradient), in order.
template <class Exec, class Params>
std::vector<std::vector<std::uint8_t>> bytes_of(Exec const& exec, Params const& params, bool gradients) {
  using space = mpx::memory_space_t<Exec>;
  std::vector<std::vector<std::uint8_t>> out;
  for (auto const& p : params) {
    auto const& t = gradients ? p.gradient : p.value;
    mpx::tensor_view<std::uint8_t const, space> const bytes(static_cast<std::uint8_t const*>(t.data()),
                                                          mpx::shape{static_cast<std::int64_t>(t.size_bytes())});
    out.push_back(mpx_test::download(exec, bytes));
  }
  return out;
}

// The name copy `i` of a block gives a layer the written-out model calls residual_<j>.
std::string written_out_name(std::string const& repeated) {
  if (!repeated.starts_with("repeat/")) return repeated;
  std::size_t const slash = repeated.find('/', 7);
  std::size_t const copy = std::stoul(repeated.substr(7, slash - 7));
  std::string rest = repeated.substr(slash + 1);
  std::size_t const end = rest.find('/');
  std::string const layer = rest.substr(0, end);
  std::size_t const within = layer == "residual" ? 0 : 1;  // "residual" or "residual_1"
  std::size_t const j = 2 * copy + within;
  return (j == 0 ? std::string("residual") : "residual_" + std::to_string(j)) + (end == std::string::npos ? "" : rest.substr(end));
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("a repeat initialises, computes and trains bit for bit as its copies written out",
                        "[model][repeat]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  using P = mpx::mixed_bfloat16;
  std::int64_t const batch = 7;  // (odd: no batch splits evenly)
  auto repeated = repeated_model<P>(3);
  auto written = written_out_model<P>();
  repeated.build(exec, {tokens, width}, 11);
  written.build(exec, {tokens, width}, 11);

  auto const rp = repeated.parameters(exec);
  auto const wp = written.parameters(exec);
  REQUIRE(rp.size() == wp.size());
  for (std::size_t i = 0; i < rp.size(); ++i) CHECK(written_out_name(rp[i].name) == wp[i].name);
  CHECK(rp[2].name == "repeat/0/residual/layer_normalization/gamma");
  CHECK(rp[rp.size() - 5].name == "repeat/2/residual_1/dense_1/bias");
  CHECK(repeated.parameter_count() == written.parameter_count());
  CHECK(bytes_of(exec, rp, false) == bytes_of(exec, wp, false));  // initialised alike

  auto const xs = mpx_test::random_values<mpx::bfloat16>(static_cast<std::size_t>(batch * tokens * width), -2, 2, 5);
  auto const labels = mpx_test::random_values<float>(static_cast<std::size_t>(batch * tokens), 0, classes, 6);
  std::vector<std::int32_t> ys;
  for (float l : labels) ys.push_back(static_cast<std::int32_t>(l));
  auto x = mpx_test::upload(exec, xs, {batch, tokens, width});
  auto y = mpx_test::upload(exec, ys, {batch, tokens});
  auto train = [&](auto& model) {
    auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                               mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    mpx::classifier_trainer trainer(exec, model, optimizer);
    for (int step = 0; step < 4; ++step)
      trainer.step(exec, mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(x)),
                   mpx::tensor_view<std::int32_t const, space>(mpx::view(y)));
    std::vector<float> losses;
    for (auto const& r : trainer.history(exec)) losses.push_back(r.loss);
    return losses;
  };
  auto const repeated_losses = train(repeated);
  auto const written_losses = train(written);
  CHECK(repeated_losses == written_losses);
  CHECK(repeated_losses.back() < repeated_losses.front());
  // Dropout drew the same masks, the gradients of the last step and the weights agree.
  CHECK(bytes_of(exec, repeated.parameters(exec), true) == bytes_of(exec, written.parameters(exec), true));
  CHECK(bytes_of(exec, repeated.parameters(exec), false) == bytes_of(exec, written.parameters(exec), false));

  // Every layer's trace, the gradients between copies included, is the written-out one's.
  auto const rt = repeated.template trace<space>();
  auto const wt = written.template trace<space>();
  std::vector<std::string> traced;
  for (auto const& t : rt)
    if (t.name != "repeat") traced.push_back(written_out_name(t.name));
  std::vector<std::string> written_names;
  for (auto const& t : wt) written_names.push_back(t.name);
  CHECK(traced == written_names);
  auto bytes = [&](mpx::tensor_ref<space> const& t) {
    mpx::tensor_view<std::uint8_t const, space> const b(static_cast<std::uint8_t const*>(t.data()),
                                                        mpx::shape{static_cast<std::int64_t>(t.size_bytes())});
    return mpx_test::download(exec, b);
  };
  for (auto const& r : rt) {
    if (r.name == "repeat") continue;
    auto const w = std::find_if(wt.begin(), wt.end(), [&](auto const& t) { return t.name == written_out_name(r.name); });
    REQUIRE(w != wt.end());
    INFO(r.name);
    CHECK(r.in_backward == w->in_backward);
    CHECK(bytes(r.output) == bytes(w->output));
    CHECK(r.input_gradient.size() == w->input_gradient.size());
    if (r.input_gradient.size() && w->input_gradient.size()) CHECK(bytes(r.input_gradient) == bytes(w->input_gradient));
  }
}

TEST_CASE("a repeat shows its copies in the summary, names their state, and refuses what cannot repeat",
          "[model][repeat]") {
  mpx::host_executor exec;
  auto model = repeated_model<mpx::mixed_float16>(2);
  model.build(exec, {tokens, width}, 1);
  auto const summary = model.summary();
  CHECK(summary.find("repeat (Repeat)") != std::string::npos);
  CHECK(summary.find("  | 0/residual (Residual)") != std::string::npos);
  CHECK(summary.find("  | 1/residual_1 (Residual)") != std::string::npos);
  CHECK(summary.find("  |   | multi_head_attention (MultiHeadAttention)") != std::string::npos);
  auto const seeds = mpx::detail::model_seeds(model);
  REQUIRE(seeds.size() == 4);  // attention's (its dropout on the weights) and the MLP's dropout, per copy
  CHECK(seeds[0].first == "repeat/0/residual/multi_head_attention/dropout_seed");
  CHECK(seeds[1].first == "repeat/0/residual_1/dropout/seed");
  CHECK(seeds[3].first == "repeat/1/residual_1/dropout/seed");
  CHECK(*seeds[1].second != *seeds[3].second);  // each copy its own masks
  auto const counters = mpx::detail::model_counters<mpx::host_space>(model);
  REQUIRE(counters.size() == 4);
  CHECK(counters[3].first == "repeat/1/residual_1/dropout/training_forwards");
  CHECK(model.layer<1>().count() == 2);
  CHECK(model.layer<1>().block(1).layer<0>().branch().layer<1>().name() == "multi_head_attention");

  CHECK_THROWS_TYPE_WITH(repeated_model<mpx::float32>(0), mpx::invalid_argument,
                         Catch::Contains("repeated at least once; got 0"));
  auto widening = mpx::sequential<mpx::float32>(mpx::dense<>(4), mpx::repeat(2, mpx::dense<>(5)));
  CHECK_THROWS_TYPE_WITH(widening.build(exec, {4}, 1), mpx::shape_error, Catch::Contains("must keep the shape"));
}

TEMPLATE_LIST_TEST_CASE("find_nonfinite names the copy and layer inside a repeat that overflowed",
                        "[model][repeat][diagnostics]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const T = 8, D = 64;
  // Large activations and no 1/sqrt(d): the float16 attention logits overflow in the
  // first copy already.
  auto x = mpx_test::upload(exec, mpx_test::random_values<mpx::half>(static_cast<std::size_t>(T * D), 200, 240, 3), {1, T, D});
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::repeat(3, mpx::residual(mpx::causal_self_attention<>(1, false)), mpx::residual(mpx::dense<>(D))),
      mpx::dense<>(4));
  model.build(exec, {T, D}, 4);
  model.forward(exec, mpx::tensor_view<mpx::half const, space>(mpx::view(x)), false);
  auto const finding = mpx::find_nonfinite(exec, model);
  REQUIRE(finding);
  CHECK(finding->layer == "repeat/0/residual/multi_head_attention");
  CHECK(finding->pass == "forward");
}

TEST_CASE("a repeat's copies report their gradients final one layer at a time, and its in-flight state is restored",
          "[model][repeat]") {
  mpx::host_executor exec;
  using space = mpx::host_space;
  auto repeated = repeated_model<mpx::float32>(3);
  auto written = written_out_model<mpx::float32>();
  std::int64_t const batch = 3;
  auto x = mpx_test::upload(exec, mpx_test::random_values<float>(static_cast<std::size_t>(batch * tokens * width), -1, 1, 9),
                            {batch, tokens, width});
  auto dy = mpx_test::upload(exec, mpx_test::random_values<float>(static_cast<std::size_t>(batch * tokens * classes), -1, 1, 10),
                             {batch, tokens, classes});
  auto firsts_of = [&](auto& model) {
    model.build(exec, {tokens, width}, 2);
    std::vector<std::size_t> firsts;
    model.template on_gradients_final<space>([&](std::size_t first) {
      if (firsts.empty() || firsts.back() != first) firsts.push_back(first);  // (the repeat says copy 0's again)
    });
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), true);
    model.backward_from_logits(exec, mpx::tensor_view<float const, space>(mpx::view(dy)));
    model.template on_gradients_final<space>({});  // (the hook holds `firsts`)
    return firsts;
  };
  auto const firsts = firsts_of(repeated);
  CHECK(firsts == firsts_of(written));
  // The head's dense and layer norm; in each of the three blocks the MLP's dense_1, dense
  // and layer norm (its dropout has no parameters) and the attention and its layer norm;
  // the first dense: a signal after every layer that has parameters.
  CHECK(firsts.size() == 18);

  // An evaluation forward between a step and its diagnosis (a CUDA graph's replay puts
  // the captured state back the same way): the copies' state comes back with the model's.
  auto const state = repeated.in_flight_state();
  REQUIRE(state.parts.size() == 3);
  repeated.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
  auto in_backward = [&] {
    for (auto const& t : repeated.template trace<space>())
      if (t.name == "repeat/1/residual_1/dense") return t.in_backward;
    FAIL("no layer repeat/1/residual_1/dense");
    return false;
  };
  CHECK_FALSE(in_backward());
  repeated.restore_in_flight_state(state);
  CHECK(in_backward());
}

TEMPLATE_LIST_TEST_CASE("find_nonfinite names the layer inside a copy whose backward pass overflowed",
                        "[model][repeat][diagnostics]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const D = 64;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::repeat(2, mpx::residual(mpx::dense<>(D), mpx::dense<>(D))),
                                                   mpx::dense<>(4));
  model.build(exec, {D}, 4);
  // The head's kernel all 1 and dy all 1: the gradient reaching the top copy is 4
  // everywhere. Copy 1's second kernel all 2000: its forward stays finite on inputs of
  // 1e-4, but its input gradient is 64 x 2000 x 4, past float16's 65504.
  mpx::fill(exec, model.layer<1>().template kernel<space>(), mpx::cast<mpx::half>(1.0f));
  auto& dense = model.layer<0>().block(1).layer<0>().branch().layer<1>();
  mpx::fill(exec, dense.template kernel<space>(), mpx::cast<mpx::half>(2000.0f));
  auto x = mpx_test::upload(exec, std::vector<mpx::half>(2 * D, mpx::cast<mpx::half>(1e-4f)), {2, D});
  auto dy = mpx_test::upload(exec, std::vector<float>(8, 1.0f), {2, 4});
  model.forward(exec, mpx::tensor_view<mpx::half const, space>(mpx::view(x)), true);
  model.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dy)));
  auto const finding = mpx::find_nonfinite(exec, model);
  REQUIRE(finding);
  CHECK(finding->layer == "repeat/1/residual/dense_1");  // not the repeat, nor the residual holding it
  CHECK(finding->pass == "backward");
  CHECK(finding->tensor == "input gradient");
}

TEMPLATE_LIST_TEST_CASE("a repeated model saves and loads by its copies' names, probes loss scales, and keeps "
                        "state inside residual branches",
                        "[model][repeat]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  mpx_test::scratch_dir const dir("repeat");
  auto saved = repeated_model<mpx::mixed_bfloat16>(2);
  saved.build(exec, {tokens, width}, 3);
  mpx::save_model(exec, saved, dir / "two.mpx");
  auto loaded = repeated_model<mpx::mixed_bfloat16>(2);
  loaded.build(exec, {tokens, width}, 99);  // other weights, until the load
  mpx::load_model(exec, loaded, dir / "two.mpx");
  CHECK(bytes_of(exec, loaded.parameters(exec), false) == bytes_of(exec, saved.parameters(exec), false));
  auto deeper = repeated_model<mpx::mixed_bfloat16>(3);
  deeper.build(exec, {tokens, width}, 3);
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, deeper, dir / "two.mpx"), mpx::checkpoint_error,
                         Catch::Contains("repeat/2/residual/layer_normalization/gamma"));

  // Several loss scales backpropagate one batch several times: the copies allow it too.
  std::int64_t const batch = 2;
  auto x = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(static_cast<std::size_t>(batch * tokens * width), -1, 1, 8),
                            {batch, tokens, width});
  auto y = mpx_test::upload(exec, std::vector<std::int32_t>(static_cast<std::size_t>(batch * tokens), 1), {batch, tokens});
  auto const probe = mpx::probe_loss_scales(exec, saved, mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(x)),
                                            mpx::tensor_view<std::int32_t const, space>(mpx::view(y)), {1.0f, 256.0f});
  CHECK(probe.recommended_scale == 256.0f);
  CHECK(probe.rows.size() == saved.parameters(exec).size());

  // Batch norm's statistics inside a residual branch are part of the model's file.
  auto normed = mpx::sequential<mpx::float32>(mpx::dense<>(4), mpx::residual(mpx::batch_norm<>(), mpx::dense<>(4)));
  normed.build(exec, {3}, 1);
  std::vector<std::string> names;
  for (auto const& [name, t] : mpx::detail::model_tensors<space>(normed)) names.push_back(name);
  CHECK(std::find(names.begin(), names.end(), "residual/batch_normalization/moving_mean") != names.end());
}
