// The host-only build of mpx_torch: the same translation unit as a CUDA build, compiled
// by the C++ compiler, so mpx runs on its host executor and the CUDA paths compile away.
#include "mpx_torch.cu"
