// The models of the multi-rank tests (models.h).
#include "models.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>

namespace gradsync::testing {

Regression::Regression(std::int64_t samples, DType dtype, Device device_) : device(device_) {
  w = &registry.add("w", {kFeatures}, dtype, device);
  b = &registry.add("b", {1}, dtype, device);
  registry.finalize();
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> truth(kFeatures);
  for (double& t : truth) t = normal(rng);
  for (std::int64_t s = 0; s < samples; ++s) {
    std::vector<double> row(kFeatures);
    double target = 0.5;
    for (std::int64_t f = 0; f < kFeatures; ++f) {
      row[static_cast<std::size_t>(f)] = normal(rng);
      target += row[static_cast<std::size_t>(f)] * truth[static_cast<std::size_t>(f)];
    }
    x.push_back(row);
    y.push_back(target + 0.1 * normal(rng));
  }
  w->value().copy_from(Tensor::from_vector(std::vector<double>(kFeatures, 0.1), {kFeatures}).to(dtype));
}

double Regression::backward(std::int64_t begin, std::int64_t end, bool mark_ready, bool with_bias) {
  const std::vector<double> wv = w->value().to_double_vector();
  const double bv = b->value().to_double_vector()[0];
  std::vector<double> gw(kFeatures, 0.0);
  double gb = 0.0;
  for (std::int64_t s = begin; s < end; ++s) {
    double pred = bv;
    for (std::int64_t f = 0; f < kFeatures; ++f) pred += x[static_cast<std::size_t>(s)][static_cast<std::size_t>(f)] * wv[static_cast<std::size_t>(f)];
    const double error = (pred - y[static_cast<std::size_t>(s)]) / static_cast<double>(end - begin);
    gb += error;
    for (std::int64_t f = 0; f < kFeatures; ++f) gw[static_cast<std::size_t>(f)] += error * x[static_cast<std::size_t>(s)][static_cast<std::size_t>(f)];
  }
  if (with_bias) {
    b->accumulate_grad(Tensor::from_vector(std::vector<double>{gb}, {1}).to(b->dtype()).to(device));
    if (mark_ready) registry.mark_ready(*b);
  }
  w->accumulate_grad(Tensor::from_vector(gw, {kFeatures}).to(w->dtype()).to(device));
  if (mark_ready) registry.mark_ready(*w);
  return gb;
}

ShardModel::ShardModel(DType dtype, Device device) {
  for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
           {"embedding", {13, 7}}, {"weight", {37}}, {"bias", {1}}, {"head", {5, 11}}, {"scale", {129}}}) {
    parameters.push_back(&registry.add(name, shape, dtype, device));
  }
  registry.finalize();
  for (std::size_t k = 0; k < parameters.size(); ++k) {
    std::vector<double> init(static_cast<std::size_t>(parameters[k]->numel()));
    for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.05 * std::sin(1.7 * static_cast<double>(i) + static_cast<double>(k));
    parameters[k]->value().copy_from(Tensor::from_vector(init, parameters[k]->shape()).to(dtype).to(device));
  }
}

std::vector<double> ShardModel::all_values() const {
  std::vector<double> all;
  for (const Parameter* p : parameters) {
    const std::vector<double> v = p->value().to_double_vector();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

void ShardModel::backward(int rank, int step, int micro, const Parameter* skip) {
  for (std::size_t k = parameters.size(); k-- > 0;) {
    Parameter& p = *parameters[k];
    if (&p == skip) continue;
    const std::vector<double> v = p.value().to_double_vector();
    std::vector<double> g(v.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      g[i] = 0.3 * v[i] + 0.02 * (rank + 1) * std::cos(0.37 * static_cast<double>(i) + step + 0.5 * micro + static_cast<double>(k));
    }
    p.accumulate_grad(Tensor::from_vector(g, p.shape()).to(p.grad_dtype()).to(p.device()));
    registry.mark_ready(p);
  }
}

std::vector<char> arena_bytes(const ParameterRegistry& registry) {
  std::vector<char> bytes;
  for (const Arena& arena : registry.arenas()) {
    const Tensor host = arena.values.to(Device::cpu());
    const char* data = static_cast<const char*>(host.data());
    bytes.insert(bytes.end(), data, data + host.nbytes());
  }
  return bytes;
}

std::vector<double> as_doubles(const std::vector<char>& bytes, DType dtype) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(bytes.size() / dtype_size(dtype))}, dtype);
  std::memcpy(t.data(), bytes.data(), bytes.size());
  return t.to_double_vector();
}

std::shared_ptr<nn::Sequential> fixture_mlp(ParameterRegistry& registry, const io::SafetensorsReader& fixture) {
  auto layers = std::make_shared<nn::Sequential>(registry);
  layers->add<nn::Linear>("0", 8, 16);
  layers->add<nn::ReLU>();
  layers->add<nn::Linear>("2", 16, 16);
  layers->add<nn::ReLU>();
  layers->add<nn::Linear>("4", 16, 4);
  registry.finalize();
  for (Parameter& p : registry) p.value().copy_from(fixture.read("init." + p.name()));
  return layers;
}

}  // namespace gradsync::testing
