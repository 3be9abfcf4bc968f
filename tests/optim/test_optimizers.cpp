// Optimizers and loss_scale_optimizer against float64 transcriptions of PyTorch's SGD,
// Adam and AdamW over 120+ steps for each dtype, with skipped steps (which must not
// advance Adam's bias correction or the learning-rate schedule), clipping, the two
// classic mixed-precision failures and their fixes, checkpoints, and refused input.
#include "support/testing.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <tuple>

#include <unistd.h>

namespace {

using mpx_test::download;
using mpx_test::upload;

// ---- float64 references ----------------------------------------------------------------

// torch.optim.SGD, one element.
struct sgd_reference {
  mpx::sgd_options o;
  void step(double& w, double g, double& buffer, std::uint64_t t, double lr) const {
    if (o.weight_decay != 0) g += o.weight_decay * w;
    if (o.momentum != 0) {
      buffer = t == 1 ? g : o.momentum * buffer + (1 - o.dampening) * g;
      g = o.nesterov ? g + o.momentum * buffer : buffer;
    }
    w -= lr * g;
  }
};

// torch.optim.Adam / AdamW, one element.
struct adam_reference {
  mpx::adam_options o;
  bool decoupled;
  void step(double& w, double g, double& m, double& v, std::uint64_t t, double lr) const {
    if (o.weight_decay != 0) {
      if (decoupled) w -= lr * o.weight_decay * w;
      else g += o.weight_decay * w;
    }
    m = o.beta1 * m + (1 - o.beta1) * g;
    v = o.beta2 * v + (1 - o.beta2) * g * g;
    double const bias1 = 1 - std::pow(static_cast<double>(o.beta1), static_cast<double>(t));
    double const bias2 = 1 - std::pow(static_cast<double>(o.beta2), static_cast<double>(t));
    w -= lr / bias1 * m / (std::sqrt(v) / std::sqrt(bias2) + o.epsilon);
  }
};

// ---- a model's parameters: values and gradients in the executor's space -------------

template <class Exec>
struct parameter_set {
  using space = mpx::memory_space_t<Exec>;
  struct entry {
    std::string name;
    mpx::dtype_id dtype;
    std::vector<double> value;  // the float64 reference master weights
    std::vector<double> slot0, slot1;
    mpx::tensor<std::byte, space> value_bytes, gradient_bytes;
  };
  std::vector<entry> entries;

  // Parameters of dtype T with awkward sizes, plus one float parameter (a bias kept in
  // float beside 16-bit weights, as norms and biases often are).
  template <class T>
  parameter_set(Exec const& exec, T, std::vector<std::size_t> sizes = {1, 17, 1000, 4099}) {
    std::mt19937_64 gen(mpx_test::seed + 77);
    std::uniform_real_distribution<double> dist(-1, 1);
    auto add = [&](auto t, std::size_t n, std::string name) {
      using U = decltype(t);
      entry e{std::move(name), mpx::dtype_id_of<U>, std::vector<double>(n), std::vector<double>(n, 0.0),
              std::vector<double>(n, 0.0), {}, {}};
      std::vector<U> host(n);
      for (std::size_t k = 0; k < n; ++k) {
        host[k] = mpx::cast<U>(dist(gen));
        e.value[k] = mpx::detail::to_double(host[k]);
      }
      e.value_bytes = mpx::make_tensor<std::byte>(exec, {static_cast<std::int64_t>(n * sizeof(U))});
      e.gradient_bytes = mpx::make_tensor<std::byte>(exec, {static_cast<std::int64_t>(n * sizeof(U))});
      mpx::copy(exec, mpx::tensor_view<std::byte const, mpx::host_space>(reinterpret_cast<std::byte const*>(host.data()), e.value_bytes.shape()), e.value_bytes);
      entries.push_back(std::move(e));
    };
    for (std::size_t i = 0; i < sizes.size(); ++i) add(T{}, sizes[i], "layer" + std::to_string(i) + "/kernel");
    add(float{}, 33, "layer0/bias");
    exec.synchronize();
  }

  template <class U>
  static mpx::tensor_view<U, space> typed(mpx::tensor<std::byte, space>& b) {
    return {reinterpret_cast<U*>(b.data()), mpx::shape{static_cast<std::int64_t>(b.size() / sizeof(U))}};
  }

  std::vector<mpx::parameter<space>> parameters() {
    std::vector<mpx::parameter<space>> out;
    for (auto& e : entries) {
      mpx::visit_dtype(e.dtype, [&](auto t) {
        using U = decltype(t);
        out.push_back({e.name, typed<U>(e.value_bytes), typed<U>(e.gradient_bytes)});
      });
    }
    return out;
  }

