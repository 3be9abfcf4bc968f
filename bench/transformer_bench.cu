// The benchmark compiled by nvcc, for the CUDA rows.
#include "transformer_bench.cpp"
