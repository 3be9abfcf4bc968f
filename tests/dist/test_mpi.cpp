// Data-parallel training between host processes on MPI. Meson runs this program under
// `mpirun -np 2` and `-np 3` (an odd count catches even-count assumptions): every rank
// runs every case, in the same order, and the collectives meet. Each rank also trains
// the single-process reference itself (no communication) to compare with.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <mpx/mpx.hpp>
#include <mpx/dist/data_parallel.hpp>
#include <mpx/dist/mpi_communicator.hpp>

#include "support/testing.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <vector>

namespace fs = std::filesystem;

namespace {

mpx::mpi_communicator* world = nullptr;

mpx::mpi_communicator& comm() { return *world; }

// Rank r's input for an all-reduce: seeded by rank, so every rank can make every other's.
template <class T>
std::vector<T> rank_values(std::size_t n, int rank) {
  return mpx_test::random_values<T>(n, -4.0, 4.0, 1000 + static_cast<std::uint64_t>(rank));
}

template <class T>
std::uint64_t checksum(std::vector<T> const& v) {
  return mpx::detail::fnv1a(std::as_bytes(std::span<T const>(v.data(), v.size())));
}

// Whether every rank holds the same 64-bit value.
bool same_on_every_rank(std::uint64_t h) {
  auto const [hi, lo] = mpx::detail::as_two_doubles(h);
  double const mine[2] = {hi, lo};
  auto const all = comm().all_gather_values(mine);
  for (std::size_t i = 0; i < all.size(); i += 2)
    if (all[i] != hi || all[i + 1] != lo) return false;
  return true;
}

// Labelled points in the plane, class = quadrant, as a [N, width, 1, 1] image set (x and
// y repeated across the width: fp8 layers take inputs a multiple of 16 wide).
mpx::image_dataset quadrant_images(std::size_t n, std::uint64_t stream, std::size_t width = 2) {
  auto xy = mpx_test::random_values<float>(2 * n, -1.0, 1.0, stream);
  mpx::image_dataset d;
  d.images = mpx::tensor<float>(mpx::host_executor{}, mpx::shape{static_cast<std::int64_t>(n), static_cast<std::int64_t>(width), 1, 1});
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < width; ++j) d.images.data()[i * width + j] = xy[2 * i + j % 2];
  d.num_classes = 4;
  for (std::size_t i = 0; i < n; ++i) d.labels.push_back((xy[2 * i] > 0 ? 1 : 0) + (xy[2 * i + 1] > 0 ? 2 : 0));
  return d;
}

template <class P>
auto small_model(std::int64_t width = 16) {
  return mpx::sequential<P>(mpx::flatten<>(), mpx::dense<>(width, mpx::activation::tanh), mpx::dense<>(4),
                            mpx::softmax_layer<mpx::float32>());
}

// Two fp8 layers on 16-wide inputs (the GPU's rules hold on every executor: an fp8
// product's N, the units or the input width, a multiple of 16), the last out of fp8.
template <class P = mpx::mixed_fp8>
auto small_fp8_model() {
  return mpx::sequential<P>(mpx::flatten<>(), mpx::dense<>(16, mpx::activation::tanh),
                            mpx::dense<>(16, mpx::activation::tanh), mpx::dense<mpx::without_fp8<P>>(4),
                            mpx::softmax_layer<mpx::float32>());
}

template <class Model>
auto sgd_with_dynamic_scale(mpx::host_executor const& exec, Model& model, float clip_global_norm = 0) {
  return mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.5f),
                                   mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()),
                                   {.clip_global_norm = clip_global_norm});
}

template <class Model>
std::vector<std::vector<double>> parameter_values(mpx::host_executor const& exec, Model& model) {
  std::vector<std::vector<double>> out;
  for (auto& p : model.parameters(exec))
    mpx::visit_dtype(p.value.dtype(), [&](auto t) {
      using T = decltype(t);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, mpx::half> || std::is_same_v<T, mpx::bfloat16>)
        out.push_back(mpx_test::widen(mpx_test::download(exec, p.value.template as<T>())));
    });
  return out;
}

// One epoch of mpx::fit as this replica, on quadrant points: `per_replica` samples each,
// in local batches of `batch`.
template <class Model, class Optimizer>
void fit_one_epoch(mpx::host_executor const& exec, mpx::data_parallel<mpx::mpi_communicator>& dp, Model& model,
                   Optimizer& opt, std::size_t per_replica, std::size_t batch, std::uint64_t stream) {
  auto const data = quadrant_images(per_replica * static_cast<std::size_t>(comm().size()), stream);
  mpx::batch_loader<mpx::host_executor, mpx::half> shard(
      exec, data, {.batch_size = batch, .replica = static_cast<std::size_t>(comm().rank()),
                   .replicas = static_cast<std::size_t>(comm().size())});
  mpx::fit_options options;
  options.quiet = true;
  options.replicas = dp.hooks(exec);
  mpx::fit(exec, model, opt, shard, options);
}

}  // namespace

TEST_CASE("mpi_communicator all-reduces every dtype in place, the same bits on every rank", "[dist]") {
  mpx::host_executor exec;
  int const ranks = comm().size();
  mpx_test::for_each_dtype([&](auto t) {
    using T = decltype(t);
    double const eps = std::ldexp(1.0, -mpx::dtype_traits<T>::mantissa_bits);
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1021}, std::size_t{65537}}) {
      INFO(mpx::dtype_name<T> << " n=" << n);
      std::vector<std::vector<T>> inputs;
      for (int r = 0; r < ranks; ++r) inputs.push_back(rank_values<T>(n, r));
      for (auto op : {mpx::reduce_op::sum, mpx::reduce_op::max, mpx::reduce_op::min}) {
        auto data = mpx_test::upload(exec, inputs[static_cast<std::size_t>(comm().rank())], {static_cast<std::int64_t>(n)});
        comm().all_reduce(exec, data, op);
        auto const got = mpx_test::download(exec, data);
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n; ++i) {
          double exact = op == mpx::reduce_op::sum ? 0.0 : static_cast<double>(mpx::cast<float>(inputs[0][i]));
          double magnitude = 0;
          for (int r = 0; r < ranks; ++r) {
            double const x = static_cast<double>(mpx::cast<float>(inputs[static_cast<std::size_t>(r)][i]));
            magnitude += std::abs(x);
            if (op == mpx::reduce_op::sum) exact += x;
            else if (op == mpx::reduce_op::max) exact = std::max(exact, x);
            else exact = std::min(exact, x);
          }
          double const g = static_cast<double>(mpx::cast<float>(got[i]));
          // A sum rounds once per addition: within (ranks - 1) roundings of the operands' size.
          double const tolerance = op == mpx::reduce_op::sum ? ranks * eps * magnitude : 0.0;
          if (!(std::abs(g - exact) <= tolerance) && bad++ == 0)
            FAIL_CHECK(mpx::to_string(op) << " element " << i << ": got " << g << ", float64 says " << exact);
        }
        CHECK(bad == 0);
        CHECK(same_on_every_rank(checksum(got)));
      }
    }
  });
}

