// <mpx/losses.hpp>: losses from logits and MSE, computed in float, their values kept on
// the executor.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/losses/binary_cross_entropy.hpp>
#include <mpx/losses/cross_entropy.hpp>
#include <mpx/losses/loss_value.hpp>
#include <mpx/losses/mean_squared_error.hpp>
