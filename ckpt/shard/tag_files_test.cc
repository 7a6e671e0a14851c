// TagFiles: which rank files a tag holds, what is missing, and the degrees their names give.
#include "ckpt/shard/tag_files.h"

#include <gtest/gtest.h>

#include "ckpt/shard/sharded_tag.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;

Value ModelFile() {
  Value v = Value::NewDict();
  v.as_dict().Set("x", Value(Tensor::Zeros(DType::kFloat32, {2})));
  return v;
}

Value OptimFile(bool zero1) {
  Value v = Value::NewDict();
  v.as_dict().Set(zero1 ? "base_state" : "state", Value::NewDict());
  v.as_dict().Set("param_groups", Value::List({}));
  return v;
}

// Discover over a tag in memory holding `rels`; the layout it found, or the error.
std::string Discover(const std::vector<std::string>& rels, TagDescription* layout, bool weights_only = false, bool zero1 = false) {
  std::map<std::string, Value> files;
  for (const auto& r : rels) files[r] = r.starts_with("model/") ? ModelFile() : OptimFile(zero1);
  TagFiles tf(Env::Default(), "tag");
  tf.SetInMemory(std::move(files));
  std::optional<Manifest> manifest;
  bool skipped = false;
  TagReadOptions opts;
  opts.weights_only = weights_only;
  return ErrorOf([&] { tf.Discover(opts, manifest, *layout, &skipped); });
}

TEST(TagFiles, TheDegreesComeFromTheRankFileNames) {
  TagDescription L;
  EXPECT_EQ(Discover({"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_00.pt",
                      "model/dp_rank_00_tp_rank_00_pp_rank_01.pt", "model/dp_rank_00_tp_rank_01_pp_rank_01.pt"},
                     &L),
            "");
  EXPECT_EQ(std::tuple(L.grid.tp, L.grid.pp, L.grid.dp, L.has_optimizer), std::tuple(2, 2, 1, false));
}

TEST(TagFiles, AMissingRankFileIsNamed) {
  TagDescription L;
  EXPECT_EQ(Discover({"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_01.pt"}, &L),
            "tag (as model/dp_rank_00_tp_rank_01_pp_rank_00.pt): missing; the tag holds other ranks' model files (tp 2, pp 2)");
  EXPECT_EQ(Discover({}, &L), "tag (as model): holds no rank files (dp_rank_00_tp_rank_XX_pp_rank_XX.pt)");
  EXPECT_EQ(Discover({"model/dp_rank_01_tp_rank_00_pp_rank_00.pt"}, &L), "tag (as model/dp_rank_01_tp_rank_00_pp_rank_00.pt): model files come from dp rank 0 only");
}

// NxDT's save of an expert-parallel ZeRO-1 optimizer (ep_zero1_state.h): optim/ named by ep rank, ep
// rank 0's file holding ZeRO-1 state. Refused naming optim/ before the ep names are refused as MoE;
// --weights_only leaves the optimizer, and a plain (non-ZeRO-1) file is not this loss.
TEST(TagFiles, NxdtsLossyExpertParallelSaveIsRefusedFirst) {
  const std::vector<std::string> rels{"model/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt",
                                      "optim/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt"};
  TagDescription L;
  const std::string lost = Discover(rels, &L, false, true);
  EXPECT_TRUE(lost.starts_with("tag (as optim): NxDT saved an expert-parallel (ep=2) dp > 1 ZeRO-1 optimizer of an MoE model")) << lost;
  EXPECT_NE(lost.find("optim/ holds ep rank 0's files alone"), std::string::npos) << lost;
  // --weights_only reads the expert-parallel model files (issue #38 item 2); a plain optimizer file named by ep rank is refused.
  EXPECT_EQ(Discover(rels, &L, true, true), "");
  EXPECT_EQ(std::tuple(L.grid.tp, L.grid.ep, L.grid.dp, L.has_optimizer), std::tuple(1, 2, 2, false));
  const std::string other = Discover(rels, &L, false, false);
  EXPECT_EQ(other.find("NxDT saved"), std::string::npos) << other;
  EXPECT_TRUE(other.starts_with("tag (as optim)/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt: an expert-parallel rank file (_ep_rank_) of an MoE "
                                "(Mixtral) tag")) << other;
}

// NxD's expert-parallel model files (trainer/checkpoint.py _get_path(ep=True)): every ep rank's, each named by it.
TEST(TagFiles, ExpertParallelModelFilesGiveEp) {
  auto ep_file = [](int e, int t) { return "model/dp_rank_00_ep_rank_0" + std::to_string(e) + "_tp_rank_0" + std::to_string(t) + "_pp_rank_00.pt"; };
  TagDescription L;
  EXPECT_EQ(Discover({ep_file(0, 0), ep_file(0, 1), ep_file(1, 0), ep_file(1, 1)}, &L), "");
  EXPECT_EQ(std::tuple(L.grid.tp, L.grid.pp, L.grid.ep, L.grid.dp), std::tuple(2, 1, 2, 2));
  EXPECT_EQ(Discover({ep_file(0, 0), ep_file(0, 1), ep_file(1, 0)}, &L),
            "tag (as model/dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt): missing; the tag holds other ranks' model files (tp 2, pp 1, ep 2)");
  const std::string mixed = Discover({"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", ep_file(0, 1)}, &L);
  EXPECT_TRUE(mixed.starts_with("tag (as model/dp_rank_00_ep_rank_00_tp_rank_01_pp_rank_00.pt): an expert-parallel rank file (_ep_rank_) beside "
                                "model files without an ep rank")) << mixed;
  const std::string alone = Discover({ep_file(0, 0)}, &L);
  EXPECT_TRUE(alone.starts_with("tag (as model/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt): an expert-parallel rank file (_ep_rank_) of ep "
                                "rank 0 alone")) << alone;
}

TEST(TagFiles, OptimizerFilesGiveDpAndZero1) {
  const std::string model = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt";
  TagDescription L;
  // Plain files (state) come from dp rank 0 only; ZeRO-1 ones (base_state) from each.
  EXPECT_EQ(Discover({model, "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"}, &L), "");
  EXPECT_EQ(std::tuple(L.grid.dp, L.grid.zero1, L.has_optimizer), std::tuple(1, false, true));
  EXPECT_EQ(Discover({model, "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt"}, &L),
            "tag (as optim/dp_rank_01_tp_rank_00_pp_rank_00.pt): a plain optimizer state dict comes from dp rank 0 only");
  EXPECT_EQ(Discover({model, "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt"}, &L),
            "tag (as optim/dp_rank_00_tp_rank_00_pp_rank_00.pt): missing; the tag holds optimizer files for 2 dp rank(s) of tp 1, pp 1");
  EXPECT_EQ(Discover({model, "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt"}, &L, false, true), "");
  EXPECT_EQ(std::tuple(L.grid.dp, L.grid.zero1), std::tuple(2, true));
  TagDescription W;
  EXPECT_EQ(Discover({model, "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"}, &W, /*weights_only=*/true), "");
  EXPECT_FALSE(W.has_optimizer);
}

}  // namespace
}  // namespace ckpt