  // Writes gradients[i] * scale, rounded to each parameter's dtype, and returns what was
  // stored (as doubles) so the reference sees exactly what the optimizer sees.
  std::vector<std::vector<double>> write_gradients(Exec const& exec, std::vector<std::vector<double>> const& g,
                                                   double scale) {
    std::vector<std::vector<double>> stored;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      mpx::visit_dtype(entries[i].dtype, [&](auto t) {
        using U = decltype(t);
        std::vector<U> host(g[i].size());
        std::vector<double> s(g[i].size());
        for (std::size_t k = 0; k < host.size(); ++k) {
          host[k] = mpx::cast<U>(static_cast<float>(g[i][k] * scale));
          s[k] = mpx::detail::to_double(host[k]);
        }
        mpx::copy(exec, mpx::tensor_view<U const, mpx::host_space>(host.data(), mpx::shape{static_cast<std::int64_t>(host.size())}),
                  typed<U>(entries[i].gradient_bytes));
        exec.synchronize();
        stored.push_back(std::move(s));
      });
    }
    return stored;
  }

  std::vector<double> values(Exec const& exec, std::size_t i) {
    std::vector<double> out;
    mpx::visit_dtype(entries[i].dtype, [&](auto t) {
      using U = decltype(t);
      for (U x : download(exec, typed<U>(entries[i].value_bytes))) out.push_back(mpx::detail::to_double(x));
    });
    return out;
  }

  std::vector<std::vector<double>> random_gradients(std::mt19937_64& gen, double magnitude) const {
    std::uniform_real_distribution<double> dist(-magnitude, magnitude);
    std::vector<std::vector<double>> g;
    for (auto const& e : entries) {
      g.emplace_back(e.value.size());
      for (auto& x : g.back()) x = dist(gen);
    }
    return g;
  }

  // Every stored value within one rounding of the reference master weight (plus what
  // float arithmetic accumulates over the run).
  void check_against_reference(Exec const& exec, double float_tolerance) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      auto const got = values(exec, i);
      double const eps = mpx::visit_dtype(entries[i].dtype, [](auto t) {
        return entries_epsilon(t);
      });
      std::size_t bad = 0, first = 0;
      for (std::size_t k = 0; k < got.size(); ++k) {
        double const ref = entries[i].value[k];
        bool const ok = std::abs(got[k] - ref) <= eps * std::abs(ref) + float_tolerance * (1 + std::abs(ref));
        if (!ok && bad++ == 0) first = k;
      }
      INFO(entries[i].name << " (" << mpx::to_string(entries[i].dtype) << "): " << bad << " elements off; first "
                           << first << ": got " << (got.empty() ? 0.0 : got[first]) << ", reference "
                           << (got.empty() ? 0.0 : entries[i].value[first]));
      CHECK(bad == 0);
    }
  }
  template <class U>
  static double entries_epsilon(U) {
    return std::is_same_v<U, float> ? 0.0 : static_cast<double>(mpx::dtype_traits<U>::epsilon());
  }
};

// The step a reference takes for optimizer kind K on every element.
template <class Set, class Ref>
void reference_step(Set& set, Ref const& ref, std::vector<std::vector<double>> const& g, double factor,
                    std::uint64_t t, double lr) {
  for (std::size_t i = 0; i < set.entries.size(); ++i) {
    auto& e = set.entries[i];
    for (std::size_t k = 0; k < e.value.size(); ++k) {
      if constexpr (std::is_same_v<Ref, sgd_reference>) ref.step(e.value[k], g[i][k] * factor, e.slot0[k], t, lr);
      else ref.step(e.value[k], g[i][k] * factor, e.slot0[k], e.slot1[k], t, lr);
    }
  }
}

bool all_finite(std::vector<std::vector<double>> const& g) {
  for (auto const& v : g)
    for (double x : v)
      if (!std::isfinite(x)) return false;
  return true;
}

double global_norm(std::vector<std::vector<double>> const& g, double factor) {
  double s = 0;
  for (auto const& v : g)
    for (double x : v) s += (x * factor) * (x * factor);
  return std::sqrt(s);
}

