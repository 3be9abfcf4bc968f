// expect: every dtype of a policy must be mpx::half, mpx::bfloat16 or float
#include <mpx/mpx.hpp>
int main() { return sizeof(mpx::policy<int>::storage_type); }
