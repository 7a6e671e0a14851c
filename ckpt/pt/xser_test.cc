#include "ckpt/pt/xser.h"

#include <gtest/gtest.h>

#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

Value Ref(int64_t tid) { return MakeTensorReference(tid); }

TEST(Xser, ReferencesResolveToTensorFiles) {
  testing::TempDir dir("xser");
  const std::string path = dir / "dp_rank_00_tp_rank_00_pp_rank_00.pt";
  Value root = Value::NewDict();
  root.as_dict().Set("w", Ref(0));
  root.as_dict().Set("nested", Value::List({Ref(1)}));
  SavePt(path, root);
  EXPECT_FALSE(IsXser(path));
  Env::Default()->CreateDirs(XserTensorDir(path));
  SavePt(XserTensorDir(path) + "/tensor_0.pt", Value(testing::Arange({2, 2})));
  EXPECT_TRUE(IsXser(path));
  try {
    LoadXser(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor_1.pt: missing xser tensor file for tid 1"), std::string::npos) << e.what();
  }
  SavePt(XserTensorDir(path) + "/tensor_1.pt", Value(testing::Arange({3})));
  Value v = LoadXser(path);
  EXPECT_TRUE(DeepEqual(v.as_dict().At("w"), Value(testing::Arange({2, 2}))));
  EXPECT_TRUE(DeepEqual(v.as_dict().At("nested").as_seq().items[0], Value(testing::Arange({3}))));
}

// NxD _extract_tensor_info_and_update_state_dict: info.pt's expert_model_parallel is the tensor's mark.
TEST(Xser, ExpertKeysAreMarkedInInfoAndParts) {
  Value root = Value::NewDict();
  root.as_dict().Set("router", Value(testing::Arange({2})));
  root.as_dict().Set("experts", Value(testing::Arange({2, 3})));
  const auto parts = SplitForXser("m.pt", root, [](const std::string& k) { return k == "experts"; });
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_FALSE(parts[0].expert);
  EXPECT_TRUE(parts[1].expert);
  const Dict& info = parts[3].value.as_dict();
  EXPECT_EQ(info.items.at(0).second.as_dict().At("expert_model_parallel").as_bool(), false);
  EXPECT_EQ(info.items.at(1).second.as_dict().At("expert_model_parallel").as_bool(), true);
  for (const auto& p : SplitForXser("m.pt", root)) EXPECT_FALSE(p.expert);
}

// NxD _xser_save_data writes an ep rank > 0's expert tensors alone; _xser_load_data reads its
// other tids from ep_rank_00's folder.
TEST(Xser, EpRankAboveZeroReadsSharedTensorsFromEpRankZero) {
  testing::TempDir dir("xser_ep");
  auto write = [&](int ep, int64_t expert_base) {
    Value root = Value::NewDict();
    root.as_dict().Set("router", Value(testing::Arange({2})));
    Tensor experts = testing::Arange({2, 3});
    for (int64_t i = 0; i < 6; ++i) reinterpret_cast<float*>(experts.mutable_data())[i] += static_cast<float>(expert_base);
    root.as_dict().Set("experts", Value(experts));
    const std::string path = dir / ("dp_rank_00_ep_rank_0" + std::to_string(ep) + "_tp_rank_00_pp_rank_00.pt");
    Env::Default()->CreateDirs(XserTensorDir(path));
    for (const auto& part : SplitForXser(path, root, [](const std::string& k) { return k == "experts"; }))
      if (ep == 0 || part.expert || !part.path.starts_with(XserTensorDir(path))) SavePt(part.path, part.value);
    return path;
  };
  const std::string ep0 = write(0, 0), ep1 = write(1, 100);
  EXPECT_EQ(XserSharedTensorDir(ep1), XserTensorDir(ep0));
  EXPECT_EQ(XserSharedTensorDir(ep0), "");
  EXPECT_FALSE(Env::Default()->Exists(XserTensorDir(ep1) + "/tensor_0.pt"));
  const Value v = LoadXser(ep1);
  EXPECT_TRUE(DeepEqual(v.as_dict().At("router"), Value(testing::Arange({2}))));
  EXPECT_EQ(reinterpret_cast<const float*>(v.as_dict().At("experts").as_tensor().data())[5], 105.0f);
  Env::Default()->RemoveFile(XserTensorDir(ep0) + "/tensor_0.pt");
  EXPECT_NE(testing::ErrorOf([&] { LoadXser(ep1); }).find(XserTensorDir(ep0) + "/tensor_0.pt: missing"), std::string::npos);
}

// NxD's _assign_tensors_to_bins: smallest first (ties in tid order), each to the first
// emptiest bin. Sizes 30, 10, 20, 10 over 2 bins: tid 1 -> 0, tid 3 -> 1, tid 2 -> 0 (10 vs 10:
// the first), tid 0 -> 1 (30 vs 10). (tests/interop/upstream_tags.py checks the rule against NxD's run.)
TEST(Xser, BinsDealTensorsAsNxdDoes) {
  EXPECT_EQ(XserBins({30, 10, 20, 10}, 2), (std::vector<int>{1, 0, 0, 1}));
  EXPECT_EQ(XserBins({5, 5, 5}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(XserBins({}, 3), std::vector<int>{});
}

}  // namespace
}  // namespace ckpt
