#include "ckpt/pt/plain_data.h"

#include <gtest/gtest.h>

#include "ckpt/pt/pickle_writer.h"
#include "ckpt/pt/xser.h"
#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

Value Obj(const std::string& module, const std::string& name, Value state, Object::Build how = Object::Build::kNewObj) {
  auto o = std::make_shared<Object>();
  o->cls = Global{module, name};
  o->how = how;
  o->args = std::make_shared<Value>(Value::Tuple());
  if (!state.is_none()) o->state = std::make_shared<Value>(std::move(state));
  return Value(o);
}

Value Dict(std::vector<std::pair<std::string, Value>> items) {
  Value d = Value::NewDict();
  for (auto& [k, v] : items) d.as_dict().Set(k, std::move(v));
  return d;
}

// As omegaconf 2.x pickles a node: NEWOBJ, then BUILD with its __dict__.
Value Node(Value val) {
  return Obj("omegaconf.nodes", "AnyNode", Dict({{"_metadata", Obj("omegaconf.base", "Metadata", Dict({}))}, {"_parent", Value()}, {"_val", val}}));
}
Value Config(const std::string& kind, Value content) {
  const std::string module = kind == "DictConfig" ? "omegaconf.dictconfig" : "omegaconf.listconfig";
  Value meta = Obj("omegaconf.base", "ContainerMetadata", Dict({{"object_type", Value(Global{"builtins", "dict"})}, {"ref_type", Value(Global{"typing", "Any"})}}));
  return Obj(module, kind, Dict({{"_metadata", meta}, {"_parent", Value()}, {"_flags_cache", Value()}, {"_content", content}}));
}

TEST(PlainData, OmegaConfAndLightningContainersBecomeDictsAndLists) {
  Value optim = Config("DictConfig", Dict({{"lr", Node(Value(3e-4))}, {"betas", Config("ListConfig", Value::List({Node(Value(0.9)), Node(Value(0.95))}))}}));
  Value cfg = Config("DictConfig", Dict({{"num_layers", Node(Value(4))},
                                         {"optim", optim},
                                         {"data_prefix", Node(Value("???"))},
                                         {"tokenizer", Config("DictConfig", Value())},
                                         {"peft", Config("DictConfig", Value("${model.x}"))}}));
  auto hp = std::make_shared<Object>();
  hp->cls = Global{"pytorch_lightning.utilities.parsing", "AttributeDict"};
  hp->how = Object::Build::kNewObj;
  hp->args = std::make_shared<Value>(Value::Tuple({Value(Global{"pytorch_lightning.utilities.parsing", "AttributeDict"})}));
  hp->dict_items.emplace_back(Value("cfg"), cfg);
  hp->dict_items.emplace_back(Value("again"), cfg);  // one config reached twice stays one value
  const Value got = PlainCheckpointData(Dict({{"hyper_parameters", Value(hp)}, {"global_step", Value(4)}}), "u.pt");

  const Value& h = got.as_dict().At("hyper_parameters");
  ASSERT_TRUE(h.is_dict());
  const Value& c = h.as_dict().At("cfg");
  ASSERT_TRUE(c.is_dict());
  EXPECT_FALSE(c.as_dict().ordered);
  EXPECT_EQ(c.as_dict().At("num_layers").as_int(), 4);
  EXPECT_EQ(c.as_dict().At("optim").as_dict().At("lr").as_float(), 3e-4);
  const auto& betas = c.as_dict().At("optim").as_dict().At("betas").as_seq();
  EXPECT_EQ(betas.kind, SeqKind::kList);
  ASSERT_EQ(betas.items.size(), 2u);
  EXPECT_EQ(betas.items[1].as_float(), 0.95);
  EXPECT_EQ(c.as_dict().At("data_prefix").as_str(), "???");
  EXPECT_TRUE(c.as_dict().At("tokenizer").is_none());
  EXPECT_EQ(c.as_dict().At("peft").as_str(), "${model.x}");
  EXPECT_EQ(&h.as_dict().At("again").as_dict(), &c.as_dict());
  EXPECT_EQ(got.as_dict().At("global_step").as_int(), 4);
  EXPECT_NO_THROW(CheckPicklable(got, "x"));
}

TEST(PlainData, AnythingElseIsRefusedNamingFileAndPath) {
  Value call = Obj("posix", "system", Value(), Object::Build::kReduce);
  call.as_object().args = std::make_shared<Value>(Value::Tuple({Value("touch pwned")}));
  Value cfg = Config("DictConfig", Dict({{"optim", Config("DictConfig", Dict({{"hook", Node(call)}}))}}));
  const std::string e = testing::ErrorOf([&] { PlainCheckpointData(Dict({{"hyper_parameters", Dict({{"cfg", cfg}})}}), "/in/rank.ckpt"); });
  EXPECT_EQ(e, "/in/rank.ckpt at /hyper_parameters/cfg/optim/hook: the global posix.system, which torch.load(weights_only=True) refuses and "
               "plain torch.load calls; shardkit writes only what torch.load(weights_only=True) loads, so it does not carry that");

  const std::string groups = testing::ErrorOf([&] {
    PlainCheckpointData(Dict({{"param_groups", Value::List({Dict({{"lr", Value(0.1)}, {"x", Obj("interop_classes", "Foreign", Dict({}))}})})}}), "o.pt");
  });
  EXPECT_NE(groups.find("o.pt at /param_groups/[0]/x: the global interop_classes.Foreign"), std::string::npos) << groups;
  EXPECT_NE(testing::ErrorOf([&] { PlainCheckpointData(Dict({{"cfg", Obj("omegaconf.dictconfig", "DictConfig", Dict({}))}}), "f"); })
                .find("f at /cfg: an omegaconf DictConfig with no _content"),
            std::string::npos);
  EXPECT_NE(testing::ErrorOf([&] { PlainCheckpointData(Dict({{"cfg", Config("ListConfig", Dict({}))}}), "f"); })
                .find("f at /cfg: an omegaconf ListConfig whose _content is a dict"),
            std::string::npos);
  Value attrs = Obj("lightning.fabric.utilities.data", "AttributeDict", Dict({{"x", Value(1)}}));
  EXPECT_NE(testing::ErrorOf([&] { PlainCheckpointData(Dict({{"hp", attrs}}), "f"); }).find("f at /hp: a Lightning AttributeDict with attributes"),
            std::string::npos);
}

TEST(PlainData, WhatTheWriterAllowsIsKept) {
  Value v = Dict({{"ref", MakeTensorReference(2)}, {"dtype", Value(Global{"torch", "float32"})}, {"w", Value(testing::Arange({3}))}});
  const Value got = PlainCheckpointData(v, "f");
  EXPECT_TRUE(DeepEqual(got, v));
  EXPECT_EQ(TensorReferenceId(got.as_dict().At("ref")), 2);
}

}  // namespace
}  // namespace ckpt
