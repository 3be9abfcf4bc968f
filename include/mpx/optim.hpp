// <mpx/optim.hpp>: optimizers (SGD, Adam, AdamW), learning-rate schedules,
// loss_scale_optimizer, checkpoints.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/learning_rate.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/optim/optimizer.hpp>
#include <mpx/optim/parameter.hpp>
#include <mpx/optim/sgd.hpp>
