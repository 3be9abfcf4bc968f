#include "main.cpp"
