// Everything mpx offers, in one include. Each area has its own (<mpx/core.hpp>, ...),
// and each header can be included on its own: include less, compile faster.
#pragma once

#include <mpx/core.hpp>
#include <mpx/core/policy_names.hpp>
#include <mpx/exec.hpp>
#include <mpx/kernels.hpp>
#include <mpx/losses.hpp>
#include <mpx/numerics.hpp>
#include <mpx/scaling.hpp>
#include <mpx/optim.hpp>
#include <mpx/layers.hpp>
#include <mpx/model.hpp>
#include <mpx/data.hpp>
