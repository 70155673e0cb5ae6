#include "dbuf/plan_io/model_file.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace dbuf::plan_io {
namespace {

using nlohmann::json;

Error invalid(std::string message) {
  return makeError(ErrorCode::kInvalidArgument, std::move(message));
}

/// Records where and why parsing failed; the DOM parser's non-throwing mode
/// only says that it failed. Used on the error path only.
class SyntaxErrorRecorder final : public nlohmann::json_sax<json> {
 public:
  bool null() override { return true; }
  bool boolean(bool /*value*/) override { return true; }
  bool number_integer(number_integer_t /*value*/) override { return true; }
  bool number_unsigned(number_unsigned_t /*value*/) override { return true; }
  bool number_float(number_float_t /*value*/, const string_t& /*text*/) override { return true; }
  bool string(string_t& /*value*/) override { return true; }
  bool binary(binary_t& /*value*/) override { return true; }
  bool start_object(std::size_t /*elements*/) override { return true; }
  bool key(string_t& /*value*/) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t /*elements*/) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& error) override {
    message = error.what();
    // "[json.exception.parse_error.101] parse error at line 3, column 5: ..." -> "parse error at ..."
    if (const auto bracket = message.find("] "); message.starts_with("[json.") && bracket != std::string::npos) {
      message.erase(0, bracket + 2);
    }
    return false;
  }

  std::string message;
};

std::string syntaxError(std::string_view text) {
  SyntaxErrorRecorder recorder;
  if (json::sax_parse(text, &recorder, json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/false) ||
      recorder.message.empty()) {
    return "not valid JSON";
  }
  return "not valid JSON: " + recorder.message;
}

Result<planner::TensorSpec> parseTensor(const json& node, const std::string& where) {
  if (!node.is_object()) return invalid(where + ": a tensor must be an object");
  planner::TensorSpec tensor;
  const auto name = node.find("name");
  if (name == node.end() || !name->is_string()) return invalid(where + ": tensor without a string \"name\"");
  tensor.name = name->get<std::string>();
  const std::string what = where + ": tensor '" + tensor.name + "'";

  const auto shape = node.find("shape");
  if (shape == node.end() || !shape->is_array() || shape->empty()) {
    return invalid(what + ": \"shape\" must be a non-empty array of integers");
  }
  for (const json& dim : *shape) {
    if (!dim.is_number_integer()) return invalid(what + ": \"shape\" must hold integers");
    const auto value = dim.get<std::int64_t>();
    if (value <= 0) return invalid(what + ": dimension " + std::to_string(value) + " is not positive");
    tensor.shape.push_back(value);
  }

  const auto dtype = node.find("dtype");
  if (dtype != node.end()) {
    if (!dtype->is_string()) return invalid(what + ": \"dtype\" must be a string");
    const auto parsed = parseDType(dtype->get<std::string>());
    if (!parsed) return invalid(what + ": unknown dtype '" + dtype->get<std::string>() + "'");
    tensor.dtype = *parsed;
  }

  const auto rule = node.find("granularity");
  if (rule != node.end()) {
    std::string text;
    if (rule->is_string()) {
      text = rule->get<std::string>();
    } else if (rule->is_number_integer()) {
      text = std::to_string(rule->get<std::int64_t>());
    } else {
      return invalid(what + ": \"granularity\" must be a rule string or an element count");
    }
    auto parsed = planner::GranularityRule::parse(text);
    if (!parsed) return std::move(parsed).error().withContext(what);
    tensor.granularity = *parsed;
  }

  const auto tp_dim = node.find("tp_dim");
  if (tp_dim != node.end()) {
    if (!tp_dim->is_number_integer()) return invalid(what + ": \"tp_dim\" must be an integer");
    tensor.tp_dim = tp_dim->get<int>();
  }
  return tensor;
}

