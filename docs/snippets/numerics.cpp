// docs/numerics.md: "why is my gradient zero?" answered with mpx::stats, finite checks,
// a gradient norm, a reduction of your own with mpx::transform_reduce, and the same
// checks as Thrust algorithms.
#include <mpx/mpx.hpp>
#include <mpx/numerics/thrust.hpp>  // not in mpx.hpp: it brings Thrust's headers

#include <cmath>
#include <cstdio>
#include <vector>

using mpx::half;

// For mpx::transform_reduce: map each element to an accumulator, combine two of them.
struct abs_of {
  template <class T>
  MPX_HD float operator()(T x) const noexcept {
    float const f = mpx::cast<float>(x);
    return f < 0 ? -f : f;
  }
};
struct max_of {
  MPX_HD float operator()(float a, float b) const noexcept { return a > b ? a : b; }
};

int main() {
  bool ok = true;
  mpx::host_executor exec;

  // Eight float32 gradients, as a backward pass in float would produce them.
  std::vector<float> const values = {1e-3f, -2e-5f, 3e-8f, 2.9e-8f, -1e-9f, 0.0f, 70000.0f, 1e-40f};
  auto grads = mpx::make_tensor<float>(exec, {8});
  mpx::copy(exec, mpx::tensor_view<float const>(values.data(), grads.shape()), grads);

  // Before storing them in half: which would vanish, which would overflow?
  mpx::numerics_stats const s = mpx::stats(exec, grads);
  std::printf("float32: %s\n", mpx::to_string(s).c_str());
  ok &= s.size == 8 && s.zero == 1 && s.subnormal == 1;  // 1e-40 is a float32 subnormal
  ok &= s.underflow_in_half == 3;                       // 2.9e-8, -1e-9, 1e-40 (|x| <= 2^-25)
  ok &= s.overflow_in_half == 1;                        // 70000 (|x| >= 65520)
  ok &= s.absmax == 70000.0f && s.min_abs_nonzero == 1e-40f;

  // After: the stored tensor has four zeros, one inf, and two subnormals (3e-8, 2e-5).
  auto stored = mpx::make_tensor<half>(exec, grads.shape());
  mpx::cast(exec, grads, stored);
  mpx::numerics_stats const h = mpx::stats(exec, stored);
  std::printf("float16: %s\n", mpx::to_string(h).c_str());
  ok &= h.zero == 4 && h.inf == 1 && h.subnormal == 2 && !h.all_finite();
  ok &= !mpx::all_finite(exec, stored) && mpx::count_nonfinite(exec, stored) == 1;

  // A loss scale of 2^10 lifts the small ones into half's range but pushes 70000 further out.
  mpx::scale(exec, grads, 1024.0f);
  mpx::numerics_stats const scaled = mpx::stats(exec, grads);
  ok &= scaled.underflow_in_half == 1 && scaled.overflow_in_half == 1;  // 1e-40 * 2^10 still vanishes

  // The squared norm for gradient clipping, summed in float (the policy's accumulate_type).
  mpx::scale(exec, grads, 1.0f / 1024.0f);
  float const norm2 = mpx::sum_of_squares<mpx::mixed_float16>(exec, grads);
  ok &= norm2 == 70000.0f * 70000.0f;  // the other squares are below its rounding step
  ok &= std::isinf(mpx::sum_of_squares<mpx::float32>(exec, stored));  // the inf is not hidden

  // The largest |x|, as a reduction of your own; the same call runs on a cuda_executor.
  float const largest = mpx::transform_reduce(exec, grads, 0.0f, abs_of{}, max_of{});
  ok &= largest == 70000.0f;

  // The exponents, binade by binade, and where float16 loses each.
  mpx::exponent_histogram const e = mpx::log2_histogram(exec, grads);
  std::printf("%s", e.to_string().c_str());
  ok &= e.count(-10) == 1 && e.count(-16) == 1 && e.count(16) == 1 && e.zero == 1;  // 1e-3, -2e-5, 70000, 0
  ok &= e.count(-25) == 1;  // 3e-8: above 2^-25, so half rounds it up to 2^-24
  ok &= e.count_between(mpx::exponent_histogram::min_exponent, -26) == 3;  // 2.9e-8, 1e-9, 1e-40: 0 in half

  // Data that lives in Thrust's containers (or behind its iterators), under any of its
  // execution policies: thrust::device or thrust::cuda::par_nosync.on(stream) on the GPU.
  std::vector<half> const from_a_thrust_program(stored.data(), stored.data() + stored.size());
  mpx::numerics_stats const t = mpx::stats(thrust::host, from_a_thrust_program.begin(), from_a_thrust_program.end());
  ok &= t == mpx::stats(exec, stored);  // the same counts and extremes as on an executor
  ok &= mpx::count_nonfinite(thrust::host, from_a_thrust_program.begin(), from_a_thrust_program.end()) == 1;
  return ok ? 0 : 1;
}
