// Internal: the process environment, read here and nowhere else.
//
// Two kinds of variables configure gradsync:
//  * gradsync's own knobs, GRADSYNC_*: each is one row of the table in environment.cpp (name,
//    default, meaning, the part that reads it), which docs/environment.md reproduces, and has
//    one typed accessor below that parses and validates it. A knob that is set but malformed
//    is an error naming the variable and its value, never a silent default;
//  * the variables of launchers (torchrun's RANK and MASTER_ADDR, Slurm's SLURM_*, Open MPI's
//    OMPI_*): read as text by whoever interprets a launch (comm/connect.cpp), through launcher().
// Accessors read the environment when called (a test may change a variable between calls);
// callers that need a value once per process keep it themselves.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>

namespace gradsync::environment {

// One of gradsync's knobs, as the documentation lists it.
struct Knob {
  const char* name;
  const char* fallback;  // what applies when it is unset
  const char* meaning;
  const char* reader;    // the part of gradsync that reads it
};
std::span<const Knob> knobs();

// ---- Launchers' variables
// The variable's text; nullopt when it is unset or empty.
std::optional<std::string> launcher(const char* name);
// Whether the variable exists at all (empty included): tells "set but empty" from "unset".
bool is_set(const char* name);
// A launcher's non-negative integer (a rank, a size, a port, a job id): `fallback` when unset,
// an error naming the variable when it is anything but digits below 2^30.
int launcher_integer(const char* name, int fallback);
// Whether any of the variables an MPI launcher sets is present (mpirun, srun --mpi).
bool launched_by_mpi();
// The number of ranks on this machine as the launcher says (LOCAL_WORLD_SIZE, Open MPI's,
// MPICH's or Slurm's); 0 when none says.
int local_world_size();

// ---- gradsync's knobs (environment.cpp's table says what each means)
std::optional<std::chrono::milliseconds> timeout();             // GRADSYNC_TIMEOUT_MS
std::optional<std::chrono::milliseconds> rendezvous_timeout();  // GRADSYNC_RENDEZVOUS_TIMEOUT_MS
std::chrono::milliseconds rendezvous_report_interval();         // GRADSYNC_RENDEZVOUS_REPORT_MS
bool debug_collectives();                                       // GRADSYNC_DEBUG_COLLECTIVES
bool verify_collectives();                                      // GRADSYNC_VERIFY_COLLECTIVES
bool reproducible();                                            // GRADSYNC_REPRODUCIBLE
bool reproducible_chain();                                      // GRADSYNC_REPRODUCIBLE_ALGORITHM == chain
// GRADSYNC_HIERARCHICAL: nullopt for auto (unset), else on (1) or off (0).
std::optional<bool> hierarchical();
std::size_t hierarchical_min_bytes();                           // GRADSYNC_HIERARCHICAL_MIN_KB
std::optional<std::string> node();                              // GRADSYNC_NODE
std::optional<std::string> gloo_host();                         // GRADSYNC_GLOO_HOST
std::optional<std::string> gloo_store_dir();                    // GRADSYNC_GLOO_STORE_DIR
std::optional<std::string> store_bind();                        // GRADSYNC_STORE_BIND
std::optional<std::string> store_token();                       // GRADSYNC_STORE_TOKEN
std::size_t store_max_bytes();                                  // GRADSYNC_STORE_MAX_MB, in bytes
bool torch_store();                                             // GRADSYNC_TORCH_STORE, TORCHELASTIC_USE_AGENT_STORE
std::size_t flight_recorder_entries();                          // GRADSYNC_FLIGHT_RECORDER
std::optional<std::string> flight_recorder_dir();               // GRADSYNC_FLIGHT_RECORDER_DIR
std::size_t staging_pool_bytes();                               // GRADSYNC_STAGING_POOL_MB
std::optional<std::string> timeline_path();                     // GRADSYNC_TIMELINE
bool baseline_cpu_isa();                                        // GRADSYNC_CPU_ISA
int num_threads();                                              // GRADSYNC_NUM_THREADS; 0: unset

}  // namespace gradsync::environment
