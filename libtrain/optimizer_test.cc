#include "libtrain/optimizer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/testing/test_util.h"

namespace train {
namespace {

ModelConfig Small(bool bf16) {
  ModelConfig c;
  c.vocab = 32, c.hidden = 16, c.ffn = 24, c.heads = 2, c.kv_heads = 2, c.layers = 1;
  c.bf16_params = bf16;
  return c;
}

AdamWConfig Mixed(bool master_in_ckpt) {
  AdamWConfig o;
  o.lr = 1e-2;
  o.master_weights = o.zero1 = true;
  o.master_weights_in_ckpt = master_in_ckpt;
  return o;
}

// One forward/backward on a fixed batch, then an AdamW step.
void TrainStep(Model& m, AdamW& opt) {
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(16), targets(16);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 32);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % 32);
  m.ZeroGrad();
  m.Forward(tokens.data(), targets.data(), 2, 8);
  m.Backward();
  opt.Step(m, 1e-2);
}

std::vector<uint8_t> Bytes(const Model& m) {
  std::vector<uint8_t> out;
  for (const auto& p : m.layout()) {
    const ckpt::Tensor& t = m.param(p.name);
    out.insert(out.end(), t.data(), t.data() + t.nbytes());
  }
  return out;
}

TEST(AdamWMixedPrecision, ParametersAreTheBFloat16RoundingOfTheirMasterWeights) {
  Model m(Small(true));
  m.InitWeights();
  AdamW opt(m, Mixed(true));
  for (int s = 0; s < 3; ++s) TrainStep(m, opt);
  const ckpt::Value sd = opt.StateDict(1e-2);
  const ckpt::Dict& master = sd.as_dict().At("sharded_master_weights").as_dict();
  int64_t off_grid = 0;
  for (size_t id = 0; id < opt.order().size(); ++id) {
    const ckpt::Tensor& w = master.items[id].second.as_tensor();
    const float* mw = reinterpret_cast<const float*>(w.data());
    const float* p = reinterpret_cast<const float*>(m.param(opt.order()[id]).data());
    for (int64_t i = 0; i < w.numel(); ++i) {
      ASSERT_EQ(p[i], ckpt::RoundToBFloat16(mw[i])) << opt.order()[id] << " " << i;
      off_grid += mw[i] != p[i];
    }
  }
  EXPECT_GT(off_grid, 0);  // the masters keep bits the parameters do not
}

TEST(AdamWMixedPrecision, Zero1StateDictRoundTripsToTheSameNextStep) {
  Model a(Small(true)), b(Small(true));
  a.InitWeights();
  AdamW oa(a, Mixed(true));
  for (int s = 0; s < 2; ++s) TrainStep(a, oa);
  const ckpt::Value sd = oa.StateDict(1e-2);
  EXPECT_EQ(sd.as_dict().At("state").as_dict().items.size(), 0u);
  EXPECT_EQ(sd.as_dict().At("shape_info").as_dict().items[0].second.as_seq().kind, ckpt::SeqKind::kList);  // as NxD writes it

  b.LoadStateDict(a.StateDict());
  AdamW ob(b, Mixed(true));
  EXPECT_TRUE(ob.LoadStateDict(sd));
  EXPECT_EQ(ob.steps(), 2);
  TrainStep(a, oa);
  TrainStep(b, ob);
  EXPECT_EQ(Bytes(a), Bytes(b));
}

TEST(AdamWMixedPrecision, WithoutMasterWeightsInTheCheckpointTheyRestartFromTheParameters) {
  Model a(Small(true)), b(Small(true));
  a.InitWeights();
  AdamW oa(a, Mixed(false));
  for (int s = 0; s < 2; ++s) TrainStep(a, oa);
  const ckpt::Value sd = oa.StateDict(1e-2);
  EXPECT_EQ(sd.as_dict().Find("sharded_master_weights"), nullptr);
  b.LoadStateDict(a.StateDict());
  AdamW ob(b, Mixed(true));
  EXPECT_FALSE(ob.LoadStateDict(sd));
  const ckpt::Value restarted = ob.StateDict(1e-2);
  const ckpt::Dict& master = restarted.as_dict().At("sharded_master_weights").as_dict();
  for (size_t id = 0; id < ob.order().size(); ++id) {
    const ckpt::Tensor& w = master.items[id].second.as_tensor();
    EXPECT_EQ(std::memcmp(w.data(), b.param(ob.order()[id]).data(), w.nbytes()), 0) << ob.order()[id];
  }
}

