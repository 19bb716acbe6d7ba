// Losses (gradsync/nn/loss.h), computed on the host in f64 (their inputs are small: logits).
#include "gradsync/nn/loss.h"

#include <algorithm>
#include <cmath>

namespace gradsync::nn {

namespace {

void require_rows(const char* what, const Tensor& t) {
  GRADSYNC_CHECK(t.shape().size() == 2 && is_floating(t.dtype()), what, ": expected a floating [batch, n] tensor, got ",
                 t.describe());
}

std::vector<std::int64_t> labels_of(const Tensor& labels, std::int64_t batch, std::int64_t classes) {
  GRADSYNC_CHECK(labels.dtype() == DType::i64 && labels.numel() == batch, "labels: expected i64 [", batch, "], got ",
                 labels.describe());
  const Tensor host = labels.to(Device::cpu());
  std::vector<std::int64_t> out(host.data_as<std::int64_t>(), host.data_as<std::int64_t>() + batch);
  for (const std::int64_t label : out) {
    GRADSYNC_CHECK(label >= 0 && label < classes, "label ", label, " is outside the ", classes, " classes");
  }
  return out;
}

}  // namespace

LossResult softmax_cross_entropy(const Tensor& logits, const Tensor& labels, std::optional<double> grad_scale) {
  require_rows("softmax_cross_entropy", logits);
  const std::int64_t batch = logits.shape()[0], classes = logits.shape()[1];
  const std::vector<std::int64_t> y = labels_of(labels, batch, classes);
  const std::vector<double> z = logits.to_double_vector();
  const double scale = grad_scale.value_or(1.0 / static_cast<double>(batch));
  std::vector<double> grad(z.size());
  LossResult result;
  for (std::int64_t i = 0; i < batch; ++i) {
    const double* row = z.data() + i * classes;
    // Softmax with the maximum subtracted: exp never overflows.
    const double top = *std::max_element(row, row + classes);
    double sum = 0;
    for (std::int64_t c = 0; c < classes; ++c) sum += std::exp(row[c] - top);
    const double log_sum = std::log(sum) + top;
    result.loss += log_sum - row[y[static_cast<std::size_t>(i)]];
    std::int64_t best = 0;
    for (std::int64_t c = 0; c < classes; ++c) {
      const double p = std::exp(row[c] - log_sum);
      grad[static_cast<std::size_t>(i * classes + c)] = (p - (c == y[static_cast<std::size_t>(i)] ? 1.0 : 0.0)) * scale;
      if (row[c] > row[best]) best = c;
    }
    result.correct += best == y[static_cast<std::size_t>(i)] ? 1 : 0;
  }
  result.loss /= static_cast<double>(batch);
  result.grad = Tensor::from_vector(grad, logits.shape()).to(logits.dtype()).to(logits.device());
  return result;
}

LossResult mse_loss(const Tensor& output, const Tensor& target, std::optional<double> grad_scale) {
  require_rows("mse_loss", output);
  GRADSYNC_CHECK(target.numel() == output.numel(), "mse_loss: target ", target.describe(), " does not match ",
                 output.describe());
  const std::int64_t batch = output.shape()[0], features = output.shape()[1];
  const std::vector<double> y = output.to_double_vector();
  const std::vector<double> t = target.to_double_vector();
  const double scale = grad_scale.value_or(1.0 / static_cast<double>(batch));
  std::vector<double> grad(y.size());
  LossResult result;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double d = y[i] - t[i];
    result.loss += d * d;
    grad[i] = 2.0 * d / static_cast<double>(features) * scale;
  }
  result.loss /= static_cast<double>(y.size());
  result.grad = Tensor::from_vector(grad, output.shape()).to(output.dtype()).to(output.device());
  return result;
}

std::int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  require_rows("count_correct", logits);
  const std::int64_t batch = logits.shape()[0], classes = logits.shape()[1];
  const std::vector<std::int64_t> y = labels_of(labels, batch, classes);
  const std::vector<double> z = logits.to_double_vector();
  std::int64_t correct = 0;
  for (std::int64_t i = 0; i < batch; ++i) {
    const double* row = z.data() + i * classes;
    correct += std::max_element(row, row + classes) - row == y[static_cast<std::size_t>(i)] ? 1 : 0;
  }
  return correct;
}

}  // namespace gradsync::nn
