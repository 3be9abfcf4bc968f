// The kernel that ends a loss-scaled step, alone, for its PTX: the stuck signal it may
// write must go out as one 16-byte store (check_one_vector_store.py), so a host polling
// the mapped signal never reads half of one.
#include <mpx/kernels/loss_scale_update.hpp>
#include <mpx/scaling/loss_scale_rules.hpp>

__global__ void finish_step_alone(mpx::dynamic_scale_rule rule, mpx::loss_scale_state* state,
                                  mpx::gradient_summary const* summary, std::uint64_t* optimizer_steps,
                                  mpx::detail::stuck_signal* signal) {
  mpx::detail::finish_step(rule, state, summary, optimizer_steps, signal);
}
