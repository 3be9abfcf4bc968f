// An installed mpx used from a CMake project on the host executor: casts, statistics
// and a few steps of a small dense classifier. Prints the MPX_HAS_* defines it was
// compiled with (run.sh compares them with mpx.pc's); returns nonzero on a wrong result.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <optional>

namespace {

int failures = 0;

void expect(bool ok, char const* what) {
  if (!ok) {
    std::fprintf(stderr, "cmake consumer: FAILED: %s\n", what);
    ++failures;
  }
}

// One batch of 64 points in 2-D, labelled by the half-plane x > y.
struct points {
  mpx::tensor<float> x{mpx::shape{64, 2}};
  mpx::tensor<std::int32_t> y{mpx::shape{64}};
  bool given = false;
  struct batch {
    mpx::tensor_view<float const> images;
    mpx::tensor_view<std::int32_t const> labels;
  };
  std::size_t batches_per_epoch() const { return 1; }
  void start_epoch(std::size_t) { given = false; }
  std::optional<batch> next() {
    if (given) return std::nullopt;
    given = true;
    return batch{x.view(), y.view()};
  }
};

}  // namespace

int main() {
  mpx::host_executor exec;

  // Casts round to nearest even; 1e-8 vanishes in half, survives a 2^15 loss scale.
  expect(mpx::cast<float>(mpx::cast<mpx::half>(1.0f + 1.0f / 4096)) == 1.0f, "half rounds 1 + 2^-12 to 1");
  expect(mpx::cast<float>(mpx::cast<mpx::bfloat16>(3.0f)) == 3.0f, "bfloat16 holds 3");
  auto grads = mpx::make_tensor<float>(exec, {1000});
  mpx::fill(exec, grads, 1e-8f);
  expect(mpx::stats(exec, grads).underflow_in_half == 1000, "stats counts 1000 underflows in half");
  mpx::scale(exec, grads, 32768.0f);
  expect(mpx::stats(exec, grads).underflow_in_half == 0, "no underflow after a 2^15 scale");

  // A dense classifier under mixed_float16 with a dynamic loss scale: 60 steps learn.
  points data;
  for (int i = 0; i < 64; ++i) {
    float const a = static_cast<float>((i * 37) % 64) / 32.0f - 1.0f, b = static_cast<float>((i * 23) % 61) / 30.0f - 1.0f;
    data.x[2 * i] = a;
    data.x[2 * i + 1] = b;
    data.y[i] = a > b;
  }
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(8, mpx::activation::tanh), mpx::dense<>(2),
                                                   mpx::softmax_layer<mpx::float32>());
  model.build(exec, {2}, /*seed=*/1);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 5e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  double const before = mpx::evaluate(exec, model, data).loss;
  mpx::fit_options options;
  options.epochs = 60;
  options.quiet = true;
  mpx::fit(exec, model, optimizer, data, options);
  mpx::evaluation const after = mpx::evaluate(exec, model, data);
  expect(after.loss < 0.5 * before, "training halves the loss");
  expect(after.accuracy > 0.9, "training reaches 90% accuracy");
  std::printf("cmake consumer: loss %.4f -> %.4f, accuracy %.1f%%\n", before, after.loss, 100 * after.accuracy);

#ifdef MPX_HAS_CBLAS
  std::printf("define MPX_HAS_CBLAS=1\n");
#endif
#ifdef MPX_HAS_ONEDNN
  std::printf("define MPX_HAS_ONEDNN=1\n");
#endif
#ifdef MPX_HAS_ZLIB
  std::printf("define MPX_HAS_ZLIB=1\n");
#endif
  return failures ? 1 : 0;
}
