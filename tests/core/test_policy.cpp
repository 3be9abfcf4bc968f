// Policies: member types, names, the concept, lookup by name at compile time and at
// run time. The compile-time refusals are in tests/compile_fail.
#include "../support/testing.hpp"

#include <algorithm>

using mpx::bfloat16;
using mpx::half;

static_assert(std::is_same_v<mpx::mixed_float16::storage_type, half>);
static_assert(std::is_same_v<mpx::mixed_float16::compute_type, half>);
static_assert(std::is_same_v<mpx::mixed_float16::accumulate_type, float>);
static_assert(std::is_same_v<mpx::mixed_float16::param_type, float>);
static_assert(std::is_same_v<mpx::mixed_bfloat16::storage_type, bfloat16>);
static_assert(std::is_same_v<mpx::float32::storage_type, float>);
static_assert(mpx::policy_type<mpx::mixed_float16> && mpx::policy_type<mpx::float32>);
static_assert(!mpx::policy_type<float> && !mpx::policy_type<int>);
static_assert(mpx::float_accumulating_policy<mpx::mixed_bfloat16>);
static_assert(!mpx::float_accumulating_policy<mpx::policy<half, half, half>>);

namespace {
// A user's own policy type, not built from mpx::policy, satisfies the concept too.
struct my_policy {
  using storage_type = bfloat16;
  using compute_type = float;
  using accumulate_type = float;
  using param_type = float;
  static constexpr std::string_view name = "my_policy";
};
static_assert(mpx::policy_type<my_policy>);

constexpr auto mixed16_name = BOOST_HANA_STRING("mixed_float16");
static_assert(std::is_same_v<mpx::policy_named<std::remove_const_t<decltype(mixed16_name)>>, mpx::mixed_float16>);
}  // namespace

TEST_CASE("policy names read like Keras's", "[policy]") {
  CHECK(mpx::float32::name == "float32");
  CHECK(mpx::mixed_float16::name == "mixed_float16");
  CHECK(mpx::mixed_bfloat16::name == "mixed_bfloat16");
  CHECK(mpx::policy<half, float>::name == "policy<storage=float16, compute=float32, accumulate=float32, param=float32>");
  CHECK(mpx::policy<half, half, half>::name == "policy<storage=float16, compute=float16, accumulate=float16, param=float32>");
  CHECK(mpx::pure_bfloat16::name == "bfloat16");
  CHECK(mpx::mixed_fp8::name == "mixed_fp8");
}

// mixed_fp8 is Transformer Engine's hybrid recipe over bfloat16 storage; without_fp8
// takes a layer out of fp8 and leaves every other policy as it is.
static_assert(std::is_same_v<mpx::mixed_fp8::storage_type, bfloat16> &&
              std::is_same_v<mpx::mixed_fp8::compute_type, mpx::float8_e4m3> &&
              std::is_same_v<mpx::mixed_fp8::param_type, float>);
static_assert(std::is_same_v<mpx::pure_bfloat16::param_type, bfloat16>);
static_assert(std::is_same_v<mpx::without_fp8<mpx::mixed_fp8>, mpx::mixed_bfloat16>);
static_assert(std::is_same_v<mpx::without_fp8<mpx::mixed_float16>, mpx::mixed_float16>);
static_assert(std::is_same_v<mpx::without_fp8<mpx::policy<float, bfloat16>>, mpx::policy<float, bfloat16>>);
static_assert(mpx::computes_in_fp8<mpx::mixed_fp8> && !mpx::computes_in_fp8<mpx::mixed_bfloat16>);

TEST_CASE("with_policy dispatches a runtime name to the preset type", "[policy]") {
  auto storage_bits = [](std::string_view name) {
    return mpx::with_policy(name, [](auto p) {
      using P = typename decltype(p)::type;
      return mpx::dtype_traits<typename P::storage_type>::bits * 100 + static_cast<int>(P::name.size());
    });
  };
  CHECK(storage_bits("float32") == 3207);
  CHECK(storage_bits("mixed_float16") == 1613);
  CHECK(storage_bits("mixed_bfloat16") == 1614);
  CHECK(storage_bits("bfloat16") == 1608);
  CHECK(storage_bits("mixed_fp8") == 1609);

  std::string seen;
  mpx::with_policy("mixed_bfloat16", [&](auto p) { seen = decltype(p)::type::name; });
  CHECK(seen == "mixed_bfloat16");
}

TEST_CASE("with_policy refuses an unknown name and lists the presets", "[policy]") {
  CHECK_THROWS_TYPE_WITH(mpx::with_policy("mixed_float8", [](auto) { return 0; }), mpx::invalid_argument,
                       Catch::Matchers::Contains("unknown policy \"mixed_float8\"") &&
                           Catch::Matchers::Contains("mixed_float16"));
  CHECK_THROWS_AS(mpx::with_policy("", [](auto) {}), mpx::error);
}

namespace {
// Every policy over mpx::dtype_list's dtypes (5^4 of them): its name.
template <class... Ts>
std::vector<std::string_view> every_policy_name(mpx::type_list<Ts...>) {
  std::vector<std::string_view> names;
  auto with_storage = [&]<class S>() {
    auto with_compute = [&]<class C>() {
      auto with_accumulate = [&]<class A>() {
        (names.push_back(mpx::policy<S, C, A, Ts>::name), ...);
      };
      (with_accumulate.template operator()<Ts>(), ...);
    };
    (with_compute.template operator()<Ts>(), ...);
  };
  (with_storage.template operator()<Ts>(), ...);
  return names;
}
}  // namespace

TEST_CASE("every policy over the dtype list has its own name", "[policy]") {
  auto names = every_policy_name(mpx::dtype_list{});
  REQUIRE(names.size() == mpx::dtype_count * mpx::dtype_count * mpx::dtype_count * mpx::dtype_count);
  CHECK(mpx::policy<mpx::float8_e4m3, mpx::float8_e4m3>::name == "mixed_float8_e4m3fn");
  CHECK(mpx::policy<mpx::float8_e5m2, mpx::float8_e5m2>::name == "mixed_float8_e5m2");
  CHECK(mpx::policy<mpx::bfloat16, mpx::float8_e4m3>::name == "mixed_fp8");
  CHECK(mpx::policy<half, mpx::float8_e4m3>::name ==
        "policy<storage=float16, compute=float8_e4m3fn, accumulate=float32, param=float32>");
  CHECK(mpx::policy<half, half, float, half>::name == "float16");
  std::sort(names.begin(), names.end());
  auto const repeated = std::adjacent_find(names.begin(), names.end());
  INFO("a name two policies share: " << (repeated == names.end() ? std::string_view("none") : *repeated));
  CHECK(repeated == names.end());
}
