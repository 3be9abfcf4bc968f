// <mpx/scaling.hpp>: loss scalers (dynamic, static), the multi-tensor unscale-and-
// check, per-tensor fp8 scaling and the block-scaled fp8 recipes.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/scaling/fp8_block_scaling.hpp>
#include <mpx/scaling/fp8_scaling.hpp>
#include <mpx/scaling/loss_scale_rules.hpp>
#include <mpx/scaling/loss_scaler.hpp>
#include <mpx/scaling/unscale_and_check.hpp>