// The optimizers under test, each with its float64 reference and a schedule.
template <class Exec>
struct sgd_case {
  static constexpr char const* name = "sgd (momentum 0.9, weight decay, dampening)";
  mpx::sgd_options options{.momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f, .nesterov = false};
  auto make(Exec const& exec, auto params) const { return mpx::sgd(exec, params, mpx::exponential_decay{0.05f, 10, 0.9f}, options); }
  sgd_reference reference() const { return {options}; }
  double lr(std::uint64_t applied_before) const { return mpx::exponential_decay{0.05f, 10, 0.9f}(applied_before); }
};
template <class Exec>
struct nesterov_case {
  static constexpr char const* name = "sgd (Nesterov)";
  mpx::sgd_options options{.momentum = 0.8f, .dampening = 0, .weight_decay = 0, .nesterov = true};
  auto make(Exec const& exec, auto params) const { return mpx::sgd(exec, params, 0.03f, options); }
  sgd_reference reference() const { return {options}; }
  double lr(std::uint64_t) const { return 0.03f; }
};
template <class Exec>
struct adam_case {
  static constexpr char const* name = "adam (L2 weight decay)";
  mpx::adam_options options{.beta1 = 0.9f, .beta2 = 0.999f, .epsilon = 1e-8f, .weight_decay = 1e-2f};
  auto make(Exec const& exec, auto params) const { return mpx::adam(exec, params, mpx::cosine_decay{1e-2f, 100, 0.1f, 10}, options); }
  adam_reference reference() const { return {options, false}; }
  double lr(std::uint64_t applied_before) const { return mpx::cosine_decay{1e-2f, 100, 0.1f, 10}(applied_before); }
};
template <class Exec>
struct adamw_case {
  static constexpr char const* name = "adamw (decoupled weight decay)";
  mpx::adamw_options options{.beta1 = 0.8f, .beta2 = 0.99f, .epsilon = 1e-6f, .weight_decay = 0.1f};
  auto make(Exec const& exec, auto params) const { return mpx::adamw(exec, params, 1e-2f, options); }
  adam_reference reference() const { return {options.as_adam(), true}; }
  double lr(std::uint64_t) const { return 1e-2f; }
};

