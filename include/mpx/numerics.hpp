// <mpx/numerics.hpp>: finite checks (over a tensor, and block-level for your own
// kernels), numerics statistics, sums of squares, the exponent histogram.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/numerics/block_finite.hpp>
#include <mpx/numerics/finite.hpp>
#include <mpx/numerics/histogram.hpp>
#include <mpx/numerics/stats.hpp>
#include <mpx/numerics/sum_of_squares.hpp>
