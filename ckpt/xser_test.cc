#include "ckpt/xser.h"

#include <gtest/gtest.h>

#include "ckpt/error.h"
#include "ckpt/test_util.h"

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

}  // namespace
}  // namespace ckpt
