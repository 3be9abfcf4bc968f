// expect: mpx needs C++20: compile with -std=c++20
// Compiled with -std=c++17 (nvcc's default): one #error that says what to do.
#include <mpx/mpx.hpp>
int main() { return 0; }
