// A job in which one rank fails, for tests/dist/failure_drills.py:
//   failure_drill hang    the last rank sleeps instead of joining an all-reduce; the others
//                         give up after 1 s and name it (mpx::collective_error), then abort
//   failure_drill die     the last rank is killed (SIGKILL) before the all-reduce; mpirun
//                         notices and ends the job
//   failure_drill ok      every rank joins: the drill's own control
#include <mpx/mpx.hpp>
#include <mpx/dist/mpi_communicator.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  mpx::mpi_environment mpi(argc, argv);
  std::string const mode = argc > 1 ? argv[1] : "ok";
  mpx::mpi_communicator comm(MPI_COMM_WORLD, {std::chrono::seconds(1)});
  mpx::host_executor exec;
  auto gradients = mpx::make_tensor<float>(exec, {1000});
  mpx::fill(exec, gradients, 1.0f);
  comm.all_reduce(exec, gradients, mpx::reduce_op::sum);  // everyone is up
  bool const last = comm.rank() == comm.size() - 1;
  if (last && mode == "hang") std::this_thread::sleep_for(std::chrono::seconds(60));
  if (last && mode == "die") std::raise(SIGKILL);
  try {
    comm.all_reduce(exec, gradients, mpx::reduce_op::sum);
  } catch (mpx::collective_error const& e) {
    mpx::mpi_environment::abort(3, e.what());
  }
  std::printf("rank %d: sum %g\n", comm.rank(), static_cast<double>(gradients.data()[0]));
  return 0;
}
