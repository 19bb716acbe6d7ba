// A user's data-parallel program built with CMake against the installed gradsync
// (find_package(gradsync CONFIG)), run on 2 ranks by tests/consumer/run_cmake_consumer_test.sh:
// DataParallel averages the ranks' gradients, SGD steps, and every rank must end with the
// same weights.
#include <gradsync/comm/connect.h>
#include <gradsync/config.h>
#include <gradsync/dist/data_parallel/data_parallel.h>
#include <gradsync/optim/sgd.h>
#include <gradsync/registry/parameter_registry.h>

#include <cstdio>
#include <vector>

#if !GRADSYNC_WITH_GLOO
#error "the consumer test runs over Gloo"
#endif

int main() try {
  auto comm = gradsync::comm::connect("gloo");
  gradsync::ParameterRegistry registry;
  gradsync::Parameter& w = registry.add("w", {2});
  registry.finalize();
  gradsync::dist::DataParallel ddp(registry, *comm);
  gradsync::optim::SGD sgd(registry, gradsync::optim::SGD::Options{.lr = 1.0});
  // Rank r's gradient is (r + 1, 2r); the mean over 2 ranks is (1.5, 1).
  const double r = comm->rank();
  w.set_grad(gradsync::Tensor::from_vector(std::vector<double>{r + 1, 2 * r}, {2}).to(gradsync::DType::f32));
  ddp.begin_backward();
  registry.mark_ready(w);
  ddp.end_backward();
  sgd.step();
  const std::vector<double> value = w.value().to_double_vector();
  std::printf("cmake consumer rank %d of %d: w = (%g, %g)\n", comm->rank(), comm->size(), value[0], value[1]);
  return value[0] == -1.5 && value[1] == -1.0 ? 0 : 1;
} catch (const std::exception& error) {
  std::fprintf(stderr, "cmake consumer: %s\n", error.what());
  return 1;
}
