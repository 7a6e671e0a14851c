// Zero1ShardProblem: a ZeRO-1 file's shards against its shape_info and dp; OptimizerFileView, the one parser.
#include "ckpt/spec/optimizer_state.h"

#include <gtest/gtest.h>

#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

// A ZeRO-1 file (NeuronZero1Optimizer.state_dict as NxD saves it) of one
// parameter of `rows` x 3 whose moments hold `shard_rows` rows each.
Value Zero1File(int64_t rows, int64_t shard_rows, bool master = false) {
  Value entry = Value::NewDict();
  entry.as_dict().Set("step", Value(Tensor::Zeros(DType::kFloat32, {})));
  entry.as_dict().Set("exp_avg", Value(Tensor::Zeros(DType::kFloat32, {shard_rows, 3})));
  entry.as_dict().Set("exp_avg_sq", Value(Tensor::Zeros(DType::kFloat32, {shard_rows, 3})));
  Value base = Value::NewDict(), shapes = Value::NewDict();
  base.as_dict().items.emplace_back(Value(int64_t{0}), entry);
  shapes.as_dict().items.emplace_back(Value(int64_t{0}), Value::List({Value(rows), Value(int64_t{3})}));
  Value f = Value::NewDict();
  f.as_dict().Set("state", Value::NewDict());
  f.as_dict().Set("base_state", base);
  f.as_dict().Set("shape_info", shapes);
  if (master) {
    Value m = Value::NewDict();
    m.as_dict().items.emplace_back(Value(int64_t{0}), Value(Tensor::Zeros(DType::kFloat32, {rows, 3})));
    f.as_dict().Set("sharded_master_weights", m);
  }
  return f;
}

TEST(Zero1ShardProblem, AShardOfDpsRowsCoversItsParameter) {
  EXPECT_EQ(Zero1ShardProblem(Zero1File(10, 5), 2, "f"), "");
  EXPECT_EQ(Zero1ShardProblem(Zero1File(10, 4), 3, "f"), "");  // 10 padded to 12, chunks of 4
  EXPECT_EQ(Zero1ShardProblem(Zero1File(10, 10), 1, "f"), "");
  Value plain = Value::NewDict();  // no base_state: not ZeRO-1, nothing to check
  EXPECT_EQ(Zero1ShardProblem(plain, 2, "f"), "");
}

TEST(Zero1ShardProblem, RowsOfOneOverDpTimesCpNameTheContextParallelLoss) {
  // dp 2, cp 2: NxD shards over 4 ranks, files are named by dp rank: 3 of 10 rows (10 padded to 12).
  const std::string why = Zero1ShardProblem(Zero1File(10, 3), 2, "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt",
                                            [](int64_t id) { return "parameter id " + std::to_string(id) + " (w)"; });
  EXPECT_EQ(why.substr(0, why.find(". NxD")),
            "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt: parameter id 0 (w) exp_avg holds 3 of its 10 rows (shape_info [10, 3]), "
            "where a dp=2 ZeRO-1 shard holds 5: the rows are 1/(dp × cp) = 1/(2 × 2), a context-parallel save (cp=2)");
  EXPECT_NE(why.find("the 2 cp ranks of each dp rank wrote the same file and 1 of every 2 shards were lost"), std::string::npos) << why;
  EXPECT_NE(why.find("--weights_only"), std::string::npos);
  // cp 4 at dp 1 (no one-shard rule here: the tag says dp 1 with a manifest, say).
  EXPECT_NE(Zero1ShardProblem(Zero1File(16, 4), 1, "f").find("1/(dp × cp) = 1/(1 × 4)"), std::string::npos);
}