TEST_CASE("a NaN or inf on one rank reaches every rank's result", "[dist]") {
  mpx::host_executor exec;
  int const last = comm().size() - 1;
  mpx_test::for_each_dtype([&](auto t) {
    using T = decltype(t);
    INFO(mpx::dtype_name<T>);
    for (auto op : {mpx::reduce_op::sum, mpx::reduce_op::max, mpx::reduce_op::min}) {
      std::vector<T> v(5, mpx::cast<T>(1.0f));
      if (comm().rank() == last) {
        v[1] = mpx::cast<T>(std::numeric_limits<float>::quiet_NaN());
        v[3] = mpx::cast<T>(std::numeric_limits<float>::infinity());
      }
      if (comm().rank() == 0) v[3] = mpx::cast<T>(-std::numeric_limits<float>::infinity());
      auto data = mpx_test::upload(exec, v, {5});
      comm().all_reduce(exec, data, op);
      auto const got = mpx_test::download(exec, data);
      INFO(mpx::to_string(op));
      CHECK(mpx::is_nan(got[1]));
      CHECK(!mpx::is_finite(got[3]));  // inf + -inf is NaN; max/min keep an inf
      CHECK(mpx::cast<float>(got[0]) == (op == mpx::reduce_op::sum ? static_cast<float>(comm().size()) : 1.0f));
    }
  });
}

namespace nan_keys {

// The max the keys must give: the larger value, a NaN whenever either is one (-0 < +0).
double expected_max(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  if (a == b) return std::signbit(a) ? b : a;
  return a > b ? a : b;
}

// Every value of a 16-bit format, in order of value (NaNs apart): keys strictly increase
// along it, every NaN's key is above +inf's, and each key turns back into its value (a
// NaN with its sign cleared, its payload kept); negated keys order -x.
template <class T>
void check_every_16_bit_value() {
  INFO(mpx::dtype_name<T>);
  using B = mpx::detail::bits_t<T>;
  std::vector<T> numbers, nans;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    T const x = mpx::detail::from_bits<T>(static_cast<B>(b));
    (mpx::is_nan(x) ? nans : numbers).push_back(x);
  }
  std::sort(numbers.begin(), numbers.end(), [](T a, T b) {
    double const x = mpx::detail::to_double(a), y = mpx::detail::to_double(b);
    return x < y || (x == y && std::signbit(x) && !std::signbit(y));  // -0 before +0
  });
  REQUIRE(numbers.size() == 65536 - nans.size());
  B const inf_key = mpx::detail::nan_keeping_max_key(mpx::cast<T>(std::numeric_limits<float>::infinity()));
  std::size_t bad_order = 0, bad_round_trip = 0, bad_negated = 0;
  for (std::size_t i = 0; i < numbers.size(); ++i) {
    B const k = mpx::detail::nan_keeping_max_key(numbers[i]);
    if (i && !(mpx::detail::nan_keeping_max_key(numbers[i - 1]) < k)) ++bad_order;
    if (mpx::bits(mpx::detail::from_nan_keeping_max_key<T>(k)) != mpx::bits(numbers[i])) ++bad_round_trip;
    // The negated key orders -x: the order reverses.
    if (i && !(mpx::detail::nan_keeping_max_key(numbers[i - 1], true) > mpx::detail::nan_keeping_max_key(numbers[i], true)))
      ++bad_negated;
    if (mpx::bits(mpx::detail::from_nan_keeping_max_key<T>(mpx::detail::nan_keeping_max_key(numbers[i], true), true)) !=
        mpx::bits(numbers[i]))
      ++bad_negated;
  }
  CHECK(bad_order == 0);
  CHECK(bad_round_trip == 0);
  CHECK(bad_negated == 0);
  std::size_t nan_not_highest = 0, nan_lost = 0;
  for (T const x : nans) {
    for (bool negated : {false, true}) {
      B const k = mpx::detail::nan_keeping_max_key(x, negated);
      if (!(k > inf_key)) ++nan_not_highest;
      T const back = mpx::detail::from_nan_keeping_max_key<T>(k, negated);
      if (!mpx::is_nan(back) || (mpx::bits(back) & B(~mpx::dtype_traits<T>::sign_mask)) !=
                                     (mpx::bits(x) & B(~mpx::dtype_traits<T>::sign_mask)))
        ++nan_lost;  // the payload survives
    }
  }
  CHECK(nan_not_highest == 0);
  CHECK(nan_lost == 0);
}

template <class T>
T max_through_keys(T a, T b) {
  auto const k = std::max(mpx::detail::nan_keeping_max_key(a), mpx::detail::nan_keeping_max_key(b));
  return mpx::detail::from_nan_keeping_max_key<T>(k);
}
template <class T>
T min_through_keys(T a, T b) {
  auto const k = std::max(mpx::detail::nan_keeping_max_key(a, true), mpx::detail::nan_keeping_max_key(b, true));
  return mpx::detail::from_nan_keeping_max_key<T>(k, true);
}

}  // namespace nan_keys

