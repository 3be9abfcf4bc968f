// cuDNN's fused attention (SDPA) for mpx's own CUDA programs: the CUDA suite, char_lm and
// transformer_bench link this one object, compiled once by the C++ compiler (nvcc never
// sees cudnn-frontend: two minutes a translation unit), which registers it at start-up.
// Built where Meson found cuDNN and cudnn-frontend (-Dcudnn); without it the attention
// runs unfused and says why once. A user's program does the same in one C++ file of its
// own (docs/transformers.md).
#include <mpx/kernels/cudnn_attention.hpp>
