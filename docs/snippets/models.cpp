// docs/models.md: a Keras-style model under mixed_float16 with a float32 softmax,
// trained with fit() on a toy problem, evaluated, saved and loaded back.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <vector>

// A batch source: anything with batches_per_epoch(), start_epoch(e) and next().
struct points {
  mpx::tensor<mpx::half> x{mpx::shape{256, 2}};
  mpx::tensor<std::int32_t> y{mpx::shape{256}};
  int at = 0;
  struct batch {
    mpx::tensor_view<mpx::half const> images;
    mpx::tensor_view<std::int32_t const> labels;
  };
  std::size_t batches_per_epoch() const { return 4; }
  void start_epoch(std::size_t) { at = 0; }
  std::optional<batch> next() {
    if (at == 256) return std::nullopt;
    batch b{mpx::tensor_view<mpx::half const>(x.data() + 2 * at, {64, 2}),
            mpx::tensor_view<std::int32_t const>(y.data() + at, {64})};
    at += 64;
    return b;
  }
};

int main() {
  mpx::host_executor exec;  // or mpx::cuda_executor{stream} in a .cu file
  points data;
  for (int i = 0; i < 256; ++i) {  // the class is the quadrant of the point
    float const a = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f, b = static_cast<float>((i * 61) % 103) / 51.0f - 1.0f;
    data.x[2 * i] = mpx::cast<mpx::half>(a);
    data.x[2 * i + 1] = mpx::cast<mpx::half>(b);
    data.y[i] = (a > 0) + 2 * (b > 0);
  }

  auto model = mpx::sequential<mpx::mixed_float16>(        // everything mixed_float16 ...
      mpx::dense<>(16, mpx::activation::tanh),
      mpx::dense<>(4),
      mpx::softmax_layer<mpx::float32>());                 // ... but the softmax
  model.build(exec, {2}, /*seed=*/1);
  std::printf("%s", model.summary().c_str());

  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 2e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::fit_options options;
  options.epochs = 8;
  options.quiet = true;  // the default redraws a progress line on a terminal, else prints plain lines
  auto const history = mpx::fit(exec, model, optimizer, data, options, &data);

  mpx::evaluation const e = mpx::evaluate(exec, model, data);
  std::printf("accuracy %.1f%%, loss %.3f, skipped steps %zu\n", 100 * e.accuracy, e.loss,
              history.back().skipped_steps);

  auto const file = std::filesystem::temp_directory_path() / "mpx_docs_model.mpx";
  mpx::save_model(exec, model, file);       // atomic, versioned, checksummed
  auto copy = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(16, mpx::activation::tanh), mpx::dense<>(4),
                                                  mpx::softmax_layer<mpx::float32>());
  copy.build(exec, {2}, /*seed=*/2);        // other weights ...
  mpx::load_model(exec, copy, file);        // ... replaced by the saved ones
  mpx::evaluation const c = mpx::evaluate(exec, copy, data);
  std::filesystem::remove(file);
  return e.accuracy > 0.9 && c.accuracy == e.accuracy && c.loss == e.loss ? 0 : 1;
}
