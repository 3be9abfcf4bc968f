// The kernels that take a multi-tensor table (up to 32 KB of kernel parameters), alone,
// for ptxas's resource report: each must read its table where CUDA put it, in the
// kernel's parameter space. A body that took the table's address where the compiler
// cannot see through it would copy all of it into local memory in every thread
// (check_stack_frames.py, which now allows no stack frame at all).
#include <mpx/kernels/unscale_and_check.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/sgd.hpp>

void multi_tensor_kernels(mpx::cuda_executor const& exec, mpx::detail::tensor_table<1> const& one,
                          mpx::detail::tensor_table<5> const& adam_table, mpx::detail::tensor_table<4> const& sgd_table,
                          float const* scale, mpx::detail::chunk_partial* partials, std::uint64_t const* steps,
                          mpx::gradient_summary const* verdict, mpx::detail::weight_rounding const& rounding) {
  mpx::detail::unscale_and_check_kernel<float, true><<<1, mpx::detail::block_size>>>(one, scale, false, partials);
  mpx::detail::unscale_and_check_kernel<__half, false><<<1, mpx::detail::block_size>>>(one, scale, true, partials);
  mpx::detail::optimizer_update_pass<__half>(exec, adam_table, mpx::adam_rule<mpx::constant_learning_rate, false>{},
                                             steps, verdict, rounding);
  mpx::detail::optimizer_update_pass<__nv_bfloat16>(exec, sgd_table, mpx::sgd_rule<mpx::constant_learning_rate>{},
                                                    steps, verdict, rounding);
}
