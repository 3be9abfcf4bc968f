// The benchmark compiled by nvcc, for the CUDA rows.
#include "numerics_bench.cpp"