// 130 steps through loss_scale_optimizer with a dynamic scale that grows every 8 finite
// steps (so 16-bit gradients overflow on their own once it is large), inf planted in
// some steps, and global-norm clipping; the reference skips exactly the steps whose
// stored gradients are not finite.
template <class Exec, class Case, class T>
void run_against_reference(Case const& c, T) {
  Exec exec;
  parameter_set<Exec> set(exec, T{});
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 256;
  rule.growth_interval = 8;
  rule.report_after = 1000;
  float const clip = 4.0f;
  mpx::loss_scale_optimizer lso(c.make(exec, set.parameters()), mpx::dynamic_loss_scaler(exec, rule),
                                {.clip_global_norm = clip});
  auto const ref = c.reference();
  std::mt19937_64 gen(mpx_test::seed + 5);
  std::uint64_t applied = 0, skipped = 0;
  for (int step = 0; step < 130; ++step) {
    double const scale = lso.scaler().scale(exec);
    auto g = set.random_gradients(gen, 1.0);
    if (step % 17 == 5) g[step % g.size()].back() = std::numeric_limits<double>::infinity();
    auto const stored = set.write_gradients(exec, g, scale);
    lso.step(exec);
    bool const finite = all_finite(stored);
    INFO("step " << step << ", scale " << scale);
    REQUIRE(lso.last_check(exec).found_nonfinite == (finite ? 0u : 1u));
    if (!finite) {
      ++skipped;
      continue;
    }
    ++applied;
    double const norm = global_norm(stored, 1 / scale);
    double const coefficient = std::min(1.0, clip / (norm + 1e-6));
    reference_step(set, ref, stored, coefficient / scale, applied, c.lr(applied - 1));
  }
  INFO(Case::name << " on " << mpx::dtype_name<T>);
  CHECK(lso.optimizer().steps(exec) == applied);
  CHECK(lso.scaler().state(exec).skipped_steps == skipped);
  CHECK(skipped >= 7);
  set.check_against_reference(exec, 2e-5);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("optimizers match float64 PyTorch over 130 loss-scaled steps with skips and clipping",
                        "[optim]", mpx_test::executors) {
  mpx_test::for_each_dtype([](auto t) {
    run_against_reference<TestType>(sgd_case<TestType>{}, t);
    run_against_reference<TestType>(nesterov_case<TestType>{}, t);
    run_against_reference<TestType>(adam_case<TestType>{}, t);
    run_against_reference<TestType>(adamw_case<TestType>{}, t);
  });
}

TEMPLATE_LIST_TEST_CASE("a plain optimizer step matches the reference and counts every step", "[optim]",
                        mpx_test::executors) {
  TestType exec;
  mpx_test::for_each_dtype([&](auto t) {
    parameter_set<TestType> set(exec, t);
    adam_case<TestType> c;
    auto opt = c.make(exec, set.parameters());
    std::mt19937_64 gen(mpx_test::seed + 6);
    for (std::uint64_t step = 1; step <= 110; ++step) {
      auto const stored = set.write_gradients(exec, set.random_gradients(gen, 0.5), 1.0);
      opt.step(exec);
      reference_step(set, c.reference(), stored, 1.0, step, c.lr(step - 1));
    }
    INFO(mpx::dtype_name<decltype(t)>);
    CHECK(opt.steps(exec) == 110);
    set.check_against_reference(exec, 2e-5);
  });
}

TEMPLATE_LIST_TEST_CASE("a skipped step changes nothing: values, moments, step count, schedule", "[optim]",
                        mpx_test::executors) {
  TestType exec;
  parameter_set<TestType> set(exec, mpx::half{});
  mpx::loss_scale_optimizer lso(mpx::adam(exec, set.parameters(), 1e-2f), mpx::static_loss_scaler(exec, 1024.0f));
  std::mt19937_64 gen(mpx_test::seed + 8);
  set.write_gradients(exec, set.random_gradients(gen, 1.0), 1024.0);
  lso.step(exec);
  std::vector<std::vector<double>> before;
  for (std::size_t i = 0; i < set.entries.size(); ++i) before.push_back(set.values(exec, i));
  auto g = set.random_gradients(gen, 1.0);
  g[2][500] = std::numeric_limits<double>::quiet_NaN();
  set.write_gradients(exec, g, 1024.0);
  lso.step(exec);
  auto const verdict = lso.last_check(exec);
  CHECK(verdict.found_nonfinite == 1);
  CHECK(verdict.first_nonfinite == 2);
  for (std::size_t i = 0; i < set.entries.size(); ++i) CHECK(set.values(exec, i) == before[i]);
  CHECK(lso.optimizer().steps(exec) == 1);
  CHECK(lso.scaler().state(exec).skipped_steps == 1);
  // The next finite step is Adam's step 2 (bias correction of t = 2), not 3: checked
  // by the reference runs above; here, that it is applied at all.
  set.write_gradients(exec, set.random_gradients(gen, 1.0), 1024.0);
  lso.step(exec);
  CHECK(lso.optimizer().steps(exec) == 2);
  CHECK(set.values(exec, 2) != before[2]);
}

TEMPLATE_LIST_TEST_CASE("classic failure 1: float16 gradients underflow to zero; a loss scale keeps them",
                        "[optim]", mpx_test::executors) {
  TestType exec;
  // Gradients of about 1e-8, as a deep network's early layers see: below half's
  // smallest subnormal (6e-8), so stored in half they are all zero.
  // A learning rate large enough that the true update, lr * g ~ 0.1, is far above the
  // weights' own rounding, so what the update loses is the gradients'.
  double const lr = 1e7;
  auto run = [&](float loss_scale) {
    parameter_set<TestType> set(exec, mpx::half{}, {4099});
    auto opt = mpx::sgd(exec, set.parameters(), static_cast<float>(lr));
    mpx::loss_scale_optimizer lso(std::move(opt), mpx::static_loss_scaler(exec, loss_scale));
    std::mt19937_64 gen(mpx_test::seed + 9);
    auto g = set.random_gradients(gen, 2e-8);
    auto const start = set.values(exec, 0);
    auto const stored = set.write_gradients(exec, g, loss_scale);
    lso.step(exec);
    auto const after = set.values(exec, 0);
    std::size_t nonzero = 0, moved = 0;
    for (std::size_t k = 0; k < g[0].size(); ++k) {
      nonzero += stored[0][k] != 0;
      moved += after[k] != start[k];
    }
    // The update each weight should get, lr * g, against the one it got.
    double err = 0, size = 0;
    for (std::size_t k = 0; k < g[0].size(); ++k) {
      err += std::pow((start[k] - after[k]) - lr * g[0][k], 2);
      size += std::pow(lr * g[0][k], 2);
    }
    return std::tuple{nonzero, moved, std::sqrt(err / size), lso.last_check(exec).norm};
  };
  auto const [nonzero_unscaled, moved_unscaled, error_unscaled, norm_unscaled] = run(1.0f);
  CHECK(nonzero_unscaled < 4099 / 5);  // almost every gradient is exactly zero
  CHECK(error_unscaled > 0.5);         // so the update is mostly lost
  auto const [nonzero_scaled, moved_scaled, error_scaled, norm_scaled] = run(65536.0f);
  CHECK(nonzero_scaled == 4099);
  CHECK(moved_scaled > 4000);   // a few updates round away in the half weights
  CHECK(error_scaled < 2e-2);   // the rest is half's rounding of the weights
  CHECK(norm_scaled > 2 * norm_unscaled);
}

TEMPLATE_LIST_TEST_CASE("classic failure 2: tiny updates vanish on half weights; float master weights keep them",
                        "[optim]", mpx_test::executors) {
  TestType exec;
  // lr * g = 1e-4 per step on weights near 1, where half's spacing is 2^-10 ~ 9.8e-4:
  // applied to the half weight directly, each update rounds back to the same value.
  auto w = upload(exec, std::vector<mpx::half>(1000, mpx::cast<mpx::half>(1.0f)));
  auto g = upload(exec, std::vector<mpx::half>(1000, mpx::cast<mpx::half>(1.0f)));
  for (int step = 0; step < 100; ++step) mpx::axpy(exec, -1e-4f, g, w);
  for (auto x : download(exec, w)) REQUIRE(mpx::cast<float>(x) == 1.0f);  // 100 updates, all lost

  // The same 100 steps through mpx::sgd, which keeps a float master copy.
  std::vector<mpx::parameter<mpx::memory_space_t<TestType>>> params = {{"w", mpx::view(w), mpx::view(g)}};
  auto opt = mpx::sgd(exec, params, 1e-4f);
  for (int step = 0; step < 100; ++step) opt.step(exec);
  for (auto x : download(exec, w)) REQUIRE(std::abs(mpx::cast<float>(x) - 0.99f) <= 0.5f * 0.00048828125f);
}

TEMPLATE_LIST_TEST_CASE("checkpoints round-trip, and a bad one is refused with nothing changed", "[optim][checkpoint]",
                        mpx_test::executors) {
  TestType exec;
  auto const dir = std::filesystem::temp_directory_path() /
                   ("mpx_checkpoint_test_" + std::string(TestType::name) + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto const path = dir / "step.mpxckpt";

  auto make = [&](parameter_set<TestType>& set) {
    mpx::dynamic_scale_rule rule;
    rule.growth_interval = 3;
    return mpx::loss_scale_optimizer(mpx::adamw(exec, set.parameters(), 1e-2f),
                                     mpx::dynamic_loss_scaler(exec, rule));
  };
  std::mt19937_64 gen(mpx_test::seed + 10);
  parameter_set<TestType> a_set(exec, mpx::bfloat16{});
  auto a = make(a_set);
  for (int step = 0; step < 7; ++step) {
    auto g = a_set.random_gradients(gen, 1e-3);
    if (step == 4) g[0][0] = std::numeric_limits<double>::infinity();
    a_set.write_gradients(exec, g, a.scaler().scale(exec));
    a.step(exec);
  }
  a.save(exec, path);
  for (auto const& f : std::filesystem::directory_iterator(dir)) CHECK(f.path() == path);  // no temporary left

  // A fresh optimizer over fresh parameters of the same shapes takes everything over.
  parameter_set<TestType> b_set(exec, mpx::bfloat16{});
  auto b = make(b_set);
  b.load(exec, path);
  CHECK(b.optimizer().steps(exec) == a.optimizer().steps(exec));
  CHECK(b.scaler().scale(exec) == a.scaler().scale(exec));
  CHECK(b.scaler().state(exec).skipped_steps == 1);
  for (std::size_t i = 0; i < a_set.entries.size(); ++i) CHECK(b_set.values(exec, i) == a_set.values(exec, i));
  // ... and continues exactly as the original would (moments and masters came along).
  auto const g = a_set.random_gradients(gen, 1e-3);
  a_set.write_gradients(exec, g, a.scaler().scale(exec));
  b_set.write_gradients(exec, g, b.scaler().scale(exec));
  a.step(exec);
  b.step(exec);
  for (std::size_t i = 0; i < a_set.entries.size(); ++i) CHECK(b_set.values(exec, i) == a_set.values(exec, i));

  // Refusals: each leaves the receiving optimizer exactly as it was.
  parameter_set<TestType> c_set(exec, mpx::bfloat16{});
  auto c = make(c_set);
  auto const untouched = c_set.values(exec, 2);
  auto refused = [&](std::filesystem::path const& p, char const* why) {
    INFO(why);
    CHECK_THROWS_TYPE_WITH(c.load(exec, p), mpx::checkpoint_error, Catch::Contains(why));
    CHECK(c_set.values(exec, 2) == untouched);
    CHECK(c.optimizer().steps(exec) == 0);
    CHECK(c.scaler().scale(exec) == 32768.0f);
  };
  auto const bytes = [&] {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  }();
  auto write = [&](std::string const& name, std::vector<char> const& content) {
    std::ofstream(dir / name, std::ios::binary).write(content.data(), static_cast<std::streamsize>(content.size()));
    return dir / name;
  };
  auto flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;
  refused(write("flipped", flipped), "checksum");
  refused(write("truncated", std::vector<char>(bytes.begin(), bytes.begin() + static_cast<long>(bytes.size() - 100))),
          "checksum");
  refused(write("empty", {}), "not an mpx checkpoint");
  auto swapped = bytes;  // the version field as a machine of the other byte order writes it
  std::reverse(swapped.begin() + 8, swapped.begin() + 12);
  refused(write("swapped", swapped), "other byte order");
  refused(dir / "missing", "cannot open it: No such file");
  // Another model's checkpoint: other shapes.
  parameter_set<TestType> d_set(exec, mpx::bfloat16{}, {1, 17, 999, 4099});
  auto d = make(d_set);
  d.save(exec, dir / "other_model");
  refused(dir / "other_model", "parameter list");
  // Another optimizer: Adam where AdamW is expected.
  parameter_set<TestType> e_set(exec, mpx::bfloat16{});
  mpx::loss_scale_optimizer e(mpx::adam(exec, e_set.parameters(), 1e-2f), mpx::dynamic_loss_scaler(exec));
  e.save(exec, dir / "adam");
  refused(dir / "adam", "optimizer differs");
  // Another loss scaler: a static one where a dynamic one is expected.
  parameter_set<TestType> f_set(exec, mpx::bfloat16{});
  mpx::loss_scale_optimizer f(mpx::adamw(exec, f_set.parameters(), 1e-2f), mpx::static_loss_scaler(exec, 8.0f));
  f.save(exec, dir / "static");
  refused(dir / "static", "loss scaler is a mpx::static_loss_scaler, this one is a mpx::dynamic_loss_scaler");

  // A plain optimizer saves and loads on its own; SGD with momentum keeps a buffer that
  // SGD without it cannot take.
  parameter_set<TestType> s_set(exec, mpx::half{});
  auto momentum = mpx::sgd(exec, s_set.parameters(), 0.1f, {.momentum = 0.9f});
  s_set.write_gradients(exec, s_set.random_gradients(gen, 1.0), 1.0);
  momentum.step(exec);
  momentum.save(exec, dir / "sgd");
  parameter_set<TestType> t_set(exec, mpx::half{});
  auto same = mpx::sgd(exec, t_set.parameters(), 0.1f, {.momentum = 0.9f});
  same.load(exec, dir / "sgd");
  CHECK(same.steps(exec) == 1);
  for (std::size_t i = 0; i < s_set.entries.size(); ++i) CHECK(t_set.values(exec, i) == s_set.values(exec, i));
  auto plain = mpx::sgd(exec, t_set.parameters(), 0.1f);
  CHECK_THROWS_TYPE_WITH(plain.load(exec, dir / "sgd"), mpx::checkpoint_error,
                         Catch::Contains("state kept per parameter") && Catch::Contains("momentum buffer"));
  CHECK_THROWS_TYPE_WITH(plain.load(exec, path), mpx::checkpoint_error, Catch::Contains("holds a mpx::loss_scale_optimizer"));

  // A save that cannot be written fails loudly and leaves the old file alone.
  CHECK_THROWS_TYPE_WITH(a.save(exec, dir / "no_such_dir" / "x"), mpx::checkpoint_error, Catch::Contains("cannot write"));
  std::filesystem::remove_all(dir);
}

// One launch carries a table of at most `capacity` parameters (their pointers travel in
// the kernel's parameters); a longer list takes several launches per dtype, each
// parameter in exactly one, all reading the same verdict and step count. Just above one
// table and just above two, with a two-chunk parameter near the end: five Adam steps
// against float64, one of them skipped for an inf in the very last parameter.
TEMPLATE_LIST_TEST_CASE("adam over more parameters than one launch table holds matches float64; a late inf skips",
                        "[optim]", mpx_test::executors) {
  TestType exec;
  using adam_type = decltype(adam_case<TestType>{}.make(exec, std::vector<mpx::parameter<mpx::memory_space_t<TestType>>>{}));
  constexpr std::size_t capacity = mpx::detail::tensor_table<adam_type::lists>::capacity;
  static_assert(adam_type::lists == 5, "value, gradient, master copy and two moments");
  auto run = [&](auto tag, std::size_t count) {
    using T = decltype(tag);
    std::vector<std::size_t> sizes(count);
    for (std::size_t i = 0; i < count; ++i) sizes[i] = 1 + (i * 7) % 23;
    sizes[count - 2] = mpx::detail::multi_tensor_chunk + 1;  // two chunks, in the last table
    parameter_set<TestType> set(exec, T{}, sizes);           // count parameters of T, then a float bias
    std::size_t const last = count - 1;                      // the last parameter of T's last table
    adam_case<TestType> const c;
    float const scale = 256.0f;
    mpx::loss_scale_optimizer lso(c.make(exec, set.parameters()), mpx::static_loss_scaler(exec, scale));
    std::mt19937_64 gen(mpx_test::seed + 13 + count);
    std::uint64_t applied = 0;
    for (int step = 0; step < 5; ++step) {
      auto g = set.random_gradients(gen, 1.0);
      bool const skip = step == 3;
      if (skip) g[last].back() = std::numeric_limits<double>::infinity();
      std::vector<std::vector<double>> before;
      if (skip)
        for (std::size_t i = 0; i < set.entries.size(); ++i) before.push_back(set.values(exec, i));
      auto const stored = set.write_gradients(exec, g, scale);
      lso.step(exec);
      auto const verdict = lso.last_check(exec);
      INFO(mpx::dtype_name<T> << ", " << count << " parameters (" << capacity << " per table), step " << step);
      if (skip) {
        REQUIRE(verdict.found_nonfinite == 1);
        CHECK(verdict.first_nonfinite == static_cast<std::int32_t>(last));
        std::size_t changed = 0;
        for (std::size_t i = 0; i < set.entries.size(); ++i) changed += set.values(exec, i) != before[i];
        CHECK(changed == 0);
        continue;
      }
      REQUIRE(verdict.found_nonfinite == 0);
      ++applied;
      reference_step(set, c.reference(), stored, 1.0 / scale, applied, c.lr(applied - 1));
    }
    INFO(mpx::dtype_name<T> << ", " << count << " parameters (" << capacity << " per table)");
    CHECK(lso.optimizer().steps(exec) == applied);
    CHECK(applied == 4);
    set.check_against_reference(exec, 2e-5);
  };
  run(mpx::half{}, capacity + 1);
  run(float{}, 2 * capacity + 1);  // with the float bias: 2 * capacity + 2 float parameters
  run(mpx::bfloat16{}, 2 * capacity + 1);
}

// A linear decay that forgot to stop at zero.
struct falls_below_zero {
  MPX_HD float operator()(std::uint64_t step) const noexcept { return 0.1f - 0.001f * static_cast<float>(step); }
};

TEMPLATE_LIST_TEST_CASE("optimizers refuse bad parameters and options with messages that name them", "[optim]",
                        mpx_test::executors) {
  TestType exec;
  auto w = mpx::make_tensor<mpx::half>(exec, {4, 3});
  auto g_shape = mpx::make_tensor<mpx::half>(exec, {3, 4});
  auto g_type = mpx::make_tensor<float>(exec, {4, 3});
  using P = mpx::parameter<mpx::memory_space_t<TestType>>;
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, std::vector<P>{{"dense/kernel", w, g_shape}}, 0.1f), mpx::shape_error,
                         Catch::Contains("'dense/kernel' has shape [4, 3] but its gradient has shape [3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::adam(exec, std::vector<P>{{"dense/kernel", w, g_type}}, 0.1f), mpx::shape_error,
                         Catch::Contains("'dense/kernel' is float16 but its gradient is float32"));
  auto g = mpx::make_tensor<mpx::half>(exec, {4, 3});
  std::vector<P> ok = {{"dense/kernel", w, g}};
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, ok, 0.1f, {.momentum = 0, .nesterov = true}), mpx::invalid_argument,
                         Catch::Contains("Nesterov"));
  CHECK_THROWS_TYPE_WITH(mpx::adam(exec, ok, 0.1f, {.beta1 = 1.0f}), mpx::invalid_argument, Catch::Contains("beta1"));
  CHECK_THROWS_TYPE_WITH(mpx::adamw(exec, ok, 0.1f, {.epsilon = 0}), mpx::invalid_argument, Catch::Contains("epsilon"));
  // A NaN or infinite decay or dampening would poison every weight at the first step (the API fuzzer found them accepted).
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, ok, 0.1f, {.weight_decay = std::nanf("")}), mpx::invalid_argument,
                         Catch::Contains("weight_decay must be finite and >= 0, got nan"));
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, ok, 0.1f, {.weight_decay = -0.1f}), mpx::invalid_argument, Catch::Contains("weight_decay"));
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, ok, 0.1f, {.momentum = 0.9f, .dampening = HUGE_VALF}), mpx::invalid_argument,
                         Catch::Contains("dampening must be finite"));
  CHECK_THROWS_TYPE_WITH(mpx::adam(exec, ok, 0.1f, {.weight_decay = HUGE_VALF}), mpx::invalid_argument,
                         Catch::Contains("weight_decay"));
  CHECK_THROWS_TYPE_WITH(mpx::adamw(exec, ok, 0.1f, {.weight_decay = std::nanf("")}), mpx::invalid_argument,
                         Catch::Contains("adamw: weight_decay"));
  // A parameter listed twice would be stepped twice; a gradient in its value's memory overwritten by its own update.
  auto g2 = mpx::make_tensor<mpx::half>(exec, {4, 3});
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, std::vector<P>{{"a", w, g}, {"b", w, g2}}, 0.1f), mpx::invalid_argument,
                         Catch::Contains("the value of 'a' and the value of 'b' overlap in memory (a parameter listed twice?"));
  CHECK_THROWS_TYPE_WITH(mpx::adam(exec, std::vector<P>{{"a", w, w}}, 0.1f), mpx::invalid_argument,
                         Catch::Contains("adam: the value of 'a' and the gradient of 'a' overlap in memory"));
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, ok, -0.1f), mpx::invalid_argument,
                         Catch::Contains("sgd: the learning rate must be finite and >= 0; at step 0 the schedule gives -0.1"));
  CHECK_THROWS_TYPE_WITH(mpx::adam(exec, ok, std::nanf("")), mpx::invalid_argument, Catch::Contains("gives nan"));
  // decay_steps = 0 divides 0 by 0 at the first step.
  CHECK_THROWS_TYPE_WITH(mpx::adamw(exec, ok, mpx::exponential_decay{.initial_rate = 0.1f, .decay_steps = 0}),
                         mpx::invalid_argument, Catch::Contains("at step 0"));
  // A schedule that turns negative later is caught too.
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, ok, falls_below_zero{}), mpx::invalid_argument, Catch::Contains("at step 1000"));
  CHECK_NOTHROW(mpx::sgd(exec, ok, 0.0f));  // a zero rate (a frozen run) is allowed
  // AdamW keeps PyTorch's default decay when other options are given.
  CHECK(mpx::adamw(exec, ok, 0.1f, {.beta2 = 0.99f}).rule().options.weight_decay == 0.01f);
  // Momentum switched on after construction: no buffer was allocated for it.
  auto plain = mpx::sgd(exec, ok, 0.1f);
  plain.rule().options.momentum = 0.9f;
  CHECK_THROWS_TYPE_WITH(plain.step(exec), mpx::invalid_argument, Catch::Contains("make a new optimizer"));
}

