// The README's "A taste", compiled and checked, so the README cannot drift from the API.
#include <mpx/mpx.hpp>

#include <cstdio>

int main() {
  mpx::host_executor exec;  // or mpx::cuda_executor{stream}, in a .cu file
  auto grads = mpx::make_tensor<float>(exec, {1024, 1024});
  mpx::fill(exec, grads, 1e-8f);  // gradients as small as a deep net makes them

  auto as_half = mpx::make_tensor<mpx::half>(exec, grads.shape());
  mpx::cast(exec, grads, as_half);  // round to nearest even; 1e-8 -> 0 in half
  mpx::numerics_stats s = mpx::stats(exec, grads);
  std::printf("%.0f%% of these gradients vanish in float16\n", 100 * s.underflow_in_half_share());

  mpx::scale(exec, grads, 32768.0f);  // a loss scale of 2^15, as Keras starts with
  mpx::cast(exec, grads, as_half);    // now every one survives
  bool ok = mpx::all_finite(exec, as_half);  // and none overflowed

  using P = mpx::mixed_float16;  // half storage/compute, float sums and master weights
  static_assert(std::is_same_v<P::accumulate_type, float>);
  float norm2 = mpx::sum_of_squares<P>(exec, grads);  // a policy that sums in half is refused at compile time
  std::string seen;
  mpx::with_policy("mixed_bfloat16", [&](auto p) { seen = decltype(p)::type::name; });

  // What the comments above claim, checked.
  bool const claims_hold = s.underflow_in_half == s.size && ok && mpx::stats(exec, as_half).zero == 0 &&
                           norm2 > 0 && seen == "mixed_bfloat16";
  return claims_hold ? 0 : 1;
}
