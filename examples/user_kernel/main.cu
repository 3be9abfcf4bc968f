// The same program compiled by nvcc: the user's kernel and mpx's run on one GPU stream.
#include "main.cpp"
