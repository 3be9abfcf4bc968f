// The preset policies by name: at compile time as a Boost.Hana map from a Hana string
// to the policy type (policy_by_name, policy_named), and at run time from a string such
// as a --policy flag (with_policy, which calls a generic function with the preset's type).
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>

#include <boost/hana/at.hpp>
#include <boost/hana/equal.hpp>
#include <boost/hana/find_if.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/optional.hpp>
#include <boost/hana/pair.hpp>
#include <boost/hana/string.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/type.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpx {

//! The presets, in the order they are listed to users.
inline constexpr auto preset_policies = boost::hana::make_tuple(
    boost::hana::make_pair(BOOST_HANA_STRING("float32"), boost::hana::type_c<float32>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_float16"), boost::hana::type_c<mixed_float16>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_bfloat16"), boost::hana::type_c<mixed_bfloat16>),
    boost::hana::make_pair(BOOST_HANA_STRING("bfloat16"), boost::hana::type_c<pure_bfloat16>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_fp8"), boost::hana::type_c<mixed_fp8>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_fp8_current"), boost::hana::type_c<mixed_fp8_current>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_fp8_block"), boost::hana::type_c<mixed_fp8_block>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_fp8_rowwise"), boost::hana::type_c<mixed_fp8_rowwise>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_mxfp8"), boost::hana::type_c<mixed_mxfp8>),
    boost::hana::make_pair(BOOST_HANA_STRING("mixed_nvfp4"), boost::hana::type_c<mixed_nvfp4>));

//! The preset named by a compile-time Hana string, as a hana::type:
//! `constexpr auto n = BOOST_HANA_STRING("mixed_float16"); using P = decltype(mpx::policy_by_name(n))::type;`
template <char... Cs>
constexpr auto policy_by_name(boost::hana::string<Cs...> name) {
  auto found = boost::hana::find_if(preset_policies, [&](auto const& entry) {
    return boost::hana::first(entry) == name;
  });
  static_assert(!decltype(found == boost::hana::nothing)::value,
                "mpx::policy_by_name: no preset policy has this name; the presets are "
                "\"float32\", \"mixed_float16\", \"mixed_bfloat16\", \"bfloat16\", \"mixed_fp8\", \"mixed_fp8_current\", \"mixed_fp8_block\", "
                "\"mixed_fp8_rowwise\", \"mixed_mxfp8\" and \"mixed_nvfp4\"");
  return boost::hana::second(*found);
}

//! The preset policy type named by a Hana string type.
template <class HanaString>
using policy_named = typename decltype(policy_by_name(HanaString{}))::type;

namespace detail {
[[noreturn]] inline void unknown_policy(std::string_view name, source_location loc) {
  fail<invalid_argument>("with_policy",
                         "unknown policy \"" + std::string(name) +
                             "\"; the presets are float32, mixed_float16, mixed_bfloat16, bfloat16, mixed_fp8, mixed_fp8_current, mixed_fp8_block, "
                             "mixed_fp8_rowwise, mixed_mxfp8 and mixed_nvfp4",
                         loc);
}

// Each step compares then calls; the last step throws instead of recursing. (An
// if-constexpr branch that only throws, the obvious form, crashes nvcc 13's front end.)
template <std::size_t I, class Result, class F>
Result dispatch_policy(std::string_view name, F& f, source_location loc) {
  constexpr std::size_t count = decltype(boost::hana::length(preset_policies))::value;
  if constexpr (I + 1 < count) {
    if (name != boost::hana::to<char const*>(boost::hana::first(boost::hana::at_c<I>(preset_policies))))
      return dispatch_policy<I + 1, Result>(name, f, loc);
  } else {
    if (name != boost::hana::to<char const*>(boost::hana::first(boost::hana::at_c<I>(preset_policies))))
      unknown_policy(name, loc);
  }
  return f(boost::hana::second(boost::hana::at_c<I>(preset_policies)));
}
}  // namespace detail

//! Calls f(hana::type_c<P>) for the preset named `name` (from a command line, a config
//! file) and returns what f returns; an unknown name throws mpx::invalid_argument that
//! lists the presets and names the caller's line. This is how one binary runs a model
//! under any of them.
template <class F, class Result = std::invoke_result_t<F&, boost::hana::basic_type<float32>>>
Result with_policy(std::string_view name, F&& f, source_location loc = source_location::current()) {
  return detail::dispatch_policy<0, Result>(name, f, loc);
}

}  // namespace mpx
