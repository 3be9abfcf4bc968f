// docs/policies.md: the presets, a policy of your own, an operation that requires float
// sums, lookup by a compile-time name, and a --policy flag dispatched at run time.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

using mpx::bfloat16;
using mpx::half;

// The presets and their four dtypes.
static_assert(std::is_same_v<mpx::mixed_float16, mpx::policy<half, half, float, float>>);
static_assert(std::is_same_v<mpx::mixed_bfloat16, mpx::policy<bfloat16>>);  // the defaults fill in float
static_assert(std::is_same_v<mpx::float32, mpx::policy<float>>);
static_assert(mpx::mixed_float16::name == "mixed_float16");
static_assert(std::is_same_v<mpx::pure_bfloat16, mpx::policy<bfloat16, bfloat16, float, bfloat16>>);
static_assert(mpx::pure_bfloat16::name == "bfloat16");  // Keras's name: bfloat16 variables too
static_assert(std::is_same_v<mpx::mixed_fp8, mpx::policy<bfloat16, mpx::float8_e4m3>>);
static_assert(std::is_same_v<mpx::without_fp8<mpx::mixed_fp8>, mpx::mixed_bfloat16>);

// Any other combination is a policy too, named by its dtypes.
using half_compute_in_float = mpx::policy<half, float>;
static_assert(half_compute_in_float::name ==
              "policy<storage=float16, compute=float32, accumulate=float32, param=float32>");

// A struct of your own satisfies the concept when it has the four types and a name.
struct bf16_storage_float_compute {
  using storage_type = bfloat16;
  using compute_type = float;
  using accumulate_type = float;
  using param_type = float;
  static constexpr std::string_view name = "bf16_storage_float_compute";
};
static_assert(mpx::policy_type<bf16_storage_float_compute>);
static_assert(mpx::float_accumulating_policy<bf16_storage_float_compute>);
static_assert(!mpx::float_accumulating_policy<mpx::policy<half, half, half>>);

// An operation that needs float sums states it once, at the top.
template <mpx::policy_type P>
float mean_square(mpx::tensor<typename P::storage_type> const& x) {
  mpx::require_float_accumulation<P>();  // policy<half, half, half> stops compilation here
  return mpx::sum_of_squares<P>(mpx::host_executor{}, x) / static_cast<float>(x.size());
}

// A preset by compile-time name (a typo is a compile error).
constexpr auto bf16_name = BOOST_HANA_STRING("mixed_bfloat16");
using by_name = mpx::policy_named<std::remove_const_t<decltype(bf16_name)>>;
static_assert(std::is_same_v<by_name, mpx::mixed_bfloat16>);
constexpr auto f16_type = mpx::policy_by_name(BOOST_HANA_STRING("mixed_float16"));
static_assert(std::is_same_v<decltype(f16_type)::type, mpx::mixed_float16>);

// One step of a program, written once for every policy.
template <class P>
float run(std::size_t n) {
  mpx::host_executor exec;
  auto x = mpx::make_tensor<typename P::storage_type>(exec, {static_cast<std::int64_t>(n)});
  mpx::fill(exec, x, mpx::cast<typename P::storage_type>(0.5f));
  return mean_square<P>(x);
}

int main(int argc, char** argv) {
  // train --policy mixed_bfloat16
  std::string name = "mixed_float16";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string_view(argv[i]) == "--policy") name = argv[i + 1];

  float result = 0;
  try {
    result = mpx::with_policy(name, [](auto p) {
      using P = typename decltype(p)::type;  // one of the ten presets
      std::printf("running under %s: storage %s, params %s\n", std::string(P::name).c_str(),
                  std::string(mpx::dtype_name<typename P::storage_type>).c_str(),
                  std::string(mpx::dtype_name<typename P::param_type>).c_str());
      return run<P>(1000);
    });
  } catch (mpx::invalid_argument const& e) {  // --policy mixed_float8
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }

  bool unknown_refused = false;
  try {
    mpx::with_policy("mixed_float8", [](auto) { return 0; });
  } catch (mpx::invalid_argument const& e) {
    unknown_refused = std::string_view(e.what()).find("unknown policy \"mixed_float8\"") != std::string_view::npos;
  }
  return result == 0.25f && unknown_refused ? 0 : 1;
}
