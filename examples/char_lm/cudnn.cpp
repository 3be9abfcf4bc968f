// char_lm's fused attention on the GPU: cuDNN's SDPA, registered at start-up by this one
// C++ file (compiled by the C++ compiler, linked with cuDNN). The build adds it where
// Meson found cuDNN and cudnn-frontend; without it the attention runs unfused.
#include <mpx/kernels/cudnn_attention.hpp>
