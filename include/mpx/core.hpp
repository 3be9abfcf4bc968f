// <mpx/core.hpp>: dtypes (half, bfloat16, dtype_traits), casts, policies, errors,
// shapes. No executor, no CUDA runtime calls: what a kernel author needs
// for types and conversions.
// One include per area; <mpx/mpx.hpp> includes every area. The presets by name
// (Boost.Hana) are <mpx/core/policy_names.hpp>, which <mpx/mpx.hpp> includes too.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/fnv1a.hpp>
#include <mpx/core/host_vector.hpp>
#include <mpx/core/math.hpp>
#include <mpx/core/philox.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/block_formats.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/core/splitmix64.hpp>
#include <mpx/core/stochastic_round.hpp>