TEST(Zero1ShardProblem, OtherShapesAreNamedAsNotCovering) {
  EXPECT_EQ(Zero1ShardProblem(Zero1File(10, 6), 2, "f"),
            "f: parameter id 0 exp_avg holds 6 of its 10 rows (shape_info [10, 3]), not the 5 of a dp=2 ZeRO-1 shard (rows padded "
            "to a multiple of 2, one chunk per dp rank): the shards do not cover the parameter");
  // Master weights are shards too.
  EXPECT_NE(Zero1ShardProblem(Zero1File(10, 5, true), 2, "f").find("parameter id 0 sharded_master_weights holds 10 of its 10 rows"),
            std::string::npos);
  Value f = Zero1File(10, 5);
  f.as_dict().Find("shape_info")->as_dict().items.clear();
  EXPECT_EQ(Zero1ShardProblem(f, 2, "f"), "f: parameter id 0 has no shape_info (a list of dims), so its shards cannot be checked");
  Value g = Zero1File(10, 5);
  g.as_dict().Find("shape_info")->as_dict().items[0].second = Value::List({Value(int64_t{10}), Value(int64_t{4})});
  EXPECT_EQ(Zero1ShardProblem(g, 2, "f"), "f: parameter id 0 exp_avg has shape [5, 3], which is no dim-0 shard of its shape_info [10, 4]");
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

using testing::ErrorOf;

// The one parser: both forms' parts, and what each reader refuses, named.
TEST(OptimizerFileView, ViewsEitherFormsParts) {
  const Value z = Zero1File(10, 5, /*master=*/true);
  const OptimizerFileView zero1(z, "f");
  EXPECT_TRUE(zero1.zero1());
  EXPECT_STREQ(zero1.moments_key(), "base_state");
  EXPECT_EQ(zero1.Moments().items.size(), 1u);
  ASSERT_NE(zero1.ShapeInfo(), nullptr);
  ASSERT_NE(zero1.Masters(), nullptr);
  EXPECT_EQ(zero1.UnknownKey(), std::nullopt);
  EXPECT_EQ(ErrorOf([&] { zero1.CheckZero1StateEmpty(); }), "");

  Value p = Value::NewDict();
  p.as_dict().Set("state", Value::NewDict());
  p.as_dict().Set("param_groups", Value::List({}));
  const OptimizerFileView plain(p, "g");
  EXPECT_FALSE(plain.zero1());
  EXPECT_STREQ(plain.moments_key(), "state");
  EXPECT_EQ(plain.ShapeInfo(), nullptr);
  EXPECT_EQ(plain.Masters(), nullptr);
  EXPECT_TRUE(plain.param_groups().is_seq());
  EXPECT_TRUE(OptimizerFileView::KeyedById("shape_info"));
  EXPECT_FALSE(OptimizerFileView::KeyedById("param_groups"));
}

TEST(OptimizerFileView, WhatNeitherFormHoldsIsNamed) {
  EXPECT_EQ(ErrorOf([] { OptimizerFileView(Value::List({}), "f"); }), "f is a list, not a dict");
  Value z = Zero1File(10, 5);
  z.as_dict().Set("loss_scaler", Value(int64_t{1}));
  EXPECT_EQ(OptimizerFileView(z, "f").UnknownKey(), "loss_scaler");
  z.as_dict().Set("state", Value(int64_t{3}));
  EXPECT_EQ(ErrorOf([&] { OptimizerFileView(z, "f").CheckZero1StateEmpty(); }), "f: 'state' is a int, not a dict");
  Value entry = Value::NewDict();
  entry.as_dict().Set("momentum_buffer", Value(int64_t{0}));
  EXPECT_EQ(ErrorOf([&] { OptimizerFileView::AdamWEntry(entry, "f: parameter id 0 (w)"); }),
            "f: parameter id 0 (w) holds 'momentum_buffer', not AdamW's step, exp_avg and exp_avg_sq");
  z.as_dict().Set("shape_info", Value::List({}));
  EXPECT_EQ(ErrorOf([&] { OptimizerFileView(z, "f").ShapeInfo(); }), "f: 'shape_info' is a list, not a dict");
}

}  // namespace
}  // namespace ckpt
