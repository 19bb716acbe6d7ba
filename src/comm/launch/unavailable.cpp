// Factories of the backends this build does not have: each says so clearly.
#include "gradsync/comm/quorum/coordinator.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/comm/mpi/mpi.h"
#include "gradsync/comm/nccl/nccl.h"
#include "gradsync/core/device.h"
#include "gradsync/config.h"

namespace gradsync::comm {

#if !GRADSYNC_WITH_GLOO
// The coordinator serves gradsync's TCP store, which is built with Gloo.
std::string coordinator_token(int port) { return std::to_string(port); }
std::string Quorum::describe() const { return error; }
std::string Quorum::to_line() const { return {}; }
Quorum Quorum::from_line(const std::string&, int) { return {}; }
Coordinator::Coordinator(const CoordinatorOptions&) {
  detail::throw_error("gradsync was built without Gloo, whose TCP store the coordinator serves");
}
Coordinator::~Coordinator() = default;
int Coordinator::port() const { return 0; }
CoordinatorCounters Coordinator::counters() const { return {}; }
QuorumClient::QuorumClient(const QuorumClientOptions&, bool) {
  detail::throw_error("gradsync was built without Gloo: fault tolerance across groups needs it");
}
QuorumClient::~QuorumClient() = default;
Quorum QuorumClient::join(std::int64_t) { return {}; }
Quorum QuorumClient::vote(const Quorum&, std::int64_t, bool) { return {}; }
void QuorumClient::leave(const std::string&) noexcept {}
std::unique_ptr<Communicator> QuorumClient::connect(std::int64_t, const std::string&, int, int, int) { return nullptr; }
const std::string& QuorumClient::where() const {
  static const std::string nowhere = "no coordinator";
  return nowhere;
}
bool gloo_available() { return false; }
void run_gloo_thread_group(int, const std::function<void(Communicator&)>&, const CommOptions&) {
  detail::throw_error("gradsync was built without Gloo (install libgloo-dev and reconfigure)");
}
void run_gloo_thread_group(int, const std::function<void(Communicator&)>&, const std::function<CommOptions(int)>&) {
  detail::throw_error("gradsync was built without Gloo (install libgloo-dev and reconfigure)");
}
std::unique_ptr<Communicator> gloo_file_store(const std::filesystem::path&, int, int, const CommOptions&) {
  detail::throw_error("gradsync was built without Gloo (install libgloo-dev and reconfigure)");
}
std::unique_ptr<Communicator> gloo_tcp_store(const std::string&, int, int, int, const CommOptions&) {
  detail::throw_error("gradsync was built without Gloo (install libgloo-dev and reconfigure)");
}
std::unique_ptr<Communicator> gloo_torch_store(const std::string&, int, int, int, const std::string&, const CommOptions&) {
  detail::throw_error("gradsync was built without Gloo (install libgloo-dev and reconfigure)");
}
#endif

#if !GRADSYNC_WITH_MPI
bool mpi_available() { return false; }
bool launched_by_mpi() { return false; }  // an MPI launch without MPI compiled in: Gloo it is
std::unique_ptr<Communicator> mpi_world(const CommOptions&) {
  detail::throw_error("gradsync was built without MPI (install libopenmpi-dev and reconfigure)");
}
#endif

#if !GRADSYNC_WITH_NCCL
bool nccl_available() { return false; }
std::string nccl_unavailable_reason() {
  return cuda_compiled() ? "gradsync was built without NCCL (libnccl not found at configure time)"
                         : "gradsync was built without CUDA, hence without NCCL";
}
std::unique_ptr<Communicator> nccl_communicator(Communicator&, const CommOptions&, int) {
  detail::throw_error("nccl_communicator: ", nccl_unavailable_reason());
}
#endif

}  // namespace gradsync::comm
