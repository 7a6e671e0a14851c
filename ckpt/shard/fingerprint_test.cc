#include "ckpt/shard/fingerprint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(g());
  return v;
}

TEST(FingerprintCollector, PiecesInAnyOrderGiveTheCrcOfTheWhole) {
  const auto data = Bytes(10000, 1);
  // Cut points, then the pieces in a shuffled order, as threads and ranks deliver them.
  std::vector<size_t> cuts{0, 1, 7, 64, 999, 1000, 4096, 9999, 10000};
  std::vector<size_t> order(cuts.size() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(2));
  FingerprintCollector c;
  for (size_t i : order)
    c.Add("w", StateField::kExpAvg, cuts[i], {data.data() + cuts[i], cuts[i + 1] - cuts[i]});
  const auto fp = c.Finish({{"w", StateField::kExpAvg, DType::kFloat32, 2500}});
  EXPECT_EQ(fp.at("w").at("exp_avg").crc32, Crc32(data));
  EXPECT_EQ(fp.at("w").at("exp_avg").numel, 2500u);
  EXPECT_EQ(fp.at("w").at("exp_avg").dtype, "float32");
}

TEST(FingerprintCollector, RankRecordsJoinLikeOneCollector) {
  const auto data = Bytes(4096, 3);
  FingerprintCollector r0, r1, all;
  for (size_t at = 0; at < data.size(); at += 512)  // interleaved rows of two ranks (a column split)
    (at / 512 % 2 ? r1 : r0).Add("w", StateField::kParam, at, {data.data() + at, 512});
  all.MergeJson(r0.ToJson(), "rank 0");
  all.MergeJson(nlohmann::json::parse(r1.ToJson().dump()), "rank 1");
  EXPECT_EQ(all.Finish({{"w", StateField::kParam, DType::kBFloat16, 2048}}).at("w").at("param").crc32, Crc32(data));
}

TEST(FingerprintCollector, AGapAnOverlapOrAStrayPieceIsAnError) {
  const auto data = Bytes(100, 4);
  const std::vector<LogicalTensor> w{{"w", StateField::kParam, DType::kUInt8, 100}};
  FingerprintCollector gap;
  gap.Add("w", StateField::kParam, 0, {data.data(), 40});
  gap.Add("w", StateField::kParam, 50, {data.data() + 50, 50});
  EXPECT_THROW(gap.Finish(w), Error);
  FingerprintCollector twice;
  twice.Add("w", StateField::kParam, 0, {data.data(), 100});
  twice.Add("w", StateField::kParam, 10, {data.data() + 10, 10});
  try {
    twice.Finish(w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w param: bytes 10..20 were written twice"), std::string::npos) << e.what();
  }
  FingerprintCollector stray;
  stray.Add("w", StateField::kParam, 0, {data.data(), 100});
  stray.Add("v", StateField::kParam, 0, {data.data(), 4});
  EXPECT_THROW(stray.Finish(w), Error);
  FingerprintCollector none;
  EXPECT_THROW(none.Finish(w), Error);
  EXPECT_EQ(none.Finish({{"e", StateField::kParam, DType::kFloat32, 0}}).at("e").at("param").crc32, 0u);
}

TEST(FingerprintCollector, MalformedRecordsAreRefused) {
  FingerprintCollector c;
  for (const char* bad : {R"([])", R"({"w": []})", R"({"w": {"param": {}}})", R"({"w": {"param": [[5, 5, "00000000"]]}})",
                          R"({"w": {"param": [[0, 5, "zz"]]}})", R"({"w": {"param": [[0, -1, "00000000"]]}})"})
    EXPECT_THROW(c.MergeJson(nlohmann::json::parse(bad), "rec"), Error) << bad;
}

}  // namespace
}  // namespace ckpt
