// The CUDA suite's fused attention: cuDNN's SDPA, compiled by the C++ compiler (nvcc
// never sees cudnn-frontend), registered at start-up. Built where Meson found cuDNN and
// cudnn-frontend (-Dcudnn); the attention tests then require the fused path on the GPU.
#include <mpx/kernels/cudnn_attention.hpp>