// NCCL's float max keeps the non-NaN operand: nccl_communicator reduces these keys as
// integers instead. Exhaustive for the 16-bit formats; edge cases for float and double.
TEST_CASE("nan_keeping_max_key: integer order is value order, every NaN on top", "[dist][nccl_keys]") {
  nan_keys::check_every_16_bit_value<mpx::half>();
  nan_keys::check_every_16_bit_value<mpx::bfloat16>();

  auto check_wide = [](auto t) {
    using T = decltype(t);
    using B = mpx::detail::bits_t<T>;
    using lim = std::numeric_limits<T>;
    INFO((sizeof(T) == 4 ? "float" : "double"));
    B const sign = B(B(1) << (8 * sizeof(T) - 1));
    T const nan_payload = mpx::detail::bit_cast<T>(B(mpx::detail::bit_cast<B>(lim::quiet_NaN()) | B(5)));
    T const negative_nan = mpx::detail::bit_cast<T>(B(mpx::detail::bit_cast<B>(lim::quiet_NaN()) | sign));
    T const signalling_nan = mpx::detail::bit_cast<T>(B(mpx::detail::bit_cast<B>(lim::infinity()) | B(1)));
    // In order of value.
    std::vector<T> const ordered = {-lim::infinity(), -lim::max(), T(-1e10), T(-1), -lim::min(),
                                    -lim::denorm_min() * 3, -lim::denorm_min(), T(-0.0), T(0.0), lim::denorm_min(),
                                    lim::denorm_min() * 3, lim::min(), T(0.5), T(1), T(3), lim::max(), lim::infinity()};
    for (std::size_t i = 0; i < ordered.size(); ++i) {
      INFO("value " << static_cast<double>(ordered[i]) << (std::signbit(ordered[i]) ? " (sign set)" : ""));
      B const k = mpx::detail::nan_keeping_max_key(ordered[i]);
      if (i) CHECK(mpx::detail::nan_keeping_max_key(ordered[i - 1]) < k);
      if (i) CHECK(mpx::detail::nan_keeping_max_key(ordered[i - 1], true) > mpx::detail::nan_keeping_max_key(ordered[i], true));
      CHECK(mpx::detail::bit_cast<B>(mpx::detail::from_nan_keeping_max_key<T>(k)) == mpx::detail::bit_cast<B>(ordered[i]));
      for (T const n : {lim::quiet_NaN(), nan_payload, negative_nan, signalling_nan}) {
        CHECK(mpx::detail::nan_keeping_max_key(n) > k);
        CHECK(mpx::detail::nan_keeping_max_key(n, true) > mpx::detail::nan_keeping_max_key(ordered[i], true));
        CHECK(std::isnan(nan_keys::max_through_keys(ordered[i], n)));
        CHECK(std::isnan(nan_keys::max_through_keys(n, ordered[i])));
        CHECK(std::isnan(nan_keys::min_through_keys(ordered[i], n)));
        CHECK(std::isnan(nan_keys::min_through_keys(n, ordered[i])));
      }
      for (T const other : ordered) {
        double const want = nan_keys::expected_max(static_cast<double>(ordered[i]), static_cast<double>(other));
        T const got = nan_keys::max_through_keys(ordered[i], other);
        CHECK(static_cast<double>(got) == want);
        CHECK(std::signbit(got) == std::signbit(want));
        double const want_min = -nan_keys::expected_max(-static_cast<double>(ordered[i]), -static_cast<double>(other));
        T const got_min = nan_keys::min_through_keys(ordered[i], other);
        CHECK(static_cast<double>(got_min) == want_min);
        CHECK(std::signbit(got_min) == std::signbit(want_min));
      }
    }
    // A NaN's payload comes back (its sign cleared), so a max of NaNs is one of them.
    CHECK(mpx::detail::bit_cast<B>(nan_keys::max_through_keys(nan_payload, T(1))) == mpx::detail::bit_cast<B>(nan_payload));
    CHECK(mpx::detail::bit_cast<B>(nan_keys::max_through_keys(negative_nan, T(1))) ==
          B(mpx::detail::bit_cast<B>(negative_nan) & B(~sign)));
  };
  check_wide(float{});
  check_wide(double{});
}

TEST_CASE("broadcast, all_gather_values, all_reduce_values and barrier", "[dist]") {
  mpx::host_executor exec;
  int const root = comm().size() - 1;
  auto data = mpx_test::upload(exec, rank_values<mpx::bfloat16>(333, comm().rank()), {333});
  comm().broadcast(exec, data, root);
  CHECK(checksum(mpx_test::download(exec, data)) == checksum(rank_values<mpx::bfloat16>(333, root)));
  CHECK_THROWS_AS(comm().broadcast(exec, data, comm().size()), mpx::invalid_argument);

  double const mine[2] = {static_cast<double>(comm().rank()), -1.5 * comm().rank()};
  auto const all = comm().all_gather_values(mine);
  REQUIRE(all.size() == 2 * static_cast<std::size_t>(comm().size()));
  for (int r = 0; r < comm().size(); ++r) {
    CHECK(all[2 * static_cast<std::size_t>(r)] == r);
    CHECK(all[2 * static_cast<std::size_t>(r) + 1] == -1.5 * r);
  }
  double values[3] = {1.0, static_cast<double>(comm().rank()), comm().rank() == 0 ? std::nan("") : 0.0};
  comm().all_reduce_values(std::span<double>(values, 2), mpx::reduce_op::sum);
  CHECK(values[0] == comm().size());
  CHECK(values[1] == comm().size() * (comm().size() - 1) / 2);
  comm().all_reduce_values(std::span<double>(values + 2, 1), mpx::reduce_op::max);
  CHECK(std::isnan(values[2]));  // a NaN is never dropped by max
  comm().barrier();
}

TEST_CASE("sharded batch loaders deal every epoch's shuffle out without overlap", "[dist]") {
  mpx::host_executor exec;
  auto const data = quadrant_images(103, 5);
  for (std::size_t replicas : {std::size_t{2}, std::size_t{3}}) {
    INFO("replicas " << replicas);
    std::multiset<std::size_t> training, evaluation;
    std::size_t steps = 0;
    for (std::size_t r = 0; r < replicas; ++r) {
      mpx::batch_loader<mpx::host_executor> train(exec, data, {.batch_size = 8, .seed = 3, .replica = r, .replicas = replicas});
      mpx::batch_loader<mpx::host_executor> eval(
          exec, data, {.batch_size = 8, .shuffle = false, .replica = r, .replicas = replicas, .shard_by = mpx::sharding::whole_batches});
      if (r == 0) steps = train.batches_per_epoch();
      CHECK(train.batches_per_epoch() == steps);  // every replica takes the same steps
      train.start_epoch(2);
      while (auto b = train.next()) training.insert(b->samples.begin(), b->samples.end());
      eval.start_epoch(0);
      while (auto b = eval.next()) evaluation.insert(b->samples.begin(), b->samples.end());
    }
    CHECK(steps == 103 / (8 * replicas));
    // Training: the first steps × global batch samples of the one-process order.
    auto const order = mpx::shuffled_order(103, 3, 2);
    CHECK(training == std::multiset<std::size_t>(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(steps * 8 * replicas)));
    std::multiset<std::size_t> everything;
    for (std::size_t i = 0; i < 103; ++i) everything.insert(i);
    CHECK(evaluation == everything);
  }
  CHECK_THROWS_AS(mpx::batch_loader<mpx::host_executor>(exec, data, {.replica = 2, .replicas = 2}), mpx::invalid_argument);
}

