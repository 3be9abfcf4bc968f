// The same program compiled by nvcc, so it can train on the GPU.
#include "main.cpp"
