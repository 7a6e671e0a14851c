#include "ckpt/pt/value_json.h"

#include <gtest/gtest.h>

#include <chrono>

#include "ckpt/testing/test_util.h"

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

TEST(ValueJson, ParseJsonBoundedRefusesDeepNestingAndKeepsTheRest) {
  const std::string deep = std::string(20000, '[') + std::string(20000, ']');
  const std::string e = testing::ErrorOf([&] { ParseJsonBounded(deep, "attr"); });
  EXPECT_NE(e.find("attr: JSON nested deeper than 1000"), std::string::npos) << e;
  const std::string ok = std::string(900, '[') + std::string(900, ']');
  EXPECT_TRUE(ParseJsonBounded(ok, "attr").is_array());
  EXPECT_TRUE(ParseJsonBounded("{not json", "attr").is_discarded());
  try {
    nlohmann::json::parse("[1]").at("tp");
  } catch (const nlohmann::json::exception& err) {
    EXPECT_EQ(JsonErrorText(err), "is array where an object with named fields is expected");
  }
}

TEST(ValueJson, ParseJsonBoundedTakesLinearTimeOverManyObjects) {
  // A safetensors header of 100,000 entries: nlohmann's callback parser scanned
  // the enclosing object after each entry, 256 s in all. Strings hiding
  // brackets and escaped quotes do not count as nesting.
  const auto header = [](int n) {
    std::string text = "{";
    for (int i = 0; i < n; ++i)
      text += (i ? ",\"t" : "\"t") + std::to_string(i) + "\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}";
    return text + ", \"s\": \"" + std::string(2000, '[') + "\\\"" + std::string(2000, '{') + "\"}";
  };
  const nlohmann::json j = ParseJsonBounded(header(100000), "h");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.size(), 100001u);
  EXPECT_EQ(j["t99999"]["data_offsets"][1], 4);
  EXPECT_EQ(j["s"].get<std::string>().size(), 4001u);
  // Four times the entries take about four times as long (the quadratic parse: sixteen).
  // Under 11: linear work measured 4 to 8.4 beside five builds (the caches are shared); quadratic is 16.
  std::vector<std::string> texts;
  for (int n : {5000, 20000}) texts.push_back(header(n));
  EXPECT_LT(testing::GrowthRatio([&](int n) { ParseJsonBounded(texts[n == 5000 ? 0 : 1], "h"); }, 5000), 11.0);
  // Exactly at the bound, and one past it.
  EXPECT_TRUE(ParseJsonBounded(std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']'), "h").is_array());
  EXPECT_NE(testing::ErrorOf([] { ParseJsonBounded(std::string(kMaxJsonDepth + 1, '{'), "h"); }).find("h: JSON nested deeper"),
            std::string::npos);
}

}  // namespace ckpt
