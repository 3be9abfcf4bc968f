// Everything mpx offers, in one include. Each part can also be included on its own.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/math.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/reduce.hpp>
#include <mpx/numerics/finite.hpp>
#include <mpx/numerics/stats.hpp>
#include <mpx/numerics/sum_of_squares.hpp>