// The proof the issue asks for: N data-parallel ranks with a local batch B take the steps
// one process takes with the global batch N×B, including a step where only the last
// rank's gradient holds a NaN: every rank skips it and halves its scale. Clipped to a
// global norm of 0.25 (below the gradients' norms): the norm of the averaged gradient,
// as one process measures it, not each rank's own.
TEST_CASE("data-parallel training equals one process with the global batch, skips included", "[dist]") {
  mpx::host_executor exec;
  int const ranks = comm().size();
  std::size_t const local_batch = 8, steps = 7, poisoned_step = 3;
  auto const data = quadrant_images(local_batch * static_cast<std::size_t>(ranks) * steps, 11);

  // The reference: one process, the global batch, the NaN in the same gradient element.
  auto reference = small_model<mpx::mixed_float16>();
  reference.build(exec, {2, 1, 1}, 1);
  float const clip = 0.25f;
  auto reference_opt = sgd_with_dynamic_scale(exec, reference, clip);
  mpx::batch_loader<mpx::host_executor, mpx::half> global(exec, data, {.batch_size = local_batch * ranks, .seed = 9});
  mpx::classifier_trainer one(exec, reference, reference_opt);
  std::size_t step = 0;
  auto poison = [&](auto& opt) {
    auto const& g = opt.optimizer().gradients()[1];  // the first dense layer's bias
    static_cast<mpx::half*>(g.data())[2] = mpx::cast<mpx::half>(std::numeric_limits<float>::quiet_NaN());
  };
  mpx::replica_hooks alone;  // one process; the hook only poisons
  alone.after_backward = [&](mpx::step_executor) {
    if (step == poisoned_step) poison(reference_opt);
  };
  one.run_as_replica(alone);
  global.start_epoch(0);
  for (; auto b = global.next(); ++step) one.step(exec, b->images, b->labels);
  auto const reference_records = one.history(exec);

  // The replicas: each built from another seed (rank 0's weights are broadcast).
  auto model = small_model<mpx::mixed_float16>();
  model.build(exec, {2, 1, 1}, 1 + 100 * static_cast<std::uint64_t>(comm().rank()));
  auto opt = sgd_with_dynamic_scale(exec, model, clip);
  mpx::data_parallel dp(exec, comm(), opt, {.check_replicas_agree = true});
  mpx::batch_loader<mpx::host_executor, mpx::half> shard(
      exec, data, {.batch_size = local_batch, .seed = 9, .replica = static_cast<std::size_t>(comm().rank()),
                   .replicas = static_cast<std::size_t>(ranks)});
  REQUIRE(shard.batches_per_epoch() == steps);
  mpx::classifier_trainer trainer(exec, model, opt);
  auto hooks = dp.hooks(exec);
  auto const average = hooks.after_backward;
  auto const reduce_final = hooks.gradients_final;
  std::size_t poisoned_at = steps;
  hooks.gradients_final = [&](mpx::step_executor at, std::size_t first) {
    // The poisoned gradient (index 1) is final once `first` reaches it: poison it before
    // its bucket's all-reduce starts, as an overflow in this rank's backward would.
    if (step == poisoned_step && comm().rank() == ranks - 1 && first <= 1 && poisoned_at != step) {
      poison(opt);
      poisoned_at = step;
    }
    reduce_final(at, first);
  };
  std::size_t started_early = 0;
  hooks.after_backward = [&](mpx::step_executor at) {
    started_early += dp.buckets_started();  // begun during the backward pass, layer by layer
    average(at);
  };
  trainer.run_as_replica(dp.hooks(exec));
  trainer.run_as_replica(hooks);  // a second call replaces the first's hooks on the model
  step = 0;
  shard.start_epoch(0);
  for (; auto b = shard.next(); ++step) trainer.step(exec, b->images, b->labels);
  auto const records = trainer.history(exec);

  CHECK(started_early == steps * dp.buckets());  // no bucket waited for the end of the backward pass
  REQUIRE(records.size() == reference_records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {
    INFO("step " << i);
    CHECK(records[i].skipped == reference_records[i].skipped);
    CHECK(records[i].skipped == (i == poisoned_step ? 1u : 0u));
    CHECK(records[i].loss_scale == reference_records[i].loss_scale);
    if (i != poisoned_step) {
      CHECK(reference_records[i].gradient_norm > clip);  // so clipping acted
      CHECK(std::abs(records[i].gradient_norm - reference_records[i].gradient_norm) <= 1e-3f * reference_records[i].gradient_norm);
    }
  }
  CHECK(opt.scaler().scale(exec) == 16384.0f);  // halved once, on every rank
  CHECK(reference_opt.scaler().scale(exec) == 16384.0f);
  // The same parameters up to the order of the sums: each rank's product sums its own
  // rows, the all-reduce adds the ranks. Within a few half ulps (2^-10 relative).
  auto const got = parameter_values(exec, model);
  auto const expected = parameter_values(exec, reference);
  REQUIRE(got.size() == expected.size());
  double worst = 0;
  for (std::size_t p = 0; p < got.size(); ++p)
    for (std::size_t i = 0; i < got[p].size(); ++i)
      worst = std::max(worst, std::abs(got[p][i] - expected[p][i]) / std::max(1.0, std::abs(expected[p][i])));
  CHECK(worst <= 4 * std::ldexp(1.0, -10));
  dp.check_parameters_agree(exec);
  dp.check_replicas_agree(exec);

  // Without the averaging the replicas would each step on their own shard's gradient:
  // the check above can fail.
  CHECK(same_on_every_rank(dp.parameter_checksum(exec)));
}

//! Every fp8 layer's three scale states (activation, weight, gradient), in layer order.
template <class Model>
std::vector<mpx::fp8_scale_values> fp8_scale_states(mpx::host_executor const& exec, Model& model) {
  std::vector<mpx::fp8_scale_values> out;
  model.for_each_layer([&](auto& layer) {
    if constexpr (requires { layer.products().template scale<mpx::operand_role::gradient>(exec); }) {
      auto const& p = layer.products();
      out.push_back(p.template scale<mpx::operand_role::activation>(exec).values(exec));
      out.push_back(p.template scale<mpx::operand_role::weight>(exec).values(exec));
      out.push_back(p.template scale<mpx::operand_role::gradient>(exec).values(exec));
    }
  });
  return out;
}

TEST_CASE("fp8 scales under data parallelism follow the global amax, the same on every rank", "[dist][fp8]") {
  mpx::host_executor exec;
  int const ranks = comm().size();
  std::size_t const local_batch = 16, steps = 4;
  auto const data = quadrant_images(local_batch * static_cast<std::size_t>(ranks) * steps, 21, 16);
  auto fp8_state = [&](auto& model) -> auto& {  // the first dense layer's input scale
    return model.template layer<1>().products().template scale<mpx::operand_role::activation>(exec);
  };

  // One process with the global batch: its first layer's input amax is the global one.
  auto reference = small_fp8_model();
  reference.build(exec, {16, 1, 1}, 1);
  auto reference_opt = sgd_with_dynamic_scale(exec, reference);
  mpx::batch_loader<mpx::host_executor, mpx::bfloat16> global(exec, data, {.batch_size = local_batch * ranks, .seed = 9});
  {
    mpx::classifier_trainer one(exec, reference, reference_opt);
    global.start_epoch(0);
    while (auto b = global.next()) one.step(exec, b->images, b->labels);
  }

  // One bucket (started at the end of the backward), and buckets of 64 bytes: the last
  // layers' all-reduces are on the wire while an earlier fp8 layer's step end reduces
  // its amaxes (a blocking all-reduce among started ones).
  for (std::size_t const bucket_bytes : {std::size_t{25} << 20, std::size_t{64}}) {
  INFO("buckets of " << bucket_bytes << " bytes");
  auto model = small_fp8_model();
  model.build(exec, {16, 1, 1}, 1);
  auto opt = sgd_with_dynamic_scale(exec, model);
  mpx::data_parallel dp(exec, comm(), opt, {.bucket_bytes = bucket_bytes});
  mpx::batch_loader<mpx::host_executor, mpx::bfloat16> shard(
      exec, data, {.batch_size = local_batch, .seed = 9, .replica = static_cast<std::size_t>(comm().rank()),
                   .replicas = static_cast<std::size_t>(ranks)});
  {
    mpx::classifier_trainer trainer(exec, model, opt);
    trainer.run_as_replica(dp.hooks(exec));
    shard.start_epoch(0);
    while (auto b = shard.next()) trainer.step(exec, b->images, b->labels);
  }
  auto const got = fp8_state(model).values(exec);
  auto const expected = fp8_state(reference).values(exec);
  CHECK(got.steps == steps);
  // The data are the same, so the input's amax history and scale are the global ones,
  // bit for bit (each rank alone would have seen only its shard's maximum).
  CHECK(got.scale == expected.scale);
  CHECK(std::memcmp(got.history, expected.history, sizeof got.history) == 0);
  // Every scale of every fp8 layer is the same on every rank.
  std::vector<float> scales;
  for (auto const& v : fp8_scale_states(exec, model)) {
    scales.push_back(v.scale);
    scales.push_back(v.last_amax);
  }
  REQUIRE(scales.size() == 12);  // two fp8 layers, three roles, scale and amax
  CHECK(same_on_every_rank(checksum(scales)));
  }
}

TEST_CASE("a probe on one rank between fp8 steps starts no amax reduction and moves no fp8 scale", "[dist][fp8]") {
  mpx::host_executor exec;
  int const ranks = comm().size();
  std::size_t const local_batch = 16, steps = 4;
  auto const data = quadrant_images(local_batch * static_cast<std::size_t>(ranks) * steps, 23, 16);
  auto const run = [&](bool probe) {
    auto model = small_fp8_model();
    model.build(exec, {16, 1, 1}, 1);
    auto opt = sgd_with_dynamic_scale(exec, model);
    mpx::data_parallel dp(exec, comm(), opt);
    mpx::batch_loader<mpx::host_executor, mpx::bfloat16> shard(
        exec, data, {.batch_size = local_batch, .seed = 5, .replica = static_cast<std::size_t>(comm().rank()),
                     .replicas = static_cast<std::size_t>(ranks)});
    mpx::classifier_trainer trainer(exec, model, opt);
    trainer.run_as_replica(dp.hooks(exec));
    shard.start_epoch(0);
    std::size_t step = 0;
    while (auto b = shard.next()) {
      // Rank 0 alone looks at the loss scales between steps: its delayed scales' amax
      // reduction, a collective, must not run (the others would never join it) and its
      // scales must stay as they were (else the ranks' fp8 casts would differ).
      if (probe && step == 2 && comm().rank() == 0)
        static_cast<void>(mpx::probe_loss_scales(exec, model, b->images, b->labels, {1.0f, 1e30f}));
      trainer.step(exec, b->images, b->labels);
      ++step;
    }
    std::vector<float> state;
    for (auto const& v : fp8_scale_states(exec, model)) {
      state.push_back(v.scale);
      state.push_back(v.last_amax);
      state.push_back(static_cast<float>(v.steps));
      state.insert(state.end(), std::begin(v.history), std::end(v.history));
    }
    REQUIRE(!state.empty());
    return std::pair{dp.parameter_checksum(exec), checksum(state)};
  };
  auto const without = run(false);
  auto const with = run(true);
  CHECK(with.first == without.first);
  CHECK(with.second == without.second);
  CHECK(same_on_every_rank(with.second));
}

TEST_CASE("block-scaled fp8 under data parallelism: every rank holds the same parameters, close to one process "
          "with the global batch",
          "[dist][fp8][fp8_block]") {
  mpx::host_executor exec;
  int const ranks = comm().size();
  std::size_t const local_batch = 16, steps = 4;
  auto const data = quadrant_images(local_batch * static_cast<std::size_t>(ranks) * steps, 23, 16);
  auto const run = [&](auto policy, double tolerance) {
    using P = typename decltype(policy)::type;
    INFO(P::name);
    auto reference = small_fp8_model<P>();
    reference.build(exec, {16, 1, 1}, 1);
    auto reference_opt = sgd_with_dynamic_scale(exec, reference);
    mpx::batch_loader<mpx::host_executor, mpx::bfloat16> global(exec, data,
                                                                {.batch_size = local_batch * ranks, .seed = 9});
    {
      mpx::classifier_trainer one(exec, reference, reference_opt);
      global.start_epoch(0);
      while (auto b = global.next()) one.step(exec, b->images, b->labels);
    }
    auto model = small_fp8_model<P>();
    model.build(exec, {16, 1, 1}, 1 + 100 * static_cast<std::uint64_t>(comm().rank()));
    auto opt = sgd_with_dynamic_scale(exec, model);
    mpx::data_parallel dp(exec, comm(), opt);
    mpx::batch_loader<mpx::host_executor, mpx::bfloat16> shard(
        exec, data, {.batch_size = local_batch, .seed = 9, .replica = static_cast<std::size_t>(comm().rank()),
                     .replicas = static_cast<std::size_t>(ranks)});
    {
      mpx::classifier_trainer trainer(exec, model, opt);
      trainer.run_as_replica(dp.hooks(exec));
      shard.start_epoch(0);
      while (auto b = shard.next()) trainer.step(exec, b->images, b->labels);
    }
    // Block scales come from the blocks, so nothing is all-reduced but the gradients:
    // the replicas agree bit for bit.
    dp.check_parameters_agree(exec);
    CHECK(same_on_every_rank(dp.parameter_checksum(exec)));
    // Against one process with the global batch: the forward products and the input
    // gradients quantize each sample's row alone, the same blocks either way; the weight
    // gradient's K is the batch, so its blocks (and their scales) span a rank's rows
    // here and the global batch there. The parameters then differ by about an e4m3
    // rounding of the weight updates (2^-4 relative; 2^-2 for NVFP4's e2m1, whose
    // stochastic rounding also draws differently) times the learning rate.
    auto const got = parameter_values(exec, model);
    auto const expected = parameter_values(exec, reference);
    REQUIRE(got.size() == expected.size());
    double worst = 0;
    for (std::size_t p = 0; p < got.size(); ++p)
      for (std::size_t i = 0; i < got[p].size(); ++i) {
        REQUIRE(std::isfinite(got[p][i]));
        worst = std::max(worst, std::abs(got[p][i] - expected[p][i]) / std::max(1.0, std::abs(expected[p][i])));
      }
    CAPTURE(worst);
    CHECK(worst <= tolerance);
  };
  run(boost::hana::type_c<mpx::mixed_fp8_current>, 0.02);
  run(boost::hana::type_c<mpx::mixed_fp8_block>, 0.02);
  run(boost::hana::type_c<mpx::mixed_fp8_rowwise>, 0.02);
  run(boost::hana::type_c<mpx::mixed_mxfp8>, 0.02);
  run(boost::hana::type_c<mpx::mixed_nvfp4>, 0.08);
}

TEST_CASE("half gradients all-reduced in their own dtype match the float reduction closely", "[dist]") {
  mpx::host_executor exec;
  auto run = [&](bool in_float) {
    auto model = small_model<mpx::mixed_float16>(37);  // 37: buckets of several tensors
    model.build(exec, {2, 1, 1}, 5);
    auto opt = sgd_with_dynamic_scale(exec, model);
    mpx::data_parallel dp(exec, comm(), opt, {.bucket_bytes = 256, .reduce_in_float = in_float});
    CHECK(dp.buckets() > 1);
    fit_one_epoch(exec, dp, model, opt, 4 * 16, 16, 17);
    dp.check_parameters_agree(exec);
    return parameter_values(exec, model);
  };
  auto const wide = run(true), narrow = run(false);
  double worst = 0;
  for (std::size_t p = 0; p < wide.size(); ++p)
    for (std::size_t i = 0; i < wide[p].size(); ++i) worst = std::max(worst, std::abs(wide[p][i] - narrow[p][i]));
  CHECK(worst < 1e-2);
}

TEST_CASE("a shadowed data-parallel run trains bit for bit as one that is not", "[dist][shadow]") {
  mpx::host_executor exec;
  auto run = [&](std::size_t shadow_every) {
    auto model = small_model<mpx::mixed_float16>();
    model.build(exec, {2, 1, 1}, 1);
    auto opt = sgd_with_dynamic_scale(exec, model);
    mpx::data_parallel dp(exec, comm(), opt);
    auto const data = quadrant_images(8 * static_cast<std::size_t>(comm().size()) * 5, 23);
    mpx::batch_loader<mpx::host_executor, mpx::half> shard(
        exec, data, {.batch_size = 8, .replica = static_cast<std::size_t>(comm().rank()),
                     .replicas = static_cast<std::size_t>(comm().size())});
    mpx::fit_options options;
    options.quiet = true;
    options.replicas = dp.hooks(exec);
    options.shadow_every = shadow_every;
    auto history = mpx::fit(exec, model, opt, shard, options);
    return std::make_pair(std::move(history), parameter_values(exec, model));
  };
  auto const [plain, plain_values] = run(0);
  auto const [shadowed, shadowed_values] = run(2);
  CHECK(shadowed_values == plain_values);  // every parameter, exactly
  CHECK(shadowed[0].loss == plain[0].loss);
  REQUIRE(shadowed[0].shadow.size() == 2);  // steps 2 and 4 of 5
  auto const& layers = shadowed[0].shadow[0].layers;
  REQUIRE(layers.size() == 4);
  // Each replica's own dense layers cost something in float16; their weight gradients were
  // averaged over the replicas during the backward pass: not this replica's, not measured.
  for (std::size_t i : {1, 2}) {
    INFO(layers[i].layer);
    REQUIRE(layers[i].output.has_value());
    CHECK(*layers[i].output > 0.0);
    CHECK(*layers[i].output < 1e-2);
    CHECK_FALSE(layers[i].weight_gradient.has_value());
  }
}

TEST_CASE("the guard's evidence is combined over the replicas: every rank moves the same layer at the same step",
          "[dist][guard]") {
  mpx::host_executor exec;
  constexpr std::int64_t vocab = 24, tokens = 6, width = 16, batch = 4;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::embedding<>(vocab, width, tokens),
      mpx::residual(mpx::layer_norm<>(),
                    mpx::tiered<mpx::causal_self_attention, mpx::model_policy, mpx::mixed_bfloat16>(2, false)),
      mpx::dense<>(vocab));
  model.build(exec, {tokens}, 5);
  auto opt = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                       mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::data_parallel dp(exec, comm(), opt);
  mpx::classifier_trainer trainer(exec, model, opt);
  trainer.run_as_replica(dp.hooks(exec));
  trainer.guard({.forward_overflows = 3, .window = 50, .review_every = 5});
  auto& attention = model.template layer<1>().branch().template layer<1>();
  // Only rank 0's attention overflows (its weights grew after the start): only rank 0 sees
  // the forward overflows, every rank skips the steps (their averaged gradients are not finite).
  if (comm().rank() == 0)
    mpx::scale(exec, attention.template tier<0>().query_key_value().template kernel<mpx::host_space>(), 512.0f);
  std::vector<std::int32_t> x(batch * tokens), y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<std::int32_t>((i * 5 + 3 * static_cast<std::size_t>(comm().rank())) % vocab);
    y[i] = (x[i] + 1) % static_cast<std::int32_t>(vocab);
  }
  mpx::tensor_view<std::int32_t const, mpx::host_space> const xv(x.data(), mpx::shape{batch, tokens});
  mpx::tensor_view<std::int32_t const, mpx::host_space> const yv(y.data(), mpx::shape{batch, tokens});
  for (int s = 0; s < 7; ++s) trainer.step(exec, xv, yv);
  auto const records = trainer.history(exec);
  for (std::size_t i = 0; i < 5; ++i) CHECK(records[i].skipped == 1);
  auto const& moves = trainer.guard()->moves();
  REQUIRE(moves.size() == 1);
  CHECK(moves[0].step == 5);
  CHECK(moves[0].layer == "residual/multi_head_attention");
  CHECK_THAT(moves[0].evidence, Catch::Contains("5 of its forward passes"));  // rank 0's five steps
  double const tier[1] = {static_cast<double>(attention.active_tier())};
  for (double t : comm().all_gather_values(tier)) CHECK(t == 1.0);
}