#if MPX_HAS_CUDA
// The proof that a step never waits for the host: capturing it in a CUDA graph in the
// strictest mode fails on any synchronising call. The graph is then replayed while the
// scale grows and backs off on the device, against the same steps taken eagerly.
TEST_CASE("a loss-scaled step makes no host synchronisation: captured in a CUDA graph, replayed exactly",
          "[optim][cuda]") {
  cudaStream_t stream = nullptr;
  MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {  // everything allocated on the stream is freed before the stream is destroyed
  mpx::cuda_executor exec{stream};
  parameter_set<mpx::cuda_executor> eager_set(exec, mpx::half{}), graph_set(exec, mpx::half{});
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 1024;
  rule.growth_interval = 4;
  auto make = [&](parameter_set<mpx::cuda_executor>& set) {
    return mpx::loss_scale_optimizer(mpx::adam(exec, set.parameters(), 1e-3f), mpx::dynamic_loss_scaler(exec, rule),
                                     {.clip_global_norm = 1.0f});
  };
  auto eager = make(eager_set);
  auto graphed = make(graph_set);
  // Backpropagating a scaled loss scales every gradient: here, directly.
  auto scaled_step = [&](auto& lso, parameter_set<mpx::cuda_executor>& set) {
    for (auto& e : set.entries)
      mpx::visit_dtype(e.dtype, [&](auto t) {
        lso.scale_loss_gradient(exec, parameter_set<mpx::cuda_executor>::typed<decltype(t)>(e.gradient_bytes));
      });
    lso.step(exec);
  };
  scaled_step(eager, eager_set);  // the first eager step warms up (device attributes, modules)
  scaled_step(graphed, graph_set);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t instance = nullptr;
  MPX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  scaled_step(graphed, graph_set);
  MPX_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MPX_CUDA_CHECK(cudaGraphInstantiate(&instance, graph, 0));

  std::mt19937_64 gen(mpx_test::seed + 11);
  std::uint64_t skipped = 0;
  for (int step = 0; step < 24; ++step) {
    auto g = eager_set.random_gradients(gen, 1.0);
    if (step % 7 == 3) g[1][3] = std::numeric_limits<double>::infinity();
    eager_set.write_gradients(exec, g, 1.0);
    graph_set.write_gradients(exec, g, 1.0);
    scaled_step(eager, eager_set);
    MPX_CUDA_CHECK(cudaGraphLaunch(instance, stream));
    exec.synchronize();
    INFO("step " << step);
    auto const a = eager.scaler().state(exec), b = graphed.scaler().state(exec);
    REQUIRE(a.scale == b.scale);
    REQUIRE(a.skipped_steps == b.skipped_steps);
    skipped = a.skipped_steps;
    for (std::size_t i = 0; i < eager_set.entries.size(); ++i) REQUIRE(graph_set.values(exec, i) == eager_set.values(exec, i));
  }
  CHECK(skipped >= 4);  // planted and natural overflows both happened
  CHECK(graphed.optimizer().steps(exec) == eager.optimizer().steps(exec));
  MPX_CUDA_CHECK(cudaGraphExecDestroy(instance));
  MPX_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  MPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  MPX_CUDA_CHECK(cudaStreamDestroy(stream));
}
#endif
