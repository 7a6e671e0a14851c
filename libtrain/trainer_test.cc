#include "libtrain/trainer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>

#include "ckpt/util/error.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/testing/test_util.h"
#include "libtrain/indexed_dataset.h"

namespace train {
namespace {

// A tiny model, a checkpoint every 2 steps (synchronous, so a fault surfaces in the step that saves).
const char kConfig[] = R"(
name: t
trainer: {devices: 1, num_nodes: 1, max_steps: 6}
exp_manager:
  resume_if_exists: True
  resume_ignore_no_checkpoint: True
  async_checkpointing: False
  checkpoint_callback_params: {every_n_train_steps: 2, save_top_k: -1}
distributed_strategy: {tensor_model_parallel_size: 1, pipeline_model_parallel_size: 1, zero1: False}
data: {micro_batch_size: 2, global_batch_size: 2, seq_length: 16, data_prefix: [1.0, data]}
model:
  vocab_size: 64
  num_layers: 1
  hidden_size: 16
  ffn_hidden_size: 32
  num_attention_heads: 2
  optim: {lr: 1e-3, sched: {name: CosineAnnealing, max_steps: 6}}
)";

class TrainerFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(1);
    std::vector<std::vector<int32_t>> docs(20, std::vector<int32_t>(40));
    for (auto& d : docs)
      for (auto& t : d) t = static_cast<int32_t>(rng() % 64);
    IndexedDataset::Write(dir_.path() + "/data", docs);
    std::ofstream(dir_.path() + "/conf.yaml") << kConfig;
  }
  TrainConfig Config() { return LoadTrainConfig(dir_.path() + "/conf.yaml", {"+exp_manager.explicit_log_dir=" + dir_.path() + "/run"}); }
  std::string Tag(int step) {
    return dir_.path() + "/run/checkpoints/" + ckpt::FormatTagName({"t", step, static_cast<double>(2 * step), false});
  }
  ckpt::testing::TempDir dir_{"trainer_test"};
};

// A key the config leaves out means what NxDT's megatron models take for it
// (megatron_gpt_model.py ModelModule.model_provider_func): a tied GPT.
TEST_F(TrainerFaults, MegatronDefaultsAreNxdts) {
  const ModelConfig m = Config().model;
  EXPECT_TRUE(m.tied_output);
  EXPECT_TRUE(m.layernorm);
  EXPECT_TRUE(m.gelu);
  EXPECT_TRUE(m.learned_positions);
  EXPECT_TRUE(m.bias);
  EXPECT_FLOAT_EQ(m.hidden_dropout, 0.1f);
  EXPECT_FLOAT_EQ(m.attention_dropout, 0.0f);
  const TrainConfig untied = LoadTrainConfig(dir_.path() + "/conf.yaml", {"+exp_manager.explicit_log_dir=" + dir_.path() + "/run",
                                                                          "+model.share_embeddings_and_output_weights=False"});
  EXPECT_FALSE(untied.model.tied_output);
}

// The trainer's files go through the Env it is given: a full disk while the step-4 checkpoint is
// written fails the run with an error naming the file, leaves no tag at step 4 that looks complete,
// and the rerun resumes from step 2 and ends where an uninterrupted run ends.
TEST_F(TrainerFaults, AFullDiskDuringASaveFailsTheRunAndTheRerunResumesFromTheLastCompleteTag) {
  const auto quiet = [](const std::string&) {};
  ckpt::testing::TempDir other("trainer_test_straight");  // an uninterrupted run
  std::ofstream(other.path() + "/conf.yaml") << kConfig;
  TrainConfig straight = LoadTrainConfig(other.path() + "/conf.yaml", {"+exp_manager.explicit_log_dir=" + other.path() + "/run"});
  straight.data_prefix = {{1.0, dir_.path() + "/data"}};
  const TrainResult whole = RunTraining(straight, quiet);
  ASSERT_EQ(whole.losses.size(), 6u);
  // What the step-2 save writes; the metrics lines before step 4 add a few hundred bytes.
  uint64_t step_2_bytes = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(other.path() + "/run/checkpoints/" + std::filesystem::path(Tag(2)).filename().string()))
    if (f.is_regular_file()) step_2_bytes += f.file_size();

  TrainConfig c = Config();
  c.data_prefix = {{1.0, dir_.path() + "/data"}};
  ckpt::FaultEnv full(ckpt::Env::Default());
  full.FailWritesAfter(static_cast<int64_t>(step_2_bytes) + 2000);  // inside the step-4 save
  try {
    RunTraining(c, quiet, &full);
    FAIL() << "the run should have failed";
  } catch (const ckpt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device (injected)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir_.path() + "/run/"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(ckpt::VerifyTag(ckpt::Env::Default(), Tag(2)).ok());
  EXPECT_FALSE(std::filesystem::exists(Tag(4) + "/" + ckpt::kDoneMarker));

  std::vector<std::string> lines;
  const TrainResult rerun = RunTraining(c, [&](const std::string& l) { lines.push_back(l); });
  EXPECT_GT(std::filesystem::file_size(Tag(6) + "/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"), 0u);
  EXPECT_EQ(rerun.resumed_from, Tag(2));
  EXPECT_EQ(rerun.start_step, 2);
  ASSERT_EQ(rerun.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(rerun.losses[i], whole.losses[i + 2]) << "step " << i + 3;
  (void)lines;
}

}  // namespace
}  // namespace train
