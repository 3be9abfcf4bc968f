// <mpx/model.hpp>: sequential models, the training step and fit loop, model files,
// diagnostics.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/model/diagnostics.hpp>
#include <mpx/model/fit.hpp>
#include <mpx/model/model_file.hpp>
#include <mpx/model/composite.hpp>
#include <mpx/model/precision_guard.hpp>
#include <mpx/model/repeat.hpp>
#include <mpx/model/residual.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/model/shadow.hpp>
#include <mpx/model/tiered.hpp>
#include <mpx/model/train_step.hpp>
#include <mpx/model/training_state.hpp>
