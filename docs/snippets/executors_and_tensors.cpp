// docs/executors_and_tensors.md: tensors and views, copies, the elementwise algorithms,
// errors, and a step written once for any executor.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <string_view>
#include <utility>
#include <vector>

using mpx::half;

// A user functor for mpx::transform: MPX_HD makes it callable on host and device.
struct where_positive {
  MPX_HD float operator()(float x, float mask) const { return mask > 0 ? x : 0.0f; }
};

// Written once; runs on mpx::host_executor here and on mpx::cuda_executor{stream} in a .cu file.
template <class Exec, class Params, class Grads>
void sgd_step(Exec const& exec, Params&& params, Grads&& grads, float learning_rate) {
  mpx::axpy(exec, -learning_rate, grads, params);  // params += -lr * grads, one rounding
}

// Compiled by this test (which has no GPU) but never run: what a plain .cpp file may do
// with a cuda_executor. Launching a kernel (mpx::fill, mpx::cast, ...) needs nvcc.
inline mpx::tensor<float> round_trip_through_gpu(cudaStream_t stream, mpx::tensor<float> const& host) {
  mpx::cuda_executor gpu{stream};
  mpx::tensor<float, mpx::device_space> d = mpx::to_device(gpu, host);  // enqueued, not waited for
  auto e = mpx::make_tensor<float>(gpu, d.shape());                      // cudaMallocAsync on the stream
  mpx::copy(gpu, d, e);                                                  // cudaMemcpyAsync
  return mpx::to_host(gpu, e);                                           // waits for the stream
}

int main() {
  bool ok = true;
  mpx::host_executor exec;

  // Tensors own memory, uninitialised; make_tensor allocates in the executor's space.
  auto w = mpx::make_tensor<float>(exec, {2, 3});  // mpx::tensor<float, mpx::host_space>
  mpx::fill(exec, w, 1.0f);
  ok &= w.shape() == mpx::shape{2, 3} && w.size() == 6 && w.shape().to_string() == "[2, 3]";

  // Move-only: a copy is explicit.
  auto w_copy = mpx::make_tensor<float>(exec, w.shape());
  mpx::copy(exec, w, w_copy);
  mpx::tensor<float> moved = std::move(w_copy);  // w_copy is now empty, shape [0]

  // Views: non-owning, cheap; flat() and reshape() give other views of the same memory.
  mpx::tensor_view<float> v = mpx::view(moved);
  mpx::tensor_view<float> row1 = v.flat(3, 3);  // elements 3, 4, 5 as shape [3]
  mpx::fill(exec, row1, 2.0f);
  mpx::tensor_view<float> column_major = v.reshape({3, 2});
  ok &= column_major.data() == moved.data() && moved[2] == 1.0f && moved[3] == 2.0f;

  // Your own memory, wrapped in a view.
  std::vector<float> grads_from_elsewhere = {0.5f, -0.5f, 1.0f, 0.0f, 4.0f, -4.0f};
  mpx::tensor_view<float const> g(grads_from_elsewhere.data(), w.shape());

  // Elementwise algorithms; all shapes must match.
  sgd_step(exec, w, g, 0.1f);  // w = 1 - 0.1 * g
  ok &= w[0] == 0.95f && w[4] == 0.6f;

  auto w16 = mpx::make_tensor<half>(exec, w.shape());
  mpx::cast(exec, w, w16);    // round to nearest even
  mpx::scale(exec, w16, 2.0f);  // in float, then rounded to half
  ok &= mpx::cast<float>(w16[0]) == 1.900390625f;  // 0.95 in half is 0.9501953125

  auto dx = mpx::make_tensor<float>(exec, w.shape());
  mpx::transform(exec, dx, where_positive{}, w, g);  // dx[i] = g[i] > 0 ? w[i] : 0
  ok &= dx[0] == 0.95f && dx[1] == 0.0f;

  // A shape mismatch throws before anything is written, naming both arguments and shapes.
  auto wrong = mpx::make_tensor<float>(exec, {3, 2});
  try {
    mpx::copy(exec, w, wrong);
    ok = false;
  } catch (mpx::shape_error const& e) {
    std::printf("%s\n", e.what());  // mpx::copy: src has shape [2, 3] but dst has shape [3, 2] (at .../copy.hpp:NN)
    ok &= std::string_view(e.what()).find("src has shape [2, 3] but dst has shape [3, 2]") != std::string_view::npos;
  }
  try {
    (void)v.flat(4, 3);
    ok = false;
  } catch (mpx::invalid_argument const& e) {
    std::printf("%s\n", e.what());
  }
  try {
    (void)v.reshape({4, 2});
    ok = false;
  } catch (mpx::error const& e) {  // mpx::shape_error; every mpx exception derives from mpx::error
    std::printf("%s\n", e.what());
  }

  auto back = mpx::to_host(exec, w16);  // on the host executor: a host copy
  ok &= back.size() == 6 && mpx::bits(back[0]) == mpx::bits(w16[0]);
  return ok ? 0 : 1;
}