TEST(AdamW, ReadsEitherLayoutAndAnInt64Step) {
  Model m(Small(false));
  m.InitWeights();
  AdamWConfig plain;
  AdamW a(m, plain);
  TrainStep(m, a);
  ckpt::Value sd = a.StateDict(1e-3);
  for (auto& [id, st] : sd.as_dict().At("state").as_dict().items) {
    ckpt::Tensor step = ckpt::Tensor::Zeros(ckpt::DType::kInt64, {});
    reinterpret_cast<int64_t*>(step.mutable_data())[0] = 7;
    st.as_dict().Set("step", ckpt::Value(step));
  }
  AdamWConfig zero1;
  zero1.zero1 = true;
  AdamW b(m, zero1);
  EXPECT_FALSE(b.LoadStateDict(sd));
  EXPECT_EQ(b.steps(), 7);
  AdamW c(m, plain);
  c.LoadStateDict(b.StateDict(1e-3));  // ZeRO-1 layout into a plain optimizer
  EXPECT_EQ(c.steps(), 7);
  EXPECT_TRUE(ckpt::DeepEqual(c.StateDict(1e-3).as_dict().At("state"), b.StateDict(1e-3).as_dict().At("base_state")));
}

// A state dict grouped for the other do_layer_norm_weight_decay setting
// numbers its ids differently: loading it would give moments to the wrong
// parameters, so it is refused, naming the setting.
TEST(AdamW, StateGroupedForTheOtherSettingIsRefused) {
  ModelConfig gpt = Small(false);  // biases: NeMo's rule keeps them apart unless do_layer_norm_weight_decay
  gpt.layernorm = gpt.gelu = gpt.bias = gpt.learned_positions = true;
  gpt.max_positions = 16;
  Model m(gpt);
  AdamWConfig split, one;
  one.do_layer_norm_weight_decay = true;
  AdamW a(m, split), b(m, one);
  TrainStep(m, a);
  const std::string e = ckpt::testing::ErrorOf([&] { b.LoadStateDict(a.StateDict(1e-2)); });
  EXPECT_NE(e.find("optimizer param_groups hold 10/7 parameter ids, but this run groups them as 17"), std::string::npos) << e;
  EXPECT_NE(e.find("model.do_layer_norm_weight_decay: True"), std::string::npos) << e;
  EXPECT_NO_THROW(AdamW(m, split).LoadStateDict(a.StateDict(1e-2)));
}

// Tags grouped by name (shardkit's trainer before it followed NeMo; NxD's
// llama example) are read by name: every moment reaches its parameter.
TEST(AdamW, StateGroupedByNameIsReadByName) {
  ModelConfig gpt = Small(false);
  gpt.layernorm = gpt.gelu = gpt.bias = gpt.learned_positions = true;
  gpt.max_positions = 16;
  Model m(gpt);
  AdamWConfig c;
  c.zero1 = true;
  AdamW a(m, c);
  TrainStep(m, a);
  const ckpt::Value ours = a.StateDict(1e-2);
  std::vector<std::string> names;
  for (const auto& p : m.layout()) names.push_back(p.name);
  const ckpt::Grouping split = ckpt::FamilyGrouping(m.format(), names, ckpt::GroupingRule::kNameSplit);
  ASSERT_EQ(split.groups, 2);
  // The same state renumbered as the name split numbers it.
  ckpt::Value old = ckpt::Value::NewDict();
  ckpt::Value base = ckpt::Value::NewDict(), shapes = ckpt::Value::NewDict();
  ckpt::Value groups = ckpt::Value::List();
  for (int g = 0; g < 2; ++g) {
    const ckpt::Value& from = ours.as_dict().At("param_groups").as_seq().items[0];
    ckpt::Value pg = ckpt::Value::NewDict(from.as_dict().ordered);  // a new dict: Values share their containers
    pg.as_dict().items = from.as_dict().items;
    ckpt::Value ids = ckpt::Value::List();
    for (size_t j = 0; j < split.order.size(); ++j)
      if (split.order[j].group == g) ids.as_seq().items.emplace_back(static_cast<int64_t>(j));
    pg.as_dict().Set("params", ids);
    groups.as_seq().items.push_back(pg);
  }
  for (size_t j = 0; j < split.order.size(); ++j) {
    const int64_t i = std::find(a.order().begin(), a.order().end(), split.order[j].name) - a.order().begin();
    base.as_dict().items.emplace_back(ckpt::Value(static_cast<int64_t>(j)), *ckpt::EntryById(ours.as_dict().At("base_state").as_dict(), i));
    shapes.as_dict().items.emplace_back(ckpt::Value(static_cast<int64_t>(j)), *ckpt::EntryById(ours.as_dict().At("shape_info").as_dict(), i));
  }
  old.as_dict().Set("state", ckpt::Value::NewDict());
  old.as_dict().Set("param_groups", groups);
  old.as_dict().Set("base_state", base);
  old.as_dict().Set("shape_info", shapes);
  AdamW b(m, c);
  b.LoadStateDict(old);
  EXPECT_NE(b.regrouped().find("name-split"), std::string::npos) << b.regrouped();
  EXPECT_TRUE(ckpt::DeepEqual(b.StateDict(1e-2).as_dict().At("base_state"), ours.as_dict().At("base_state")));
  AdamW same(m, c);
  same.LoadStateDict(ours);
  EXPECT_EQ(same.regrouped(), "");
}