TEST_CASE("an fp8 layer's saturations are the same on every rank, and every rank moves it at the same step",
          "[dist][guard]") {
  mpx::host_executor exec;
  constexpr std::int64_t batch = 16, features = 32;
  auto model = mpx::sequential<mpx::mixed_fp8>(
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(16, mpx::activation::relu), mpx::dense<>(16));
  model.build(exec, {features}, 3);
  auto opt = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                       mpx::static_loss_scaler(exec, 1.0f));
  mpx::data_parallel dp(exec, comm(), opt);
  mpx::classifier_trainer trainer(exec, model, opt);
  trainer.run_as_replica(dp.hooks(exec));
  trainer.guard({.fp8_saturations = 3, .window = 50, .review_every = 4});
  auto x = mpx_test::random_values<float>(batch * features, -2.0, 2.0, 8 + static_cast<std::uint64_t>(comm().rank()));
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % 16);
  mpx::tensor_view<std::int32_t const, mpx::host_space> const yv(y.data(), mpx::shape{batch});
  for (int s = 0; s < 12; ++s) {
    // Only rank 0's batches carry the outlier; the amax each scale updates from is the
    // maximum over the ranks, so every rank's scales saturate alike.
    auto xs = x;
    if (s >= 8 && comm().rank() == 0) xs[5] = 1000.0f * std::pow(8.0f, static_cast<float>(s - 8));
    trainer.step(exec, mpx::tensor_view<float const, mpx::host_space>(xs.data(), mpx::shape{batch, features}), yv);
  }
  auto const& moves = trainer.guard()->moves();
  REQUIRE(moves.size() == 1);
  CHECK(moves[0].step == 12);
  CHECK_THAT(moves[0].evidence, Catch::Contains("fp8 casts saturated") && Catch::Contains("in 4 steps"));
  double const tier[1] = {static_cast<double>(model.template layer<0>().active_tier())};
  for (double t : comm().all_gather_values(tier)) CHECK(t == 1.0);
  dp.check_parameters_agree(exec);
}

