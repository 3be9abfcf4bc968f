// The groups of the API fuzzer, one fuzzer each (fuzz/fuzz_api.cpp), with a corpus
// folder each (fuzz/corpus/api_<group>/, reproducers in fuzz/regressions/api_<group>/)
// that the host suite replays (tests/model/test_fuzz_api.cpp). The first bytes of an
// input pick the operation within the group, the rest its shapes, dtypes and values.
// Each group is its own translation unit (fuzz/api/<group>.cpp), so the groups compile
// side by side and a change to one rebuilds only it.
#pragma once

#include "harness.hpp"

#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>

namespace mpx_fuzz::api {

void run_elementwise(draw& d);  // elementwise.cpp
void run_matmul(draw& d);       // matmul.cpp
void run_rows(draw& d);         // rows.cpp
void run_sequence(draw& d);     // sequence.cpp
void run_optim(draw& d);        // optim.cpp
void run_fp8_layers(draw& d);   // fp8_layers.cpp

struct group {
  std::string_view name;
  void (*run)(draw&);
  std::string_view covers;  //!< what the group calls, for run.sh's report and the docs
};

inline constexpr group groups[] = {
    {"elementwise", run_elementwise, "fill, cast, scale, axpy, fp8 casts, reductions and finite checks, statistics"},
    {"matmul", run_matmul, "gemm, fp8_gemm, block-scaled fp8, conv2d, max_pool2d"},
    {"rows", run_rows, "layer and batch norm, dropout, softmax, the losses, embedding"},
    {"sequence", run_sequence, "attention, LSTM"},
    {"optim", run_optim, "unscale and check, every optimizer's step"},
    {"fp8_layers", run_fp8_layers, "dense, conv2d and attention under every fp8 and fp4 preset, NaN and inf in their inputs"},
};

//! The group a fuzzer or corpus folder ("api_<group>") is named after.
inline group const* find_group(std::string_view name) {
  for (auto const& g : groups)
    if (g.name == name) return &g;
  return nullptr;
}

//! One input through one group.
inline void run_input(group const& g, std::span<std::uint8_t const> bytes) {
  draw d(bytes);
  g.run(d);
}

}  // namespace mpx_fuzz::api
