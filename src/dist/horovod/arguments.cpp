// Horovod's arguments (arguments.h).
#include "arguments.h"

#include <set>
#include <sstream>

namespace gradsync::dist {

const char* op_name(Op op) {
  switch (op) {
    case Op::average: return "average";
    case Op::sum: return "sum";
    case Op::adasum: return "adasum";
    case Op::min: return "min";
    case Op::max: return "max";
    case Op::product: return "product";
  }
  return "?";
}

Op parse_op(const std::string& text) {
  for (Op op : {Op::average, Op::sum, Op::adasum, Op::min, Op::max, Op::product}) {
    if (text == op_name(op)) return op;
  }
  detail::throw_error("unknown op '", text, "': expected one of average, sum, adasum, min, max, product");
}

comm::ReduceOp comm_op(Op op) {
  switch (op) {
    case Op::min: return comm::ReduceOp::min;
    case Op::max: return comm::ReduceOp::max;
    case Op::product: return comm::ReduceOp::prod;
    default: return comm::ReduceOp::sum;  // average = sum with scale factors, as Horovod's core
  }
}

namespace {

// Horovod's split_list: n runs, the first (size % n) one longer.
std::vector<std::vector<Parameter*>> split_into(const std::vector<Parameter*>& parameters, int n) {
  const std::size_t count = parameters.size();
  const std::size_t d = count / static_cast<std::size_t>(n);
  const std::size_t r = count % static_cast<std::size_t>(n);
  std::vector<std::vector<Parameter*>> groups;
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
    const std::size_t begin = i * d + std::min(i, r);
    const std::size_t end = (i + 1) * d + std::min(i + 1, r);
    groups.emplace_back(parameters.begin() + static_cast<std::ptrdiff_t>(begin),
                        parameters.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return groups;
}

}  // namespace

std::map<const Parameter*, std::string> name_parameters(
    const std::vector<Parameter*>& parameters,
    const std::optional<std::vector<std::pair<std::string, Parameter*>>>& named_parameters) {
  std::map<const Parameter*, std::string> name_of;
  if (!named_parameters) {
    for (const Parameter* parameter : parameters) name_of[parameter] = parameter->name();
    return name_of;
  }
  std::map<std::string, int> uses;
  std::map<const Parameter*, std::string> given;
  for (const auto& [name, parameter] : *named_parameters) {
    GRADSYNC_CHECK(parameter != nullptr, "named_parameters should be a sequence of (name, parameter) pairs; '", name,
                   "' has a null parameter");
    ++uses[name];
    given[parameter] = name;
  }
  std::vector<std::string> duplicates;
  for (const auto& [name, count] : uses) {
    if (count > 1) duplicates.push_back(name);
  }
  if (!duplicates.empty()) {
    std::ostringstream list;
    for (std::size_t i = 0; i < duplicates.size(); ++i) list << (i ? ", " : "") << duplicates[i];
    detail::throw_error("Parameter names in named_parameters must be unique. Found duplicates: ", list.str());
  }
  std::vector<std::string> unnamed;
  for (const Parameter* parameter : parameters) {
    const auto found = given.find(parameter);
    if (found == given.end()) {
      unnamed.push_back(parameter->name());
    } else {
      name_of[parameter] = found->second;
    }
  }
  if (!unnamed.empty()) {
    std::ostringstream list;
    for (std::size_t i = 0; i < unnamed.size(); ++i) list << (i ? ", " : "") << "'" << unnamed[i] << "'";
    detail::throw_error(
        "named_parameters was specified, but one or more model parameters were not named. Registry names: ",
        list.str());
  }
  return name_of;
}

std::vector<std::vector<Parameter*>> form_groups(const std::vector<Parameter*>& parameters, const Groups& option,
                                                const std::map<const Parameter*, std::string>& name_of) {
  std::vector<std::vector<Parameter*>> groups;
  if (std::holds_alternative<int>(option)) {
    const int n = std::get<int>(option);
    GRADSYNC_CHECK(n > 0, "groups should be a non-negative integer or a list of lists of parameters (got ", n, ")");
    groups = split_into(parameters, n);
  } else if (std::holds_alternative<std::vector<std::vector<Parameter*>>>(option)) {
    std::set<const Parameter*> used;
    for (const auto& list : std::get<std::vector<std::vector<Parameter*>>>(option)) {
      std::vector<Parameter*> members;
      for (Parameter* member : list) {
        GRADSYNC_CHECK(member != nullptr, "groups must consist of parameters (found a null pointer)");
        GRADSYNC_CHECK(used.insert(member).second, "A parameter can only appear once in groups ('", member->name(),
                       "' appears twice).");
        if (name_of.count(member)) members.push_back(member);  // filtered to the wrapped parameters
      }
      if (!members.empty()) groups.push_back(members);
    }
    for (Parameter* parameter : parameters) {
      if (!used.count(parameter)) groups.push_back({parameter});  // leftovers: singletons
    }
  }
  return groups;
}

}  // namespace gradsync::dist
