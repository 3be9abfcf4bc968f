// The benchmark compiled by nvcc, for the CUDA rows.
#include "layer_bench.cpp"