//! 4x4 inputs, a hidden layer, and a last layer that can move from mixed_float16 to
//! mixed_bfloat16.
auto last_layer_tiered(mpx::host_executor const& exec) {
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::flatten<>(), mpx::dense<>(8, mpx::activation::relu),
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(3));
  model.build(exec, {4, 4}, 3);
  return model;
}

TEST_CASE("a scale stuck at its floor on one rank moves the layer whose own gradients overflowed there",
          "[dist][guard]") {
  mpx::host_executor exec;
  auto model = last_layer_tiered(exec);
  // Rank 0's pixels are large: its last layer's weight gradient (pixels times a float16
  // logit gradient at the scale's floor) overflows, while its input gradient does not.
  // The other ranks' batches are tame. The average is not finite on any rank, so every
  // rank skips, and every rank moves the layer rank 0 named (each count is the maximum
  // over the ranks).
  float const base = comm().rank() == 0 ? 8.0f : 0.01f;
  std::vector<float> pixels(16 * 16);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = base + base * static_cast<float>(i % 5) / 8.0f;
  std::vector<std::int32_t> labels(16);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = rule.min_scale = 0x1p16f;  // at the floor from the start
  mpx::dynamic_loss_scaler scaler(exec, rule);
  scaler.on_stuck([](mpx::loss_scale_report const&) {});
  auto opt = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), std::move(scaler));
  mpx::data_parallel dp(exec, comm(), opt, {.bucket_bytes = 64});  // several buckets, reduced during the backward
  CHECK(dp.buckets() > 1);
  mpx::classifier_trainer trainer(exec, model, opt);
  trainer.run_as_replica(dp.hooks(exec));
  trainer.guard({.stuck_overflows = 3, .window = 50, .review_every = 4});
  mpx::tensor_view<float const, mpx::host_space> const xv(pixels.data(), mpx::shape{16, 4, 4});
  mpx::tensor_view<std::int32_t const, mpx::host_space> const yv(labels.data(), mpx::shape{16});
  for (int s = 0; s < 4; ++s) trainer.step(exec, xv, yv);
  for (auto const& r : trainer.history(exec)) CHECK(r.skipped == 1);
  auto const& moves = trainer.guard()->moves();
  REQUIRE(moves.size() == 1);
  CHECK(moves[0].step == 4);
  CHECK(moves[0].layer == "dense_1");
  CHECK_THAT(moves[0].evidence, Catch::Contains("gradients were the first NaN or inf of 4 steps with the loss scale "
                                                "at its floor (65536)"));
  double const tier[1] = {static_cast<double>(model.template layer<2>().active_tier())};
  for (double t : comm().all_gather_values(tier)) CHECK(t == 1.0);
  dp.check_parameters_agree(exec);
}

