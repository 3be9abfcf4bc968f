// The benchmark compiled by nvcc, for the CUDA rows.
#include "activation_bench.cpp"
