// gradsync/core/threads.h - how many CPU threads gradsync's own loops use.
//
// The element-wise CPU work on arenas (optimizer steps, scale, axpy, add, fill, casts) and the
// CPU reductions (dot, norms) are split across a small pool of threads the library owns. The
// split never changes a result: element-wise work is independent per element, and reductions
// are cut into fixed chunks (independent of the thread count) whose partial sums are added in
// chunk order, so results are bitwise identical for any number of threads.
//
// The default is the number of cores this process may run on (its CPU affinity) divided by the
// number of ranks sharing the machine (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE,
// MPI_LOCALNRANKS or SLURM_NTASKS_PER_NODE), at least 1, so that several ranks on one machine
// do not oversubscribe it. GRADSYNC_NUM_THREADS overrides the default; set_num_threads()
// overrides both.
#pragma once

namespace gradsync {

int num_threads();  // the threads parallel loops use now (above)
// n >= 1. Takes effect for the next parallel loop; the pool grows or idles as needed.
void set_num_threads(int n);
// What the default would be here (cores / local ranks, or GRADSYNC_NUM_THREADS).
int default_num_threads();

}  // namespace gradsync
