#include "libtrain/config_keys.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "libtrain/train_config.h"

namespace train {
namespace {

KeyCheck Check(const std::string& yaml) { return CheckConfigKeys(YAML::Load(yaml)); }

TEST(ConfigKeys, SectionsAreRefusedOnceNamingTheSection) {
  // model.moe is read (both Mixtral styles train, issue #39): walked into, not refused.
  const KeyCheck k = Check("model:\n  moe: {num_experts: 8, top_k: 2}\n  num_layers: 2\n"
                           "model_alignment_strategy:\n  sft: {max_length: 8}\n  dpo: {kl_beta: 0.01}\n  peft: {lora_rank: 16}\n");
  ASSERT_EQ(k.refused.size(), 3u);
  EXPECT_EQ(k.refused[0].rfind("model_alignment_strategy.sft: supervised", 0), 0u) << k.refused[0];
  EXPECT_EQ(k.refused[1].rfind("model_alignment_strategy.dpo: DPO", 0), 0u) << k.refused[1];
  EXPECT_EQ(k.refused[2].rfind("model_alignment_strategy.peft: LoRA", 0), 0u) << k.refused[2];
  for (const auto& r : k.refused) EXPECT_NE(r.find("shardkit does not implement it"), std::string::npos) << r;
  EXPECT_TRUE(k.ignored.empty());
}

TEST(ConfigKeys, ValuesThatLeaveAFeatureOffPass) {
  const KeyCheck off = Check("distributed_strategy: {context_parallel_size: 1, virtual_pipeline_model_parallel_size: 1.0, "
                             "expert_model_parallel_size: null}\nmodel: {virtual_pipeline_model_parallel_size: 1, moe: {}}\n"
                             "data: {eod_mask_loss: false}\nexp_manager: {save_bf16: False}\ntrainer: {max_epochs: -1}\n");
  EXPECT_TRUE(off.refused.empty()) << off.refused[0];
  EXPECT_TRUE(off.ignored.empty());
  const KeyCheck on = Check("distributed_strategy: {context_parallel_size: 2, virtual_pipeline_model_parallel_size: 2}\n"
                            "model: {virtual_pipeline_model_parallel_size: 4}\ndata: {eod_mask_loss: True}\n");
  ASSERT_EQ(on.refused.size(), 4u);
  EXPECT_EQ(on.refused[0].rfind("distributed_strategy.context_parallel_size: 2: context parallelism", 0), 0u) << on.refused[0];
  EXPECT_EQ(on.refused[1].rfind("distributed_strategy.virtual_pipeline_model_parallel_size: 2: interleaved", 0), 0u);
  EXPECT_EQ(on.refused[2].rfind("model.virtual_pipeline_model_parallel_size: 4: interleaved", 0), 0u);
  EXPECT_EQ(on.refused[3].rfind("data.eod_mask_loss: True: masks", 0), 0u);
}

// Virtual pipeline stages run (the interleaved schedule) with pipeline parallelism, and only with it.
TEST(ConfigKeys, VirtualStagesNeedPipelineParallelism) {
  EXPECT_TRUE(Check("distributed_strategy: {pipeline_model_parallel_size: 2, virtual_pipeline_model_parallel_size: 2}\n"
                    "model: {virtual_pipeline_model_parallel_size: 2}\n").refused.empty());
  const KeyCheck k = Check("distributed_strategy: {pipeline_model_parallel_size: 1, virtual_pipeline_model_parallel_size: 2}\n");
  ASSERT_EQ(k.refused.size(), 1u);
  EXPECT_EQ(k.refused[0], "distributed_strategy.virtual_pipeline_model_parallel_size: 2: interleaved (virtual) pipeline stages; shardkit "
                          "does not implement it without distributed_strategy.pipeline_model_parallel_size above 1");
}

TEST(ConfigKeys, ReadKeysWithFixedValues) {
  EXPECT_TRUE(Check("precision: {type: fp32}\nmodel: {optim: {name: adamw}}\n").refused.empty());
  const KeyCheck k = Check("precision: {type: autocast}\nmodel: {optim: {name: adamw_fp32OptState}}\n");
  ASSERT_EQ(k.refused.size(), 2u);
  EXPECT_EQ(k.refused[0].rfind("precision.type: 'autocast': a precision other than fp32 and mixed_precision", 0), 0u) << k.refused[0];
  EXPECT_EQ(k.refused[1].rfind("model.optim.name: 'adamw_fp32OptState': an optimizer other than adamw", 0), 0u) << k.refused[1];
  for (const auto& r : k.refused) EXPECT_NE(r.find("; shardkit does not implement it"), std::string::npos) << r;
}

TEST(ConfigKeys, UnknownKeysAreRefusedAndNeuronKeysIgnored) {
  const KeyCheck k = Check("compiler_flags: --model-type transformer\nmodel:\n  fusions: {softmax: True}\n  frobnicate: 3\n"
                           "  optim: {sched: {decay_style: linear}}\n");
  ASSERT_EQ(k.refused.size(), 2u);
  EXPECT_EQ(k.refused[0].rfind("model.frobnicate: not a key shardkit knows", 0), 0u) << k.refused[0];
  EXPECT_EQ(k.refused[1].rfind("model.optim.sched.decay_style: not a key", 0), 0u) << k.refused[1];
  ASSERT_EQ(k.ignored.size(), 2u);
  EXPECT_EQ(k.ignored[0], "compiler_flags (a Neuron compiler or runtime setting)");
  EXPECT_EQ(k.ignored[1].rfind("model.fusions (", 0), 0u);
}

const char kBase[] = R"(
trainer: {devices: 2, num_nodes: 1}
distributed_strategy: {tensor_model_parallel_size: 1, pipeline_model_parallel_size: 2, zero1: False}
data: {micro_batch_size: 1, global_batch_size: 1, seq_length: 16, data_prefix: [1.0, data]}
model: {vocab_size: 64, num_layers: 4, hidden_size: 16, num_attention_heads: 2}
)";

TEST(ConfigKeys, TrainConfigRefusesAllAtOnceNamingFileAndKeys) {
  try {
    ParseTrainConfig(kBase, "c.yaml", {"+model_alignment_strategy.dpo.kl_beta=0.1", "+distributed_strategy.context_parallel_size=2"});
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    // In the config's order, one line each.
    EXPECT_EQ(what.rfind("c.yaml: distributed_strategy.context_parallel_size: 2: context parallelism", 0), 0u) << what;
    EXPECT_NE(what.find("; shardkit does not implement it\nc.yaml: model_alignment_strategy.dpo: DPO"), std::string::npos) << what;
  }
}

TEST(ConfigKeys, NxdtPipelineCutsNameTheLastLayerOfAStage) {
  // NxD's partition(): the named layer ends its stage; stage 1 starts one layer later.
  EXPECT_EQ(ParseTrainConfig(kBase, "c.yaml", {"+model.pipeline_cuts=[language_model.encoder.layers.0]"}).stage_bounds,
            (std::vector<int64_t>{0, 1, 4}));
  EXPECT_EQ(ParseTrainConfig(kBase, "c.yaml", {"+model.pipeline_cuts=[1]"}).stage_bounds, (std::vector<int64_t>{0, 1, 4}));
  EXPECT_EQ(ParseTrainConfig(kBase, "c.yaml", {"+model.pipeline_cuts=[language_model.encoder.layers.2]"}).stage_bounds,
            (std::vector<int64_t>{0, 3, 4}));
  // The HF model's name is not the megatron model's; the last layer cannot end a stage.
  EXPECT_THROW(ParseTrainConfig(kBase, "c.yaml", {"+model.pipeline_cuts=[model.layers.0]"}), ConfigError);
  EXPECT_THROW(ParseTrainConfig(kBase, "c.yaml", {"+model.pipeline_cuts=[language_model.encoder.layers.3]"}), ConfigError);
}

TEST(ConfigKeys, ReadKeysOfTheOtherModelFamilyAreNamed) {
  // NxDT's megatron models do not read the HF model's keys: a note, not a silent pass.
  const TrainConfig c = ParseTrainConfig(kBase, "c.yaml", {"+model.fuse_qkv=False", "+distributed_strategy.kv_replicator=4"});
  EXPECT_EQ(c.ignored, (std::vector<std::string>{"model.fuse_qkv (NxDT's model_source: megatron models do not read it)",
                                                 "distributed_strategy.kv_replicator (NxDT's model_source: megatron models do not read it)"}));
}

TEST(ConfigKeys, SlidingWindowAndKvChannels) {
  const std::vector<std::string> one = {"trainer.devices=1", "distributed_strategy.pipeline_model_parallel_size=1"};
  auto with = [&](std::vector<std::string> o) {
    o.insert(o.begin(), one.begin(), one.end());
    return o;
  };
  const TrainConfig c = ParseTrainConfig(kBase, "c.yaml", with({"+model.sliding_window_size=16", "+model.kv_channels=8"}));
  EXPECT_EQ(c.ignored, (std::vector<std::string>{"model.sliding_window_size (no effect: the window of 16 covers data.seq_length 16)"}));
  EXPECT_THROW(ParseTrainConfig(kBase, "c.yaml", with({"+model.sliding_window_size=15"})), ConfigError);
  EXPECT_THROW(ParseTrainConfig(kBase, "c.yaml", with({"+model.kv_channels=16"})), ConfigError);
}

}  // namespace
}  // namespace train
