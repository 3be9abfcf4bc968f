// The benchmark compiled by nvcc, for the CUDA rows (beside cuBLAS).
#include "gemm_bench.cpp"
