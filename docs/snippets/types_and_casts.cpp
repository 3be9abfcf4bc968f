// docs/types_and_casts.md: the limits table, the rounding rules and the training
// thresholds, checked at compile time and at run time.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>

using mpx::bfloat16;
using mpx::half;
using f16 = mpx::dtype_traits<half>;
using bf16 = mpx::dtype_traits<bfloat16>;
using f32 = mpx::dtype_traits<float>;

// The limits table, exactly (widening to float is exact, so these compare values).
static_assert(f16::name == "float16" && bf16::name == "bfloat16" && f32::name == "float32");
static_assert(f16::bits == 16 && f16::exponent_bits == 5 && f16::mantissa_bits == 10 && f16::exponent_bias == 15);
static_assert(bf16::bits == 16 && bf16::exponent_bits == 8 && bf16::mantissa_bits == 7 && bf16::exponent_bias == 127);
static_assert(f32::bits == 32 && f32::exponent_bits == 8 && f32::mantissa_bits == 23 && f32::exponent_bias == 127);
static_assert(mpx::cast<float>(f16::max()) == 65504.0f && mpx::cast<float>(f16::lowest()) == -65504.0f);
static_assert(mpx::cast<float>(f16::min_normal()) == 0x1p-14f && mpx::cast<float>(f16::min_subnormal()) == 0x1p-24f);
static_assert(mpx::cast<float>(f16::epsilon()) == 0x1p-10f);
static_assert(mpx::cast<float>(bf16::max()) == 0x1.FEp127f && mpx::cast<float>(bf16::lowest()) == -0x1.FEp127f);
static_assert(mpx::cast<float>(bf16::min_normal()) == 0x1p-126f && mpx::cast<float>(bf16::min_subnormal()) == 0x1p-133f);
static_assert(mpx::cast<float>(bf16::epsilon()) == 0x1p-7f);
static_assert(f32::max() == 0x1.FFFFFEp127f && f32::lowest() == -0x1.FFFFFEp127f);
static_assert(f32::min_normal() == 0x1p-126f && f32::min_subnormal() == 0x1p-149f && f32::epsilon() == 0x1p-23f);
static_assert(mpx::bits(f16::max()) == 0x7BFF && mpx::bits(bf16::max()) == 0x7F7F);
static_assert(mpx::bits(f16::quiet_nan()) == 0x7FFF && mpx::bits(bf16::quiet_nan()) == 0x7FFF);

// Where float16 loses a value: overflow to inf, underflow to zero.
static_assert(mpx::bits(mpx::cast<half>(65519.0f)) == 0x7BFF);    // rounds down to 65504
static_assert(mpx::bits(mpx::cast<half>(65520.0f)) == 0x7C00);    // the tie goes to even: inf
static_assert(mpx::bits(mpx::cast<half>(0x1p-25f)) == 0x0000);    // the tie goes to even: 0
static_assert(mpx::bits(mpx::cast<half>(0x1.000002p-25f)) == 0x0001);  // just above: 2^-24
static_assert(mpx::bits(mpx::cast<half>(-1e-8f)) == 0x8000);      // -0 keeps its sign
// bfloat16 keeps float's range but not its precision.
static_assert(mpx::bits(mpx::cast<bfloat16>(1e38f)) != 0x7F80);     // finite
static_assert(mpx::bits(mpx::cast<bfloat16>(0x1.FFp127f)) == 0x7F80);  // max + ulp/2: inf
static_assert(mpx::bits(mpx::cast<bfloat16>(1.0f + 0x1p-8f)) == 0x3F80);  // tie: stays at 1

// NaN stays NaN, as the canonical 0x7FFF; saturate_cast clamps, NaN excepted.
static_assert(mpx::bits(mpx::cast<half>(-NAN)) == 0x7FFF);
static_assert(mpx::bits(mpx::saturate_cast<half>(1e6f)) == 0x7BFF);
static_assert(mpx::bits(mpx::saturate_cast<half>(-INFINITY)) == 0xFBFF);
static_assert(mpx::is_nan(mpx::saturate_cast<half>(NAN)));
static_assert(mpx::saturate_cast<float>(INFINITY) == f32::max());

// One rounding: 16-bit to 16-bit goes through float, which is exact.
static_assert(mpx::bits(mpx::cast<half>(mpx::cast<bfloat16>(3.0f))) == 0x4200);
static_assert(mpx::cast<float>(mpx::cast<half>(0.1f)) == 0.0999755859375f);

int main() {
  bool ok = true;

  // Classification reads the bits: the same answer under -ffast-math and on the GPU.
  half const tiny = mpx::cast<half>(1e-6f);  // below 2^-14: a subnormal
  half const big = mpx::cast<half>(1e5f);    // above 65504: inf
  ok &= mpx::is_subnormal(tiny) && mpx::is_finite(tiny) && !mpx::is_zero(tiny);
  ok &= mpx::is_inf(big) && !mpx::is_finite(big) && !mpx::is_nan(big);
  ok &= mpx::is_nan(mpx::cast<bfloat16>(std::nanf(""))) && mpx::is_zero(mpx::cast<half>(-0.0f));

  // A subnormal has fewer significant bits: 1e-6 is stored as 17 * 2^-24.
  ok &= mpx::cast<float>(tiny) == 17 * 0x1p-24f;

  std::printf("%-9s %12s %12s %12s %12s\n", "dtype", "max", "min_normal", "min_subnorm", "epsilon");
  auto row = [](auto tag) {
    using tr = mpx::dtype_traits<decltype(tag)>;
    std::printf("%-9s %12.5g %12.5g %12.5g %12.5g\n", tr::name.data(), double(mpx::cast<float>(tr::max())),
                double(mpx::cast<float>(tr::min_normal())), double(mpx::cast<float>(tr::min_subnormal())),
                double(mpx::cast<float>(tr::epsilon())));
  };
  row(half{});
  row(bfloat16{});
  row(float{});
  return ok ? 0 : 1;
}
