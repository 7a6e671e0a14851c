#include "ckpt/value_json.h"

#include <gtest/gtest.h>

#include "ckpt/test_util.h"

namespace ckpt {

TEST(ValueJson, RoundTripKeepsStorageSharingAndExactFloats) {
  Tensor base = testing::Arange({6});
  Value root = Value::NewDict(true);
  root.as_dict().Set("a", Value(base));
  root.as_dict().Set("b", Value(base.Narrow0(2, 4)));
  root.as_dict().Set("nan", Value(std::nan("")));
  root.as_dict().Set("tiny", Value(5e-324));
  auto j = ValueToJson(root, {.tensor_bytes = true});
  EXPECT_EQ(j["items"][1][1]["storage"], 0);  // same storage as "a"
  EXPECT_EQ(j["items"][1][1]["offset"], 2);
  EXPECT_EQ(j["items"][3][1]["bits"], "0000000000000001");
  Value back = ValueFromJson(nlohmann::json::parse(j.dump()));
  EXPECT_TRUE(DeepEqual(back, root));
  EXPECT_EQ(back.as_dict().At("a").as_tensor().storage(), back.as_dict().At("b").as_tensor().storage());
}

}  // namespace ckpt
