// Manifest: the parallel layout it records (#36 step 3) reads back as written;
// a manifest without it (written before) still reads; a malformed one is
// refused naming the file and the key.
#include "ckpt/store/manifest.h"

#include <gtest/gtest.h>

#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;

Manifest TwoStageManifest() {
  Manifest m;
  m.step = 4, m.consumed_samples = 32, m.grid = RankGrid{2, 2, 1, false}, m.world_size = 4;
  for (const char* f : {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_00.pt",
                        "model/dp_rank_00_tp_rank_00_pp_rank_01.pt", "model/dp_rank_00_tp_rank_01_pp_rank_01.pt"})
    m.files[f] = {10, 0xabcdef01};
  return m;
}

TEST(Manifest, TheRecordedLayoutReadsBackAsWritten) {
  Manifest m = TwoStageManifest();
  m.layout = RecordedLayout{StageMapOf({0, 3, 4}), true, Container::kXser};
  const nlohmann::json j = nlohmann::json::parse(m.ToJson().dump());
  EXPECT_EQ(j.at("layout").dump(), R"({"container":"xser","master_weights":true,"stages":[[[0,3]],[[3,4]]]})");
  const Manifest back = Manifest::FromJson(j, "t/manifest.json");
  ASSERT_TRUE(back.layout.has_value());
  EXPECT_EQ(*back.layout, *m.layout);
  EXPECT_EQ(StageBoundsOf(back.layout->stages), std::vector<int64_t>({0, 3, 4}));
}

TEST(Manifest, AManifestWithoutALayoutStillReads) {
  nlohmann::json j = nlohmann::json::parse(TwoStageManifest().ToJson().dump());
  ASSERT_FALSE(j.contains("layout"));
  const Manifest m = Manifest::FromJson(j, "old/manifest.json");
  EXPECT_FALSE(m.layout.has_value());
  EXPECT_EQ(m.grid.tp, 2);
}

TEST(Manifest, VirtualStagesAreRecordedButHaveNoStageBounds) {
  // pp rank p holds stages p and p + pp, as NxD's virtual_pipeline_size lays them out.
  Manifest m = TwoStageManifest();
  m.layout = RecordedLayout{{{{0, 1}, {2, 3}}, {{1, 2}, {3, 4}}}, false, Container::kPlainPt};
  const Manifest back = Manifest::FromJson(nlohmann::json::parse(m.ToJson().dump()), "v/manifest.json");
  EXPECT_EQ(back.layout->stages, m.layout->stages);
  EXPECT_FALSE(StageBoundsOf(back.layout->stages).has_value());
}

TEST(Manifest, AVirtualStageMapIsASplitOverPpTimesVStages) {
  // pp rank p holds stages p and p + pp (NxD's virtual_pipeline_size 2): bounds over the 4 stages.
  const StageMap virtual_map = {{{0, 1}, {2, 3}}, {{1, 2}, {3, 5}}};
  const std::optional<StageSplit> s = StageSplitOf(virtual_map);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->bounds, (std::vector<int64_t>{0, 1, 2, 3, 5}));
  EXPECT_EQ(s->virtual_stages, 2);
  EXPECT_EQ(StageMapOf(s->bounds, 2), virtual_map);
  EXPECT_EQ(StageSplitOf(StageMapOf({0, 3, 4})), (StageSplit{{0, 3, 4}, 1}));
  // Not a pipeline split: unequal range counts, a gap, or stages out of NxD's order.
  EXPECT_FALSE(StageSplitOf({{{0, 1}, {2, 3}}, {{1, 2}}}).has_value());
  EXPECT_FALSE(StageSplitOf({{{0, 1}, {3, 4}}, {{1, 2}, {4, 5}}}).has_value());
  EXPECT_FALSE(StageSplitOf({{{0, 1}, {1, 2}}, {{2, 3}, {3, 4}}}).has_value());
  EXPECT_FALSE(StageBoundsOf(virtual_map).has_value());
}

TEST(Manifest, AMalformedLayoutIsRefusedNamingTheFileAndKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"stages":[[[0,3]]],"master_weights":false,"container":"pt"})", "'stages' is not a list of 2 pp ranks"},
      {R"({"stages":[[[0,3]],[]],"master_weights":false,"container":"pt"})", "pp rank 1 is not a non-empty list"},
      {R"({"stages":[[[0,3]],[[3,3]]],"master_weights":false,"container":"pt"})", "layer range [3,3] is empty or repeated"},
      {R"({"stages":[[[0,3]],[[0,4]]],"master_weights":false,"container":"pt"})", "layer range [0,4] is empty or repeated"},
      {R"({"stages":[[[0,3]],[[3,4,5]]],"master_weights":false,"container":"pt"})", "is not a [first, end) layer range"},
      {R"({"stages":[[[0,3]],[[3,4]]],"master_weights":1,"container":"pt"})", "'master_weights' is 1"},
      {R"({"stages":[[[0,3]],[[3,4]]],"master_weights":false,"container":"zip"})", "'container' is \"zip\""},
      {R"({"stages":[[[0,3]],[[3,4]]],"container":"pt"})", "master_weights"},
  };
  for (const auto& [layout, why] : cases) {
    nlohmann::json j = nlohmann::json::parse(TwoStageManifest().ToJson().dump());
    j["layout"] = nlohmann::json::parse(layout);
    const std::string e = ErrorOf([&] { Manifest::FromJson(j, "bad/manifest.json"); });
    EXPECT_NE(e.find("bad/manifest.json"), std::string::npos) << e;
    EXPECT_NE(e.find(why), std::string::npos) << layout << ": " << e;
  }
}

TEST(Manifest, TheContainerFollowsFromTheFiles) {
  EXPECT_EQ(ContainerOfFiles(TwoStageManifest().files), Container::kPlainPt);
  std::map<std::string, FileDigest> xser = TwoStageManifest().files;
  xser["model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt"] = {4, 1};
  EXPECT_EQ(ContainerOfFiles(xser), Container::kXser);
  EXPECT_STREQ(ContainerName(Container::kXser), "xser");
}

}  // namespace
}  // namespace ckpt
