// <mpx/layers.hpp>: typed layers (dense, conv2d, pooling, norms, dropout, LSTM,
// activations, softmax, embeddings) and initialisers.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/layers/attention.hpp>
#include <mpx/layers/activation_layer.hpp>
#include <mpx/layers/batch_norm.hpp>
#include <mpx/layers/conv2d.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/dropout.hpp>
#include <mpx/layers/embedding.hpp>
#include <mpx/layers/flatten.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/kernel_bias_layer.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/layer_norm.hpp>
#include <mpx/layers/lstm.hpp>
#include <mpx/layers/max_pool2d.hpp>
#include <mpx/layers/norm_affine.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/layers/stateless_layer.hpp>
