// The benchmark compiled by nvcc, for the CUDA rows.
#include "scaling_bench.cpp"