TEST_CASE("gradients finite on every rank whose sum overflows in float16 on the wire blame no layer",
          "[dist][guard]") {
  mpx::host_executor exec;
  auto model = last_layer_tiered(exec);
  // The same batch on every rank.
  std::vector<float> pixels(16 * 16);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = 0.5f + static_cast<float>(i % 7) / 8.0f;
  std::vector<std::int32_t> labels(16);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
  mpx::tensor_view<float const, mpx::host_space> const xv(pixels.data(), mpx::shape{16, 4, 4});
  mpx::tensor_view<std::int32_t const, mpx::host_space> const yv(labels.data(), mpx::shape{16});
  // A loss scale at which this rank's largest float16 gradient is about 40000: finite on
  // each rank, while the sum of two or more (rounded to float16 after each addition)
  // passes 65504.
  static_cast<void>(mpx::probe_loss_scales(exec, model, xv, yv, {1.0f}));
  float largest = 0;
  for (auto const& p : model.parameters(exec)) largest = std::max(largest, mpx::detail::stats_of(exec, p.gradient).absmax);
  REQUIRE(largest > 0);
  float const scale = 40000.0f / largest;
  auto const probe = mpx::probe_loss_scales(exec, model, xv, yv, {scale});
  for (auto const& row : probe.rows) REQUIRE(row.nonfinite[0] == 0);  // every rank's own gradients are finite

  mpx::dynamic_scale_rule rule;
  rule.initial_scale = rule.min_scale = scale;  // at the floor from the start
  mpx::dynamic_loss_scaler scaler(exec, rule);
  scaler.on_stuck([](mpx::loss_scale_report const&) {});
  auto opt = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), std::move(scaler));
  mpx::data_parallel dp(exec, comm(), opt, {.bucket_bytes = 64, .reduce_in_float = false});
  mpx::classifier_trainer trainer(exec, model, opt);
  trainer.run_as_replica(dp.hooks(exec));
  trainer.guard({.stuck_overflows = 1, .window = 50, .review_every = 4});
  trainer.step(exec, xv, yv);
  // A backward pass outside a step, whose gradients overflow on every rank: it is
  // neither averaged nor counted as the next step's evidence.
  static_cast<void>(mpx::probe_loss_scales(exec, model, xv, yv, {1e30f}));
  CHECK(dp.buckets_started() == 0);
  for (int s = 0; s < 7; ++s) trainer.step(exec, xv, yv);
  // The sum on the wire overflowed, so every step is skipped at the floor; but no
  // layer's own arithmetic did, on any rank, so no layer is moved (wider tiers would not
  // help: reduce_in_float does).
  for (auto const& r : trainer.history(exec)) CHECK(r.skipped == 1);
  CHECK(trainer.guard()->moves().empty());
  CHECK(model.template layer<2>().active_tier() == 0);
  dp.check_parameters_agree(exec);
}