// Dicts and lists copied (Values share their containers); tensors shared.
ckpt::Value Copy(const ckpt::Value& v) {
  if (v.is_seq()) {
    std::vector<ckpt::Value> items;
    for (const auto& x : v.as_seq().items) items.push_back(Copy(x));
    return ckpt::Value::NewSeq(v.as_seq().kind, std::move(items));
  }
  if (v.is_dict()) {
    ckpt::Value d = ckpt::Value::NewDict(v.as_dict().ordered);
    for (const auto& [k, x] : v.as_dict().items) d.as_dict().items.emplace_back(k, Copy(x));
    return d;
  }
  return v;
}

// NxDT's GPT at pp = 1 lists the tied weight twice; torch numbers both
// positions with the copy's id. Its plain state dict keys the weight's state
// by that id; its ZeRO-1 one keys shards by position, the copy's shard without
// state and with a stale master weight (tests/data/upstream/nxdt_megatron).
TEST(AdamW, TorchsNumberingOfTheTiedWeightListedTwiceIsRead) {
  ModelConfig gpt = Small(false);
  gpt.layernorm = gpt.gelu = gpt.bias = gpt.learned_positions = gpt.tied_output = true;
  gpt.max_positions = 16;
  Model m(gpt);
  for (bool zero1 : {false, true}) {
    AdamWConfig c;
    c.zero1 = zero1, c.master_weights = zero1, c.master_weights_in_ckpt = zero1;
    AdamW a(m, c);
    TrainStep(m, a);
    const ckpt::Value ours = a.StateDict(1e-2);
    const int64_t e = std::find(a.order().begin(), a.order().end(), "language_model.embedding.word_embeddings.weight") - a.order().begin();
    const int64_t copy = std::find(a.order().begin(), a.order().end(), "language_model.output_layer.weight") - a.order().begin();
    ASSERT_LT(copy, static_cast<int64_t>(a.order().size()));
    const ckpt::Value theirs = Copy(ours);
    auto& groups = theirs.as_dict().At("param_groups").as_seq().items;
    groups[0].as_dict().At("params").as_seq().items[e] = ckpt::Value(copy);
    auto& state = theirs.as_dict().At(zero1 ? "base_state" : "state").as_dict();
    std::erase_if(state.items, [&](const auto& kv) { return kv.first.as_int() == (zero1 ? copy : e); });
    if (zero1) {
      auto& masters = theirs.as_dict().At("sharded_master_weights").as_dict();
      ckpt::Tensor stale = ckpt::Tensor::Zeros(ckpt::DType::kFloat32, ckpt::EntryById(masters, copy)->as_tensor().shape());
      for (auto& [k, v] : masters.items)
        if (k.as_int() == copy) v = ckpt::Value(stale);
    }
    AdamW b(m, c);
    b.LoadStateDict(theirs);
    EXPECT_TRUE(ckpt::DeepEqual(b.StateDict(1e-2), ours)) << "zero1 " << zero1;
  }
}

TEST(AdamW, AShardFromMoreDataParallelRanksIsNamed) {
  Model m(Small(false));
  AdamWConfig zero1;
  zero1.zero1 = true;
  AdamW a(m, zero1);
  ckpt::Value sd = a.StateDict(1e-3);
  auto& first = sd.as_dict().At("base_state").as_dict().items[0].second.as_dict();
  first.Set("exp_avg", ckpt::Value(first.At("exp_avg").as_tensor().Narrow0(0, 16)));
  const std::string err = ckpt::testing::ErrorOf([&] { a.LoadStateDict(sd); });
  EXPECT_NE(err.find("optimizer exp_avg of parameter 0 (language_model.embedding.word_embeddings.weight) is [16, 16], not [32, 16]"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("ZeRO-1 shard"), std::string::npos) << err;
}

}  // namespace
}  // namespace train
