// Data-parallel training: the communicator concept, the replica hooks the training loop
// calls, mpx::data_parallel and the file bootstrap. The backends are included on their
// own, since they need their engines' headers: <mpx/dist/mpi_communicator.hpp> (MPI) and
// <mpx/dist/nccl_communicator.hpp> (NCCL, CUDA). Not part of <mpx/mpx.hpp>.
#pragma once

#include <mpx/dist/communicator.hpp>
#include <mpx/dist/data_parallel.hpp>
#include <mpx/dist/file_bootstrap.hpp>
#include <mpx/dist/replica_hooks.hpp>
