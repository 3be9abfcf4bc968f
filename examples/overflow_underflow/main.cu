// The same program compiled by nvcc, so Part 2 also runs on the GPU.
#include "main.cpp"
