// The same program compiled by nvcc, so the loop can run on the GPU.
#include "main.cpp"
