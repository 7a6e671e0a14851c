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