TEST_CASE("a backward pass outside a step, on one rank only, starts no all-reduce and changes no step",
          "[dist][guard]") {
  mpx::host_executor exec;
  std::vector<float> pixels(16 * 16);
  for (std::size_t i = 0; i < pixels.size(); ++i)
    pixels[i] = 0.1f * static_cast<float>(comm().rank() + 1) + static_cast<float>(i % 5) / 16.0f;
  std::vector<std::int32_t> labels(16);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>((i + 1) % 3);
  mpx::tensor_view<float const, mpx::host_space> const xv(pixels.data(), mpx::shape{16, 4, 4});
  mpx::tensor_view<std::int32_t const, mpx::host_space> const yv(labels.data(), mpx::shape{16});
  auto const run = [&](bool probe) {
    auto model = last_layer_tiered(exec);
    auto opt = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f), mpx::dynamic_loss_scaler(exec));
    mpx::data_parallel dp(exec, comm(), opt, {.bucket_bytes = 64});
    mpx::classifier_trainer trainer(exec, model, opt);
    trainer.run_as_replica(dp.hooks(exec));
    trainer.guard({});
    for (int s = 0; s < 4; ++s) {
      if (probe && s == 2 && comm().rank() == 0) {  // a user's look at the loss scales, between steps
        static_cast<void>(mpx::probe_loss_scales(exec, model, xv, yv, {1.0f, 1e30f}));
        CHECK(dp.buckets_started() == 0);
      }
      trainer.step(exec, xv, yv);
    }
    for (auto const& r : trainer.history(exec)) CHECK(r.skipped == 0);
    CHECK(trainer.guard()->moves().empty());
    return dp.parameter_checksum(exec);
  };
  auto const without = run(false);
  CHECK(run(true) == without);
}

TEST_CASE("replicas that built different models are refused at the start, on every rank", "[dist]") {
  mpx::host_executor exec;
  auto model = small_model<mpx::mixed_float16>(comm().rank() == 0 ? 16 : 17);
  model.build(exec, {2, 1, 1}, 1);
  auto opt = sgd_with_dynamic_scale(exec, model);
  std::string const others = comm().size() == 2 ? "rank 1" : "ranks 1 and 2";
  CHECK_THROWS_TYPE_WITH(mpx::data_parallel(exec, comm(), opt), mpx::shape_error,
                         Catch::Contains("models differ from rank 0's at " + others) && Catch::Contains("dense_1/kernel"));
}

TEST_CASE("rank 0 saves the training state, every rank resumes from it", "[dist]") {
  mpx::host_executor exec;
  auto model = small_model<mpx::mixed_float16>();
  model.build(exec, {2, 1, 1}, 1);
  auto opt = sgd_with_dynamic_scale(exec, model);
  mpx::data_parallel dp(exec, comm(), opt);
  double const pid[1] = {static_cast<double>(::getpid())};
  fs::path const dir = fs::temp_directory_path() /
                       ("mpx-dist-" + std::to_string(static_cast<long long>(comm().all_gather_values(pid)[0])));
  fit_one_epoch(exec, dp, model, opt, 6 * 8, 8, 23);
  dp.on_rank_zero([&] { mpx::save_training_state(exec, model, opt, dir, {.epoch = 1, .batch = 0, .steps = 6}); });
  auto const saved = dp.parameter_checksum(exec);

  auto other = small_model<mpx::mixed_float16>();
  other.build(exec, {2, 1, 1}, 7 + static_cast<std::uint64_t>(comm().rank()));
  auto other_opt = sgd_with_dynamic_scale(exec, other);
  mpx::data_parallel resumed(exec, comm(), other_opt);
  auto const position = mpx::load_training_state(exec, other, other_opt, dir);
  CHECK(position.steps == 6);
  CHECK(resumed.parameter_checksum(exec) == saved);
  resumed.check_parameters_agree(exec);
  CHECK(other_opt.scaler().scale(exec) == opt.scaler().scale(exec));

  // A failure on rank 0 reaches every rank, which then does not wait forever.
  CHECK_THROWS_TYPE_WITH(dp.on_rank_zero([] { throw mpx::invalid_argument("the disk is full"); }), mpx::error,
                         Catch::Contains("failed on rank 0"));
  comm().barrier();
  if (comm().rank() == 0) fs::remove_all(dir);
}

TEST_CASE("a step that throws after its all-reduces started leaves none started: the next step averages its own gradients",
          "[dist]") {
  mpx::host_executor exec;
  auto batch = [&](float shift) {
    std::vector<float> pixels(16 * 4);
    for (std::size_t i = 0; i < pixels.size(); ++i)
      pixels[i] = shift + 0.1f * static_cast<float>(comm().rank() + 1) + static_cast<float>(i % 5) / 8.0f;
    return pixels;
  };
  auto const first = batch(0.0f), other = batch(3.0f);
  std::vector<std::int32_t> labels(16);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 4);
  mpx::tensor_view<std::int32_t const, mpx::host_space> const yv(labels.data(), mpx::shape{16});
  auto view = [](std::vector<float> const& p) { return mpx::tensor_view<float const, mpx::host_space>(p.data(), mpx::shape{16, 2, 2}); };
  struct thrown_by_test {};
  auto const run = [&](bool abandon_one) {
    auto model = small_model<mpx::mixed_float16>();
    model.build(exec, {2, 2}, 1);
    auto opt = sgd_with_dynamic_scale(exec, model);
    mpx::data_parallel dp(exec, comm(), opt, {.bucket_bytes = 64});  // several buckets: some start in the backward
    mpx::classifier_trainer trainer(exec, model, opt);
    auto hooks = dp.hooks(exec);
    if (abandon_one) {  // the first step, on another batch, throws on every rank once a bucket started
      auto const reduce_final = hooks.gradients_final;
      auto thrown = std::make_shared<bool>(false);
      hooks.gradients_final = [reduce_final, thrown, &dp](mpx::step_executor at, std::size_t from) {
        reduce_final(at, from);
        if (!*thrown && dp.buckets_started() > 0) {
          *thrown = true;
          throw thrown_by_test{};
        }
      };
      trainer.run_as_replica(hooks);
      CHECK_THROWS_AS(trainer.step(exec, view(other), yv), thrown_by_test);
      CHECK(dp.buckets_started() == 0);  // forgotten: the next step starts every bucket anew
    } else {
      trainer.run_as_replica(hooks);
    }
    trainer.step(exec, view(first), yv);
    return dp.parameter_checksum(exec);
  };
  auto const clean = run(false);
  CHECK(run(true) == clean);
}

int main(int argc, char** argv) {
  mpx::mpi_environment mpi(argc, argv);
  int failed = 0;
  {
    // A case that fails on one rank only could leave the others in a collective:
    // the timeout turns that into an error instead of a hang.
    mpx::mpi_communicator communicator(MPI_COMM_WORLD, {std::chrono::seconds(60)});
    world = &communicator;
    Catch::Session session;
    failed = session.run(argc, argv);
    double any[1] = {static_cast<double>(failed)};
    communicator.all_reduce_values(any, mpx::reduce_op::max);
    failed = static_cast<int>(any[0]);
    world = nullptr;
  }
  return failed ? 1 : 0;
}