Result<planner::UnitSpec> parseUnit(const json& node, std::size_t index, const std::string& file,
                                    std::size_t& skipped) {
  const std::string where = file + ": unit #" + std::to_string(index);
  if (!node.is_object()) return invalid(where + ": a unit must be an object");
  planner::UnitSpec unit;
  const auto name = node.find("name");
  unit.name = (name != node.end() && name->is_string()) ? name->get<std::string>() : "#" + std::to_string(index);
  const std::string unit_where = file + ": unit '" + unit.name + "'";
  const auto tensors = node.find("tensors");
  if (tensors == node.end() || !tensors->is_array()) return invalid(unit_where + ": \"tensors\" must be an array");
  for (const json& entry : *tensors) {
    const auto trainable = entry.is_object() ? entry.find("trainable") : entry.end();
    if (trainable != entry.end() && trainable->is_boolean() && !trainable->get<bool>()) {
      ++skipped;
      continue;
    }
    auto tensor = parseTensor(entry, unit_where);
    if (!tensor) return std::move(tensor).error();
    unit.tensors.push_back(std::move(*tensor));
  }
  if (unit.tensors.empty()) return invalid(unit_where + ": unit has no tensors");
  return unit;
}

}  // namespace

/// A unit written as `{"name": "layers.4", "like": "layers.3"}`: the tensors
/// of an earlier unit, with the earlier unit's name in each tensor name
/// ("model.layers.3.mlp...") replaced by this one's. Keeps files of models
/// with dozens of identical layers small.
Result<planner::UnitSpec> unitLike(const json& node, std::size_t index, const std::string& file,
                                   const std::vector<planner::UnitSpec>& earlier,
                                   const std::vector<std::size_t>& skipped_per_unit, std::size_t& skipped) {
  const std::string where = file + ": unit #" + std::to_string(index);
  const auto name = node.find("name");
  const auto like = node.find("like");
  if (name == node.end() || !name->is_string() || !like->is_string() || node.contains("tensors")) {
    return invalid(where + ": a \"like\" unit needs a string \"name\", a string \"like\" and no \"tensors\"");
  }
  const std::string source_name = like->get<std::string>();
  const auto source = std::find_if(earlier.begin(), earlier.end(),
                                   [&](const planner::UnitSpec& unit) { return unit.name == source_name; });
  if (source == earlier.end()) return invalid(where + ": \"like\" names no earlier unit '" + source_name + "'");
  planner::UnitSpec unit{name->get<std::string>(), source->tensors};
  const std::string from = source_name + ".";
  const std::string to = unit.name + ".";
  for (planner::TensorSpec& tensor : unit.tensors) {
    if (const auto at = tensor.name.find(from); at != std::string::npos) tensor.name.replace(at, from.size(), to);
  }
  skipped = skipped_per_unit[static_cast<std::size_t>(source - earlier.begin())];
  return unit;
}

Result<ModelFile> parseModelJson(std::string_view text, const std::string& path) {
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return invalid(path + ": " + syntaxError(text));
  if (!root.is_object()) return invalid(path + ": the top level must be an object");
  ModelFile file;
  file.path = path;
  const auto model = root.find("model");
  file.model = (model != root.end() && model->is_string()) ? model->get<std::string>() : path;
  const auto units = root.find("fsdp_units");
  if (units == root.end() || !units->is_array()) return invalid(path + ": \"fsdp_units\" must be an array");
  if (units->empty()) return invalid(path + ": \"fsdp_units\" is empty");
  std::vector<std::size_t> skipped_per_unit;
  for (std::size_t i = 0; i < units->size(); ++i) {
    std::size_t skipped = 0;
    auto unit = (*units)[i].contains("like") ? unitLike((*units)[i], i, path, file.units, skipped_per_unit, skipped)
                                              : parseUnit((*units)[i], i, path, skipped);
    if (!unit) return std::move(unit).error();
    skipped_per_unit.push_back(skipped);
    file.skipped_buffers += skipped;
    if (auto valid = planner::validateUnit(*unit); !valid) return std::move(valid).error().withContext(path);
    file.units.push_back(std::move(*unit));
  }
  return file;
}

Result<ModelFile> loadModelFile(const std::string& path) {
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) {
    return makeError(ErrorCode::kInvalidArgument, path + ": is a directory, not a model file");
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int error = errno;  // libstdc++ opens with fopen, which sets errno
    return makeError(ErrorCode::kNotFound,
                     path + ": cannot open model file" + (error != 0 ? ": " + std::string(std::strerror(error)) : ""));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return makeError(ErrorCode::kIo, path + ": read failed");
  auto model = parseModelJson(text.str(), path);
#if defined(__GLIBC__)
  // A large model's JSON tree leaves hundreds of thousands of small freed
  // chunks behind; hand them back now, or glibc consolidates them inside the
  // first big allocation of whoever runs next (the planner, 15 ms).
  malloc_trim(0);
#endif
  return model;
}

}  // namespace dbuf::plan_io
