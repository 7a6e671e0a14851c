#include "migrate/check.h"

#include <gtest/gtest.h>

namespace migrate {

const char* kGood = R"(name: x
model_source: megatron
trainer: {devices: 32, num_nodes: 2, max_steps: 10}
exp_manager: {resume_if_exists: True}
distributed_strategy: {tensor_model_parallel_size: 8, pipeline_model_parallel_size: 2}
data: {micro_batch_size: 1, global_batch_size: 64, seq_length: '${model.encoder_seq_length}'}
model: {num_layers: 32, num_attention_heads: 32, encoder_seq_length: 4096}
precision: {type: mixed_precision}
)";

std::vector<std::string> CheckWith(const std::string& path, const std::string& value) {
  YAML::Node n = LoadYaml(kGood, "c");
  Set(n, path, YAML::Load(value));
  return CheckNxdt(n);
}

std::vector<std::string> AtLaunchWith(const std::string& path, const std::string& value) {
  YAML::Node n = LoadYaml(kGood, "c");
  Set(n, path, YAML::Load(value));
  return CheckAtLaunch(n);
}

TEST(Check, AcceptsAConsistentConfig) { EXPECT_EQ(CheckNxdt(LoadYaml(kGood, "c")), std::vector<std::string>{}); }

TEST(Check, EachRuleHasAPreciseMessage) {
  YAML::Node n = LoadYaml(kGood, "c");
  Erase(n, "precision");
  EXPECT_EQ(CheckNxdt(n), std::vector<std::string>{"missing required section 'precision'"});
  // The named world's arithmetic is settled at launch (launch scripts set the
  // sizes): reported by CheckAtLaunch, not a problem.
  EXPECT_EQ(CheckAtLaunch(LoadYaml(kGood, "c")), std::vector<std::string>{});
  EXPECT_EQ(CheckWith("trainer.devices", "12"), std::vector<std::string>{});
  EXPECT_EQ(AtLaunchWith("trainer.devices", "12"),
            std::vector<std::string>{"distributed_strategy: tensor_model_parallel_size (8) * pipeline_model_parallel_size (2) = 16 "
                                     "does not divide trainer.devices (12) * trainer.num_nodes (2) = 24, the world size (24)"});
  EXPECT_EQ(CheckWith("data.global_batch_size", "10"), std::vector<std::string>{});
  EXPECT_EQ(AtLaunchWith("data.global_batch_size", "10"),
            std::vector<std::string>{"data.global_batch_size (10) is not a multiple of data.micro_batch_size (1) * data-parallel size (4) = 4 "
                                     "at trainer.devices (32) * trainer.num_nodes (2) = 64, the world size"});
  // Not a multiple of the micro batch is wrong at any world size.
  EXPECT_EQ(CheckWith("data.micro_batch_size", "3"),
            std::vector<std::string>{"data.global_batch_size (64) is not a multiple of data.micro_batch_size (3)"});
  EXPECT_EQ(AtLaunchWith("data.micro_batch_size", "3"), std::vector<std::string>{});
  EXPECT_EQ(CheckWith("model.num_layers", "31"),
            std::vector<std::string>{"model.num_layers (31) does not divide evenly over pipeline_model_parallel_size (2); give model.pipeline_cuts or change the sizes"});
  YAML::Node cuts = LoadYaml(kGood, "c");
  Set(cuts, "model.num_layers", YAML::Load("31"));
  Set(cuts, "model.pipeline_cuts", YAML::Load("[15]"));
  EXPECT_EQ(CheckNxdt(cuts), std::vector<std::string>{});
  EXPECT_EQ(CheckWith("model.num_attention_heads", "20"),
            std::vector<std::string>{"model.num_attention_heads (20) is not divisible by tensor_model_parallel_size (8)"});
  EXPECT_EQ(CheckWith("trainer.max_steps", "'10'"), std::vector<std::string>{"trainer.max_steps: '10' is not an integer"});
  EXPECT_EQ(CheckWith("exp_manager.resume_if_exists", "maybe"), std::vector<std::string>{"exp_manager.resume_if_exists: maybe is not a boolean"});
  // OmegaConf's mandatory marker is set at launch: not a problem, but listed.
  EXPECT_EQ(CheckWith("data.data_prefix", "???"), std::vector<std::string>{});
  YAML::Node marked = LoadYaml(kGood, "c");
  Set(marked, "data.data_prefix", YAML::Load("???"));
  EXPECT_EQ(SetAtLaunch(marked), std::vector<std::string>{"data.data_prefix"});
  EXPECT_EQ(SetAtLaunch(LoadYaml(kGood, "c")), std::vector<std::string>{});
  // Interpolated values are followed.
  EXPECT_EQ(CheckWith("trainer.devices", "'${data.global_batch_size}'"), std::vector<std::string>{});
}

}  // namespace migrate
