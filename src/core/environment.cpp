// The process environment (environment.h): the only place gradsync calls getenv.
#include "environment.h"

#include <algorithm>
#include <array>
#include <cstdlib>

#include "gradsync/core/error.h"

namespace gradsync::environment {

namespace {

// Every knob, in the order docs/environment.md lists them.
constexpr std::array kKnobs{
    Knob{"GRADSYNC_TIMEOUT_MS", "300000",
         "how long any collective, send or receive may take before it fails naming the operation (CommOptions::timeout "
         "overrides it)",
         "comm (every communicator)"},
    Knob{"GRADSYNC_RENDEZVOUS_TIMEOUT_MS", "the operation timeout",
         "how long ranks wait for each other at the rendezvous (CommOptions::rendezvous_timeout overrides it)",
         "comm (Gloo rendezvous)"},
    Knob{"GRADSYNC_RENDEZVOUS_REPORT_MS", "10000",
         "while waiting at the rendezvous, a rank says this often which ranks have not arrived", "comm (Gloo rendezvous)"},
    Knob{"GRADSYNC_DEBUG_COLLECTIVES", "0",
         "1: every collective exchanges its whole descriptor and names the first rank that disagrees "
         "(CommOptions::check_agreement)",
         "comm (CPU and NCCL communicators)"},
    Knob{"GRADSYNC_VERIFY_COLLECTIVES", "1",
         "0: turns off the cheap always-on check that all ranks run the same collective (CommOptions::verify)",
         "comm (CPU communicators)"},
    Knob{"GRADSYNC_REPRODUCIBLE", "0",
         "1: every allreduce, reduce-scatter and coalesced allreduce adds in ascending rank order, so its bits do not "
         "depend on the bucket size, the algorithm or the backend (CommOptions::reproducible; NCCL refuses it)",
         "comm (CPU communicators)"},
    Knob{"GRADSYNC_REPRODUCIBLE_ALGORITHM", "owner",
         "how reproducible mode reduces: owner (each rank adds up its chunk, then an allgather) or chain (partial sums "
         "from rank 0 to the last, then a broadcast); the same bits either way",
         "comm (CPU communicators)"},
    Knob{"GRADSYNC_HIERARCHICAL", "auto",
         "1: every allreduce of ranks on several nodes is hierarchical (reduce-scatter inside each node, allreduce of "
         "each slice across nodes, allgather inside); 0: never; auto: from GRADSYNC_HIERARCHICAL_MIN_KB up, when every "
         "node runs the same number of ranks, more than one (CommOptions::hierarchical)",
         "comm (CPU communicators)"},
    Knob{"GRADSYNC_HIERARCHICAL_MIN_KB", "2048",
         "the smallest allreduce (KiB) that auto mode makes hierarchical", "comm (CPU communicators)"},
    Knob{"GRADSYNC_NODE", "unset",
         "the name of the node this rank runs on (ranks with the same name share one); unset: torchrun's GROUP_RANK, "
         "else the host name (CommOptions::node)",
         "comm (CPU communicators)"},
    Knob{"GRADSYNC_GLOO_HOST", "127.0.0.1",
         "the address (or host name) this rank's Gloo transport listens on, reachable by the other ranks",
         "comm (Gloo)"},
    Knob{"GRADSYNC_GLOO_STORE_DIR", "unset",
         "a shared folder that replaces the TCP store for the Gloo rendezvous", "comm (connect)"},
    Knob{"GRADSYNC_STORE_BIND", "MASTER_ADDR",
         "the address rank 0's rendezvous store listens on (an address of this machine, else an error; * for every "
         "interface); by default MASTER_ADDR's when it is one of this machine's, else every interface",
         "comm (Gloo's TCP store)"},
    Knob{"GRADSYNC_STORE_TOKEN", "derived from the job id",
         "the secret every rank presents to the rendezvous store, the same on every rank (scripts/launch.sh sets a "
         "random one); unset: derived from the launcher's job id and the rendezvous",
         "comm (Gloo's TCP store)"},
    Knob{"GRADSYNC_STORE_MAX_MB", "256",
         "what rank 0's rendezvous store holds at most, every key and value together: a set past it is refused, "
         "whoever sends it", "comm (Gloo's TCP store)"},
    Knob{"GRADSYNC_TORCH_STORE", "under torchrun's agent store",
         "1: the store at MASTER_ADDR:MASTER_PORT is a PyTorch TCPStore that something else serves, and every rank is "
         "its client (the default when torchrun sets TORCHELASTIC_USE_AGENT_STORE=True); 0: rank 0 serves gradsync's own",
         "comm (Gloo's rendezvous)"},
    Knob{"GRADSYNC_FLIGHT_RECORDER", "1024",
         "operations each communicator remembers for post-mortems (0: none)", "comm (flight recorder)"},
    Knob{"GRADSYNC_FLIGHT_RECORDER_DIR", "unset",
         "a folder: each rank dumps its flight record there (rank<R>.json) on a timeout, a collective mismatch, a lost "
         "peer, and on SIGUSR1",
         "comm (flight recorder)"},
    Knob{"GRADSYNC_STAGING_POOL_MB", "4096",
         "the most memory of free page-locked and device staging buffers kept for reuse", "core (staging)"},
    Knob{"GRADSYNC_TIMELINE", "unset", "a path: each rank records its timeline to <path> with its rank inserted",
         "core (timeline)"},
    Knob{"GRADSYNC_CPU_ISA", "auto",
         "baseline: the CPU loops use baseline x86-64 instead of AVX2+FMA (the results are the same bits)",
         "core and kernels (CPU loops)"},
    Knob{"GRADSYNC_NUM_THREADS", "cores / ranks on this machine",
         "threads of the CPU kernels per rank (set_num_threads overrides it)", "core (thread pool)"},
};

// Text variables: empty counts as unset (a launcher may export an empty MASTER_ADDR).
const char* raw(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

bool all_digits(const std::string& text, std::size_t max_length) {
  return !text.empty() && text.size() <= max_length &&
         std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A knob that must be a whole number in [minimum, maximum]: nullopt when unset; set but empty
// is malformed.
std::optional<long long> whole_number(const char* name, long long minimum, long long maximum, const char* unit) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  const std::string text(value);
  // Digits only: strtol would read "5s" as 5 and "1e3" as 1.
  GRADSYNC_CHECK(all_digits(text, 15) && std::stoll(text) >= minimum && std::stoll(text) <= maximum, name,
                 " must be a whole number of ", unit, " from ", minimum, " to ", maximum, ", got '", text, "'");
  return std::stoll(text);
}

std::optional<std::chrono::milliseconds> milliseconds(const char* name) {
  const auto value = whole_number(name, 1, 1'000'000'000'000LL, "milliseconds");
  if (!value) return std::nullopt;
  return std::chrono::milliseconds(*value);
}

// A knob that is "0" or "1".
bool switch_knob(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr) return fallback;
  const std::string text(value);
  GRADSYNC_CHECK(text == "0" || text == "1", name, " must be 0 or 1, got '", text, "'");
  return text == "1";
}

std::optional<std::string> text_knob(const char* name) {
  const char* value = raw(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

}  // namespace

std::span<const Knob> knobs() { return kKnobs; }

std::optional<std::string> launcher(const char* name) { return text_knob(name); }

bool is_set(const char* name) { return std::getenv(name) != nullptr; }

int launcher_integer(const char* name, int fallback) {
  const char* value = raw(name);
  if (value == nullptr) return fallback;
  const std::string text(value);
  GRADSYNC_CHECK(all_digits(text, 10) && std::stoll(text) < (1LL << 30), "environment variable ", name, "='", text,
                 "' is not a non-negative integer");
  return static_cast<int>(std::stoll(text));
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

int local_world_size() {
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (const int value = launcher_integer(name, 0); value > 0) return value;
  }
  return 0;
}

std::optional<std::chrono::milliseconds> timeout() { return milliseconds("GRADSYNC_TIMEOUT_MS"); }
std::optional<std::chrono::milliseconds> rendezvous_timeout() { return milliseconds("GRADSYNC_RENDEZVOUS_TIMEOUT_MS"); }
std::chrono::milliseconds rendezvous_report_interval() {
  return milliseconds("GRADSYNC_RENDEZVOUS_REPORT_MS").value_or(std::chrono::milliseconds(10000));
}
bool debug_collectives() { return switch_knob("GRADSYNC_DEBUG_COLLECTIVES", false); }
bool verify_collectives() { return switch_knob("GRADSYNC_VERIFY_COLLECTIVES", true); }
bool reproducible() { return switch_knob("GRADSYNC_REPRODUCIBLE", false); }
bool reproducible_chain() {
  const auto value = text_knob("GRADSYNC_REPRODUCIBLE_ALGORITHM");
  if (!value) return false;
  GRADSYNC_CHECK(*value == "owner" || *value == "chain", "GRADSYNC_REPRODUCIBLE_ALGORITHM must be 'owner' or 'chain', got '",
                 *value, "'");
  return *value == "chain";
}
std::optional<bool> hierarchical() {
  const auto value = text_knob("GRADSYNC_HIERARCHICAL");
  if (!value || *value == "auto") return std::nullopt;
  return switch_knob("GRADSYNC_HIERARCHICAL", false);
}
std::size_t hierarchical_min_bytes() {
  return static_cast<std::size_t>(whole_number("GRADSYNC_HIERARCHICAL_MIN_KB", 0, 1LL << 30, "KiB").value_or(2048)) << 10;
}
std::optional<std::string> node() { return text_knob("GRADSYNC_NODE"); }
std::optional<std::string> gloo_host() { return text_knob("GRADSYNC_GLOO_HOST"); }
std::optional<std::string> gloo_store_dir() { return text_knob("GRADSYNC_GLOO_STORE_DIR"); }
std::optional<std::string> store_bind() { return text_knob("GRADSYNC_STORE_BIND"); }
std::optional<std::string> store_token() {
  // Set but empty is kept (not read as unset, as other knobs are): the store refuses it rather
  // than fall back to a token anybody can derive.
  const char* value = std::getenv("GRADSYNC_STORE_TOKEN");
  return value != nullptr ? std::optional<std::string>(value) : std::nullopt;
}
std::size_t store_max_bytes() {
  return static_cast<std::size_t>(whole_number("GRADSYNC_STORE_MAX_MB", 1, 1 << 20, "MiB").value_or(256)) << 20;
}
bool torch_store() {
  if (is_set("GRADSYNC_TORCH_STORE")) return switch_knob("GRADSYNC_TORCH_STORE", false);
  return text_knob("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
}

std::size_t flight_recorder_entries() {
  return static_cast<std::size_t>(whole_number("GRADSYNC_FLIGHT_RECORDER", 0, 1 << 20, "operations").value_or(1024));
}
std::optional<std::string> flight_recorder_dir() { return text_knob("GRADSYNC_FLIGHT_RECORDER_DIR"); }

std::size_t staging_pool_bytes() {
  return static_cast<std::size_t>(whole_number("GRADSYNC_STAGING_POOL_MB", 0, 1LL << 30, "MiB").value_or(4096)) << 20;
}

std::optional<std::string> timeline_path() { return text_knob("GRADSYNC_TIMELINE"); }

bool baseline_cpu_isa() {
  const auto value = text_knob("GRADSYNC_CPU_ISA");
  if (!value) return false;
  GRADSYNC_CHECK(*value == "baseline" || *value == "auto", "GRADSYNC_CPU_ISA must be 'baseline' or 'auto', got '",
                 *value, "'");
  return *value == "baseline";
}

int num_threads() { return static_cast<int>(whole_number("GRADSYNC_NUM_THREADS", 1, 4095, "threads").value_or(0)); }

}  // namespace gradsync::environment
