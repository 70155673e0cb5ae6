#pragma once
/// \file
/// Model files: `{"model": ..., "fsdp_units": [{"name", "tensors": [{"name",
/// "shape", "dtype", "granularity"?, "tp_dim"?, "trainable"?}]}]}` as in
/// shared/models. Tensors marked `"trainable": false` are buffers, not FSDP
/// parameters, and are left out. A unit may instead be written
/// `{"name": "layers.4", "like": "layers.3"}`: a copy of an earlier unit with
/// that unit's name in the tensor names replaced (keeps files of models with
/// many identical layers small). Errors name the file, unit and tensor.

#include <string>
#include <string_view>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/planner/tensor_spec.hpp"

namespace dbuf::plan_io {

struct ModelFile {
  std::string path;
  std::string model;  ///< the model's name, or the file name when absent
  std::vector<planner::UnitSpec> units;
  std::size_t skipped_buffers = 0;  ///< tensors left out as non-trainable
};

[[nodiscard]] Result<ModelFile> parseModelJson(std::string_view text, const std::string& path);
[[nodiscard]] Result<ModelFile> loadModelFile(const std::string& path);

}  // namespace dbuf::plan_io
