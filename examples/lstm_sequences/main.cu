// The same program compiled by nvcc, so it trains on the GPU when one is there.
#include "main.cpp"
