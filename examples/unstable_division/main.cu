// The same program compiled by nvcc: the layer's kernels then run on the GPU.
#include "main.cpp"
