// <mpx/kernels.hpp>: the operations: elementwise, reductions, gemm, fp8_gemm and fp8_block_gemm (cuBLASLt on
// the GPU), activations, column reductions, softmax, norms, dropout, conv2d, pooling, LSTM,
// embeddings; and the passes behind the training pieces: the scaled fp8 cast, the
// gradient unscale-and-check, the loss-scale update, the optimizer update, the step record.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/attention.hpp>
#include <mpx/kernels/batch_norm.hpp>
#include <mpx/kernels/column_reduce.hpp>
#include <mpx/kernels/conv2d.hpp>
#include <mpx/kernels/cublaslt.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/embedding.hpp>
#include <mpx/kernels/fp8_attention.hpp>
#include <mpx/kernels/fp8_block_gemm.hpp>
#include <mpx/kernels/fp8_block_layout.hpp>
#include <mpx/kernels/fp8_block_quantize.hpp>
#include <mpx/kernels/fp8_cast.hpp>
#include <mpx/kernels/fp8_gemm.hpp>
#include <mpx/kernels/nvfp4_quantize.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/kernels/layer_norm.hpp>
#include <mpx/kernels/loss_scale_update.hpp>
#include <mpx/kernels/lstm.hpp>
#include <mpx/kernels/max_pool.hpp>
#include <mpx/kernels/multi_tensor.hpp>
#include <mpx/kernels/optimizer_update.hpp>
#include <mpx/kernels/softmax.hpp>
#include <mpx/kernels/step_record.hpp>
#include <mpx/kernels/unscale_and_check.hpp>
