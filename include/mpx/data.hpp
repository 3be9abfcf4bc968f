// <mpx/data.hpp>: the IDX reader, Fashion-MNIST/MNIST loaders, batching and prefetch,
// byte-level text corpora in windows.
// One include per area; <mpx/mpx.hpp> includes every area.
#pragma once

#include <mpx/data/batches.hpp>
#include <mpx/data/dataset.hpp>
#include <mpx/data/idx.hpp>
#include <mpx/data/tensor_batches.hpp>
#include <mpx/data/text_corpus.hpp>
