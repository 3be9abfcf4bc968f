// <mpx/exec.hpp>: executors (host, CUDA), memory spaces, tensors and views, copies, the
// dispatch (transform, for_each_index, for_each_row and its lanes, transform_reduce,
// reduce_items, column reductions), launch helpers, resident values, streams.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/exec/columns.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/reduce.hpp>
#include <mpx/exec/reduce_items.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/step_executor.hpp>
#include <mpx/exec/streams.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/exec/transform.hpp>
