// Model files: the compact `"like"` units, and that the bundled copies hold
// exactly the tensors of the shared originals.
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "dbuf/plan_io/model_file.hpp"

namespace dbuf::plan_io {
namespace {

TEST(ModelFile, LikeRepeatsAnEarlierUnitWithItsNameSubstituted) {
  const auto file = parseModelJson(R"({"fsdp_units": [
      {"name": "layers.0", "tensors": [{"name": "m.layers.0.w", "shape": [4, 2], "dtype": "bf16"},
                                       {"name": "m.layers.0.bias", "shape": [4], "dtype": "fp32", "trainable": false},
                                       {"name": "m.layers.0.n", "shape": [2], "dtype": "bf16"}]},
      {"name": "layers.1", "like": "layers.0"}]})",
                                   "like.json");
  ASSERT_TRUE(file.ok()) << file.error().message;
  ASSERT_EQ(file->units.size(), 2U);
  const planner::UnitSpec& copy = file->units[1];
  EXPECT_EQ(copy.name, "layers.1");
  ASSERT_EQ(copy.tensors.size(), 2U);
  EXPECT_EQ(copy.tensors[0].name, "m.layers.1.w");
  EXPECT_EQ(copy.tensors[0].shape, (std::vector<std::int64_t>{4, 2}));
  EXPECT_EQ(copy.tensors[1].name, "m.layers.1.n");
  EXPECT_EQ(file->skipped_buffers, 2U);  // the buffer is left out of both units
}

TEST(ModelFile, LikeErrorsNameTheUnit) {
  for (const char* units : {R"([{"name": "a", "like": "b"}])",
                            R"([{"name": "a", "tensors": [{"name": "w", "shape": [2]}]},
                                {"name": "b", "like": "a", "tensors": []}])",
                            R"([{"name": "a", "tensors": [{"name": "w", "shape": [2]}]}, {"like": "a"}])"}) {
    const auto file = parseModelJson(std::string(R"({"fsdp_units": )") + units + "}", "bad.json");
    ASSERT_FALSE(file.ok()) << units;
    EXPECT_NE(file.error().message.find("bad.json: unit #"), std::string::npos) << file.error().message;
  }
}

// The bundled models/ are compact copies of ../shared/models (checked where
// that folder is present, as it is beside every checkout and CI run).
TEST(ModelFile, BundledCopiesMatchTheSharedOriginals) {
  const std::filesystem::path shared = std::filesystem::path(DBUF_MODELS_DIR) / "../../shared/models";
  if (!std::filesystem::exists(shared)) GTEST_SKIP() << "no " << shared.string();
  for (const auto& entry : std::filesystem::directory_iterator(DBUF_MODELS_DIR)) {
    if (entry.path().extension() != ".json") continue;
    const auto original_path = shared / entry.path().filename();
    if (!std::filesystem::exists(original_path)) continue;
    const auto bundled = loadModelFile(entry.path().string());
    const auto original = loadModelFile(original_path.string());
    ASSERT_TRUE(bundled.ok()) << bundled.error().message;
    ASSERT_TRUE(original.ok()) << original.error().message;
    ASSERT_EQ(bundled->units.size(), original->units.size()) << entry.path();
    EXPECT_EQ(bundled->skipped_buffers, original->skipped_buffers) << entry.path();
    for (std::size_t u = 0; u < bundled->units.size(); ++u) {
      const auto& mine = bundled->units[u];
      const auto& theirs = original->units[u];
      ASSERT_EQ(mine.name, theirs.name);
      ASSERT_EQ(mine.tensors.size(), theirs.tensors.size()) << mine.name;
      for (std::size_t t = 0; t < mine.tensors.size(); ++t) {
        EXPECT_EQ(mine.tensors[t].name, theirs.tensors[t].name);
        EXPECT_EQ(mine.tensors[t].shape, theirs.tensors[t].shape) << theirs.tensors[t].name;
        EXPECT_EQ(mine.tensors[t].dtype, theirs.tensors[t].dtype) << theirs.tensors[t].name;
      }
    }
  }
}

}  // namespace
}  // namespace dbuf::plan_io
