// NeuronEPZero1Optimizer's state dict against the files NxD wrote
// (tests/data/upstream/nxd_mixtral, README "Layout facts"): every optim file
// parses and writes back equal (keys, order, tensors, param_groups); each
// entry's parameter, ep rank and shard put the moments of every parameter
// back bit for bit against the gathered full state; NxDT's lossy save is told.
#include "ckpt/spec/ep_zero1_state.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/xser.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/testing/test_util.h"
#include "ckpt/util/env.h"

namespace ckpt {
namespace {

using testing::ErrorOf;

const std::string kData = std::string(SHARDKIT_TEST_DATA) + "/upstream/nxd_mixtral/";
constexpr int kTp = 2, kDp = 2;

// The fixture's model (README "Model"), in either style.
ModelFormat FixtureFormat(ModelFamily family) {
  ModelFormat f;
  f.family = family;
  f.hidden = 16, f.ffn = 32, f.heads = 4, f.kv_heads = 2, f.layers = 2, f.vocab_size = 64;
  f.fuse_qkv = false;
  f.experts = 4, f.moe_top_k = 2, f.moe_frequency = 1;
  return f;
}

std::string TagOf(const std::string& name) { return kData + name + "/step_2"; }

Value OptimFile(const std::string& tag, int d, int t) {
  return LoadTagFile(Env::Default(), tag, RankFilePath(RankFileKind::kOptim, {d, t, 0}));
}

// The parameters of a model file in named_parameters order (its keys less NxD's buffers).
std::vector<std::string> ParameterNames(const std::string& tag, int ep) {
  RankCoord c{0, 0, 0};
  if (ep > 1) c.ep = 0;
  const Value m = LoadTagFile(Env::Default(), tag, RankFilePath(RankFileKind::kModel, c));
  std::vector<std::string> names;
  for (const auto& [k, _] : m.as_dict().items)
    if (k.as_str().find("spmd_rank") == std::string::npos && k.as_str().find("inv_freq") == std::string::npos) names.push_back(k.as_str());
  return names;
}

bool IsExpertName(const ModelFormat& f, const std::string& name) {
  const int layer = static_cast<int>(LayerOfName(name));
  return layer >= 0 && (name == ParamName(f, Module::kExpertsIn, layer) || name == ParamName(f, Module::kExpertsOut, layer));
}

EpGroupings FixtureGroupings(const ModelFormat& f, const std::string& tag) {
  const Grouping all = FamilyGrouping(f, ParameterNames(tag, 2), GroupingRule::kNxdt);
  return SplitGroupingByExperts(all, [&](const std::string& n) { return IsExpertName(f, n); });
}

struct Style {
  const char* name;
  ModelFamily family;
};
constexpr Style kStyles[] = {{"hf", ModelFamily::kHfLlama}, {"megatron", ModelFamily::kMegatron}};

// Every optim file of the ep 2 tags, both styles and containers: parsed and written back, equal
// to what NxD wrote (DeepEqual: keys and their order, every tensor's bytes, param_groups).
TEST(EpZero1File, EveryFileNxdWroteRoundTrips) {
  int files = 0;
  for (const Style& s : kStyles)
    for (const char* container : {"pt", "xser"})
      for (int d = 0; d < kDp; ++d)
        for (int t = 0; t < kTp; ++t) {
          const std::string tag = TagOf(std::string(s.name) + "_ep2_" + container);
          const Value v = OptimFile(tag, d, t);
          ASSERT_TRUE(IsEpZero1File(v)) << tag;
          const EpZero1File f = ParseEpZero1File(v, tag);
          EXPECT_TRUE(DeepEqual(f.ToValue(), v)) << tag << " dp " << d << " tp " << t;
          ++files;
        }
  EXPECT_EQ(files, 16);
  EXPECT_FALSE(IsEpZero1File(OptimFile(TagOf("hf_ep1_pt"), 0, 0)));  // NeuronZero1Optimizer's
}

// README: HF ep 2, indices 0-16 non-expert in groups [0..16] / [], 17-20 the experts whole
// (expert-dp 1) with ids from 0 in [0, 1, 2, 3] / []; file dp_rank_DD holds ep rank DD's experts.
TEST(EpZero1File, SplitsIntoTheTwoInnerOptimizers) {
  const Value v = OptimFile(TagOf("hf_ep2_pt"), 1, 0);
  const EpZero1File f = ParseEpZero1File(v, "f");
  ASSERT_EQ(f.non_expert.params.size(), 17u);
  ASSERT_EQ(f.expert.params.size(), 4u);
  EXPECT_EQ(f.non_expert.params[0].shape, (std::vector<int64_t>{32, 16}));     // embed_tokens, local
  EXPECT_EQ(f.non_expert.params[0].exp_avg.as_tensor().shape(), (std::vector<int64_t>{16, 16}));  // its dp shard
  EXPECT_EQ(f.expert.params[0].shape, (std::vector<int64_t>{2, 16, 32}));      // layer 0 gate_up: 2 experts, tp half
  EXPECT_EQ(f.expert.params[0].exp_avg.as_tensor().shape(), (std::vector<int64_t>{2, 16, 32}));
  EXPECT_EQ(f.expert.params[1].shape, (std::vector<int64_t>{2, 16, 16}));      // layer 0 down
  EXPECT_EQ(f.expert.param_groups.as_seq().items.size(), 2u);
  EXPECT_EQ(ParamGroupSizes(f.non_expert.param_groups, "g"), (std::vector<size_t>{17, 0}));
  EXPECT_EQ(ParamGroupSizes(f.expert.param_groups, "g"), (std::vector<size_t>{4, 0}));
  // Megatron style: one group each (NeMo's one group, filtered).
  const EpZero1File m = ParseEpZero1File(OptimFile(TagOf("megatron_ep2_pt"), 0, 0), "m");
  EXPECT_EQ(ParamGroupSizes(m.non_expert.param_groups, "g"), (std::vector<size_t>{15}));
  EXPECT_EQ(ParamGroupSizes(m.expert.param_groups, "g"), (std::vector<size_t>{4}));
}

// NxD's own files fit each part's sharding (non-expert over dp 2, experts over expert-dp 1); the
// same file read as from a job whose expert-dp were 2 (dp 4, ep 2) is told, naming the expert part.
TEST(EpZero1ShardProblem, ChecksEachPartOverItsOwnGroup) {
  const Value v = OptimFile(TagOf("hf_ep2_pt"), 1, 0);
  EXPECT_EQ(EpZero1ShardProblem(v, 2, 2, "f"), "");
  const std::string why = EpZero1ShardProblem(v, 4, 2, "f");
  EXPECT_NE(why.find("f (non-expert optimizer)"), std::string::npos) << why;  // dp 4: the non-expert shards first
  EXPECT_NE(EpZero1ShardProblem(v, 2, 1, "f").find("f (expert optimizer"), std::string::npos);
}

// The entries follow NxDT's grouping of each style split by _is_ep_param, and each file's
// shape_info is the local shape of its parameter at its tp rank and ep rank.
TEST(EpZero1Entries, NameEachEntrysParameterEpRankAndShard) {
  const RankGrid grid{.tp = kTp, .pp = 1, .dp = kDp, .zero1 = true, .ep = 2};
  for (const Style& s : kStyles) {
    const ModelFormat f = FixtureFormat(s.family);
    const std::string tag = TagOf(std::string(s.name) + "_ep2_pt");
    const EpGroupings g = FixtureGroupings(f, tag);
    for (int d = 0; d < kDp; ++d) {
      const auto entries = EpZero1Entries(g, grid, d);
      const EpZero1File file = ParseEpZero1File(OptimFile(tag, d, 0), tag);
      ASSERT_EQ(entries.size(), file.non_expert.params.size() + file.expert.params.size()) << s.name;
      for (const EpZero1Entry& e : entries) {
        EXPECT_EQ(e.expert, IsExpertName(f, e.name)) << e.name;
        EXPECT_EQ(e.shard, e.expert ? (EpZero1Shard{d, 0, 1}) : (EpZero1Shard{0, d, kDp})) << e.name;
        const int64_t first_expert = static_cast<int64_t>(file.non_expert.params.size());
        EXPECT_EQ(e.expert, e.key >= first_expert) << e.name;
      }
    }
  }
  const ModelFormat hf = FixtureFormat(ModelFamily::kHfLlama);
  const auto entries = EpZero1Entries(FixtureGroupings(hf, TagOf("hf_ep2_pt")), grid, 1);
  EXPECT_EQ(entries[5].name, "model.layers.0.mlp.router.linear_router.weight");
  EXPECT_EQ(entries[16].name, "lm_head.weight");
  EXPECT_EQ(entries[17].name, "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight");
  EXPECT_EQ(entries[17].key, 17);
  EXPECT_EQ(entries[20].name, "model.layers.1.mlp.expert_mlps.mlp_op.down_proj.weight");
}

// dp 4, ep 2: dp rank 3 is ep rank 1, expert-dp rank 1 of 2.
TEST(EpZero1Entries, EpLiesInsideDp) {
  const RankGrid g{.tp = 1, .pp = 1, .dp = 4, .zero1 = true, .ep = 2};
  EXPECT_EQ(ExpertShardOf(g, 3), (EpZero1Shard{1, 1, 2}));
  EXPECT_EQ(NonExpertShardOf(g, 3), (EpZero1Shard{0, 3, 4}));
  EXPECT_NE(ErrorOf([] { ExpertShardOf(RankGrid{.dp = 3, .ep = 2}, 0); }).find("ep must divide dp"), std::string::npos);
}

// What NeuronEPZero1Optimizer.state_dict does not write is refused, naming the key.
TEST(EpZero1File, RefusesWhatStateDictDoesNotWrite) {
  const Value good = OptimFile(TagOf("hf_ep2_pt"), 0, 0);
  auto changed = [&](const std::function<void(Dict&)>& edit) {
    Value v = Value::NewDict();
    v.as_dict().items = good.as_dict().items;
    edit(v.as_dict());
    return ErrorOf([&] { ParseEpZero1File(v, "f"); });
  };
  EXPECT_EQ(changed([](Dict& d) { d.Set("sharded_master_weights", Value::NewDict()); }),
            "f: holds 'sharded_master_weights', which NxD's NeuronEPZero1Optimizer.state_dict does not write (it carries no master weights)");
  EXPECT_EQ(changed([](Dict& d) { d.Erase("ep_shape_info_offset"); }), "f: missing key 'ep_shape_info_offset' of NxD's NeuronEPZero1Optimizer state dict");
  EXPECT_NE(changed([](Dict& d) { d.Set("ep_base_state_offset", Value(int64_t{16})); }).find("'ep_base_state_offset' is 16, where"), std::string::npos);
  EXPECT_NE(changed([](Dict& d) { d.Set("ep_param_group_offset", Value(int64_t{4})); }).find("does not split its 4 param_groups"), std::string::npos);
  EXPECT_NE(changed([](Dict& d) {
              Value b = Value::NewDict();
              b.as_dict().items = d.At("base_state").as_dict().items;
              b.as_dict().items.pop_back();
              d.Set("base_state", b);
            }).find("the expert optimizer's id 3 (key 20) has no base_state entry"),
            std::string::npos);
}

// ckpt-verify's check of an ep tag's optim files: NxD's own pass; the expert
// shards are checked over expert-dp (dp / ep chunks: whole at ep 2, dp 2), not
// over dp, and a moment of other rows is told as the expert optimizer's.
TEST(EpZero1ShardProblem, ChecksExpertShardsOverExpertDp) {
  for (const Style& s : kStyles)
    for (int d = 0; d < kDp; ++d)
      for (int t = 0; t < kTp; ++t) EXPECT_EQ(EpZero1ShardProblem(OptimFile(TagOf(std::string(s.name) + "_ep2_pt"), d, t), kDp, 2, "f"), "") << s.name;
  const Value good = OptimFile(TagOf("hf_ep2_pt"), 0, 0);
  Value cut = Value::NewDict();
  cut.as_dict().items = good.as_dict().items;
  Value base = Value::NewDict();
  base.as_dict().items = cut.as_dict().At("base_state").as_dict().items;
  Value entry = Value::NewDict();
  entry.as_dict().items = base.as_dict().items.back().second.as_dict().items;  // key 20: layer 1's down_proj, (2, 16, 16)
  entry.as_dict().Set("exp_avg", Value(Tensor::Zeros(DType::kFloat64, {3, 16, 16})));  // not the expert-dp chunk
  base.as_dict().items.back().second = entry;
  cut.as_dict().Set("base_state", base);
  EXPECT_EQ(EpZero1ShardProblem(cut, kDp, 2, "f"),
            "f (expert optimizer, over expert-dp): parameter id 3 exp_avg holds 3 of its 2 rows (shape_info [2, 16, 16]), not the 2 of a dp=1 "
            "ZeRO-1 shard (rows padded to a multiple of 1, one chunk per dp rank): the shards do not cover the parameter");
  Value no_offset = Value::NewDict();
  no_offset.as_dict().items = good.as_dict().items;
  no_offset.as_dict().Erase("ep_param_id_offset");
  EXPECT_EQ(EpZero1ShardProblem(no_offset, kDp, 2, "f"), "f: missing key 'ep_param_id_offset' of NxD's NeuronEPZero1Optimizer state dict");
}

// An optim file of another form in an ep tag (the ep 1 tag's NeuronZero1Optimizer file, a plain
// ZeRO-1 one) is refused by name with the reader's message; a dict that is no optimizer state (an
// xser info.pt) is left to Zero1ShardProblem. NxD's dp 4 ep 2 files fit.
TEST(EpZero1ShardProblem, RefusesANonEpOptimizerFileByName) {
  EXPECT_EQ(EpZero1ShardProblem(OptimFile(TagOf("hf_ep1_pt"), 0, 0), kDp, 2, "optim/f.pt"), NotEpZero1Message("optim/f.pt", 2));
  EXPECT_EQ(NotEpZero1Message("optim/f.pt", 2),
            "optim/f.pt: is not NxD's NeuronEPZero1Optimizer state dict (ep_param_group_offset and its ZeRO-1 parts), which shardkit "
            "reads as the optimizer state of an expert-parallel (ep 2) tag");
  const Value info = LoadPt(TagOf("hf_ep2_xser") + "/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt");
  EXPECT_EQ(EpZero1ShardProblem(info, kDp, 2, "i"), "");
  for (int d = 0; d < 4; ++d) EXPECT_EQ(EpZero1ShardProblem(OptimFile(TagOf("hf_tp1_dp4_ep2_pt"), d, 0), 4, 2, "f"), "") << d;
}

// The one check the reshard engine and the trainer share: at ep > 1 an optimizer must be ZeRO-1
// (first) and hold no master weights; ep 1 and weights alone are never barred.
TEST(EpOptimizerBarOf, ZeroOneFirstThenMasterWeights) {
  EXPECT_EQ(EpOptimizerBarOf(2, true, false, true), EpOptimizerBar::kPlain);
  EXPECT_EQ(EpOptimizerBarOf(2, true, false, false), EpOptimizerBar::kPlain);
  EXPECT_EQ(EpOptimizerBarOf(2, true, true, true), EpOptimizerBar::kMasterWeights);
  EXPECT_EQ(EpOptimizerBarOf(4, true, true, false), EpOptimizerBar::kNone);
  EXPECT_EQ(EpOptimizerBarOf(2, false, false, true), EpOptimizerBar::kNone);  // --weights_only
  EXPECT_EQ(EpOptimizerBarOf(1, true, false, true), EpOptimizerBar::kNone);
}

// A rank's local tensor of `full` (row-major, element bytes), cut by the spec's boxes.
std::vector<uint8_t> LocalOf(const ShardSpec& spec, const AxisCoords& at, const Tensor& full) {
  const Tensor x = full.Contiguous();
  const size_t es = ElementSize(x.dtype());
  const auto local_shape = LocalShapeOf(spec, at);
  std::vector<uint8_t> out(static_cast<size_t>(ShapeNumel(local_shape)) * es);
  auto linear = [](const std::vector<int64_t>& shape, const std::vector<int64_t>& idx) {
    int64_t at = 0;
    for (size_t k = 0; k < shape.size(); ++k) at = at * shape[k] + idx[k];
    return at;
  };
  for (const Box& b : BoxesOf(spec, at)) {
    std::vector<int64_t> i(b.size.size(), 0);
    for (int64_t n = ShapeNumel(b.size); n > 0; --n) {
      std::vector<int64_t> g = i, l = i;
      for (size_t k = 0; k < i.size(); ++k) g[k] += b.offset[k], l[k] += b.local[k];
      std::memcpy(out.data() + linear(local_shape, l) * es, x.data() + linear(full.shape(), g) * es, es);
      for (size_t k = i.size(); k-- > 0;) {
        if (++i[k] < b.size[k]) break;
        i[k] = 0;
      }
    }
  }
  return out;
}

// Rows [shard * chunk, ...) of a local tensor equal the file's shard (its padding past the rows
// holds zeros); returns the rows it covered.
int64_t CheckShard(const std::vector<uint8_t>& local, const std::vector<int64_t>& local_shape, const Tensor& got, const EpZero1Shard& s,
                   const std::string& what) {
  const int64_t rows = local_shape[0], chunk = Zero1ShardRows(rows, s.shards);
  const int64_t first = std::min(rows, s.shard * chunk), end = std::min(rows, first + chunk);
  const size_t row_bytes = local.size() / static_cast<size_t>(std::max<int64_t>(rows, 1));
  const Tensor x = got.Contiguous();
  EXPECT_EQ(x.shape()[0], chunk) << what;
  EXPECT_EQ(std::memcmp(x.data(), local.data() + first * row_bytes, (end - first) * row_bytes), 0) << what;
  return end - first;
}

// Every moment of every parameter, from every file of HF tag `stem`_pt and `stem`_xser (NxD wrote
// them at `grid`), put in its place in the gathered full state `full_state` by EpZero1Entries:
// compared bit for bit, and the shards cover each local tensor. Returns the moments compared.
int CheckEveryMomentOf(const std::string& stem, const std::string& full_state, const RankGrid& grid) {
  const ModelFormat f = FixtureFormat(ModelFamily::kHfLlama);
  std::map<std::string, const ParamRule*> rules;
  const auto table = LogicalParameters(f, grid.tp);
  for (const ParamRule& r : table) rules[r.name] = &r;
  const Value full = LoadPt(kData + full_state);
  const Dict& moments = full.as_dict().At("optimizer").as_dict();
  int compared = 0;
  for (const char* container : {"pt", "xser"}) {
    const std::string tag = TagOf(stem + "_" + container);
    const Grouping all = FamilyGrouping(f, ParameterNames(tag, grid.ep), GroupingRule::kNxdt);
    const EpGroupings g = grid.ep > 1 ? FixtureGroupings(f, tag) : EpGroupings{all, {}};
    std::map<std::pair<std::string, int>, int64_t> covered;  // (parameter, ep rank) -> rows, per tp rank summed
    for (int d = 0; d < grid.dp; ++d)
      for (int t = 0; t < grid.tp; ++t) {
        const Value v = OptimFile(tag, d, t);
        const EpZero1File file = grid.ep > 1 ? ParseEpZero1File(v, tag) : EpZero1File{};
        const OptimizerFileView plain(v, tag);
        for (const EpZero1Entry& e : EpZero1Entries(g, grid, d)) {
          ParamState one;
          if (grid.ep > 1) {
            one = e.expert ? file.expert.params[e.key - static_cast<int64_t>(file.non_expert.params.size())] : file.non_expert.params[e.key];
          } else {
            const Dict& m = OptimizerFileView::AdamWEntry(*EntryById(plain.Moments(), e.key), tag);
            one.exp_avg = m.At("exp_avg"), one.exp_avg_sq = m.At("exp_avg_sq");
          }
          AxisCoords at = AxisCoords::Tp(grid.tp, t);
          at[Axis::kEp] = {grid.ep, e.shard.ep_rank};
          const ParamRule& rule = *rules.at(e.name);
          const auto local_shape = LocalShapeOf(rule.spec, at);
          const Dict& want = moments.At(e.name).as_dict();
          const std::string what = tag + " dp " + std::to_string(d) + " tp " + std::to_string(t) + " " + e.name;
          if (grid.ep > 1) {
            EXPECT_EQ(one.shape, local_shape) << what;
          }
          int64_t rows = 0;
          for (const auto& [field, got] : {std::pair{"exp_avg", &one.exp_avg}, std::pair{"exp_avg_sq", &one.exp_avg_sq}}) {
            rows = CheckShard(LocalOf(rule.spec, at, want.At(field).as_tensor()), local_shape, got->as_tensor(), e.shard, what + " " + field);
            ++compared;
          }
          covered[{e.name, e.shard.ep_rank}] += rows;
        }
      }
    for (const ParamRule& r : table) {  // each (ep rank's) local tensor covered once per tp rank
      const bool expert = r.split == SplitDim::kExperts;
      for (int e = 0; e < (expert ? grid.ep : 1); ++e) {
        AxisCoords at = AxisCoords::Tp(grid.tp, 0);
        at[Axis::kEp] = {grid.ep, e};
        EXPECT_EQ((covered[{r.name, e}]), grid.tp * LocalShapeOf(r.spec, at)[0]) << tag << " " << r.name << " ep rank " << e;
      }
    }
  }
  return compared;
}

// The ep 1 and ep 2 HF tags (tp 2 dp 2), plain and xser.
TEST(EpZero1Entries, PutEveryMomentBackBitForBit) {
  int compared = 0;
  for (int ep : {1, 2})
    compared += CheckEveryMomentOf("hf_ep" + std::to_string(ep), "hf_ep" + std::to_string(ep) + "_full_state.pt",
                                   RankGrid{.tp = kTp, .pp = 1, .dp = kDp, .zero1 = true, .ep = ep});
  EXPECT_EQ(compared, 2 * 2 * kDp * kTp * 21 * 2);  // ep 1 and 2, pt and xser, 4 files, 21 parameters, 2 moments
}

// tp 1 dp 4 ep 2 (README "dp 4 ep 2"), where dp rank d's file holds ep rank d % 2's experts as
// expert-dp chunk d / 2 of 2: the case dp = ep cannot tell from "ep rank d".
TEST(EpZero1Entries, PutEveryMomentBackBitForBitWhereDpIsNotEp) {
  const RankGrid grid{.tp = 1, .pp = 1, .dp = 4, .zero1 = true, .ep = 2};
  EXPECT_EQ(ExpertShardOf(grid, 1), (EpZero1Shard{1, 0, 2}));
  EXPECT_EQ(ExpertShardOf(grid, 2), (EpZero1Shard{0, 1, 2}));
  EXPECT_EQ(CheckEveryMomentOf("hf_tp1_dp4_ep2", "hf_tp1_dp4_ep2_full_state.pt", grid), 2 * 4 * 21 * 2);  // pt and xser, 4 files
}

// NxDT's route (nxdt_ep2_pt): optim/ named by ep rank, ep rank 0's file holding ZeRO-1 state.
TEST(EpZero1Lost, NxdtsEpNamedZero1SaveIsTold) {
  const std::string tag = kData + "nxdt_ep2_pt/hf_mixtral--step=2-consumed_samples=16.0.ckpt";
  const std::vector<std::string> names = Env::Default()->ListDir(tag + "/optim");
  const auto ep0 = EpNamedOptimFile(names);
  ASSERT_TRUE(ep0);
  EXPECT_EQ(*ep0, "dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt");
  const Value v = LoadTagFile(Env::Default(), tag, "optim/" + *ep0);
  const std::string plain = EpZero1LostMessage("T/optim", v, 2, false);
  EXPECT_EQ(plain.substr(0, plain.find(". Lost")),
            "T/optim: NxDT saved an expert-parallel (ep=2) dp=2 ZeRO-1 optimizer of an MoE model (NxD's NeuronEPZero1Optimizer) as a "
            "non-ZeRO-1 one, so only dp rank 0 of each dp group wrote it: optim/ holds ep rank 0's files alone (NxD's loader fails on the others)");
  for (const char* part : {"Lost: the moments of the experts of ep rank 1 and of every non-expert shard but dp rank 0's",
                           "zero1_optimizer from cfg.wrap_with_zero", "--weights_only"})
    EXPECT_NE(plain.find(part), std::string::npos) << part;
  EXPECT_NE(EpZero1LostMessage("T/optim", v, 2, true).find("have no tensors in their .tensors/ folders"), std::string::npos);
  EXPECT_NE(EpZero1LostMessage("T/optim", v, 4, false).find("the experts of ep ranks 1..3 and"), std::string::npos);
  // NxD's own route names optim files by dp rank alone; a plain AdamW file is not this loss.
  EXPECT_FALSE(EpNamedOptimFile(Env::Default()->ListDir(TagOf("hf_ep2_pt") + "/optim")));
  EXPECT_EQ(EpZero1LostMessage("T", Value::NewDict(), 2, false), "");
}

}  // namespace
}  // namespace ckpt
