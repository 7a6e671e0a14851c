#include "tools/inspect_lib.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "ckpt/util/error.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/testing/test_util.h"

namespace shardkit {
namespace {

using ckpt::Value;

// An MoE tag no reader takes: its family, experts, MoE layers and ep from its files.
TEST(Inspect, MoeTagNamesFamilyExpertsAndEp) {
  ckpt::testing::TempDir dir("inspect_moe");
  ckpt::Env::Default()->CreateDirs(dir / "model");
  for (int ep = 0; ep < 2; ++ep) {
    Value m = Value::NewDict();
    m.as_dict().Set("model.layers.1.mlp.router.linear_router.weight", Value(ckpt::testing::Arange({6, 3})));
    m.as_dict().Set("model.layers.1.mlp.expert_mlps.mlp_op.down_proj.weight", Value(ckpt::testing::Arange({3, 2, 3})));
    ckpt::SavePt(dir / ("model/dp_rank_00_ep_rank_0" + std::to_string(ep) + "_tp_rank_00_pp_rank_00.pt"), m);
  }
  const InspectReport r = Inspect(dir.path(), true);
  ASSERT_TRUE(r.model_json) << r.model;
  EXPECT_EQ((*r.model_json)["model_family"], "hf_mixtral");
  EXPECT_EQ((*r.model_json)["num_experts"], 6);
  EXPECT_EQ((*r.model_json)["ep"], 2);
  EXPECT_EQ((*r.model_json)["moe_layers"], nlohmann::ordered_json::array({1}));
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes[0].find("MoE"), std::string::npos);
}

TEST(Inspect, NxdtTagListsEveryRankFileAndEntry) {
  ckpt::testing::TempDir dir("inspect");
  auto* env = ckpt::Env::Default();
  for (const char* sub : {"model", "optim"}) env->CreateDirs(dir / sub);
  for (int tp = 0; tp < 2; ++tp) {
    Value m = Value::NewDict();
    m.as_dict().Set("language_model.output_layer.weight", Value(ckpt::testing::Arange({4, 3})));
    ckpt::SavePt(dir / ("model/dp_rank_00_tp_rank_0" + std::to_string(tp) + "_pp_rank_00.pt"), m);
  }
  Value sched = Value::NewDict();
  sched.as_dict().Set("last_epoch", Value(5));
  sched.as_dict().Set("base_lrs", Value::List({Value(3e-4)}));
  ckpt::SavePt(dir / "scheduler.pt", sched);
  ckpt::WriteFileAtomically(env, dir / "done", [](ckpt::WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>("1"), 1}); });

  InspectReport r = Inspect(dir.path(), true);
  EXPECT_EQ(r.kind, "nxdt_tag");
  EXPECT_EQ(r.markers, std::vector<std::string>{"done"});
  ASSERT_EQ(r.files.size(), 3u);
  EXPECT_EQ(r.files[0].file, "model/dp_rank_00_tp_rank_00_pp_rank_00.pt");
  EXPECT_EQ(r.files[1].file, "model/dp_rank_00_tp_rank_01_pp_rank_00.pt");
  EXPECT_EQ(r.files[2].file, "scheduler.pt");
  const auto& e = r.files[0].entries.at(0);
  EXPECT_TRUE(e.is_tensor);
  EXPECT_EQ(e.dtype, "float32");
  EXPECT_EQ(e.shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(e.bytes, 48u);
  const auto j = ReportToJson(r);
  EXPECT_EQ(j["totals"]["tensors"], 2);
  EXPECT_EQ(j["files"][2]["entries"][0]["key"], "last_epoch");
  EXPECT_EQ(j["files"][2]["entries"][0]["value"]["v"], 5);
  // Floats and lists of them print as Python prints them, not as bit patterns.
  EXPECT_NE(ReportToText(r).find("base_lrs = [0.0003]"), std::string::npos) << ReportToText(r);
}

TEST(Inspect, BadInputsNameThePath) {
  ckpt::testing::TempDir dir("inspect");
  EXPECT_THROW(Inspect(dir / "absent.pt", false), ckpt::Error);
  try {
    Inspect(dir.path(), false);
    FAIL();
  } catch (const ckpt::Error& e) {
    EXPECT_EQ(std::string(e.what()), dir.path() + ": directory holds no .pt or .ckpt files");
  }
}

TEST(Inspect, AFolderLinkedOutOfTheOneNamedIsRefusedBeforeItIsListed) {
  ckpt::testing::TempDir dir("inspect");
  const std::string tag = dir / "tag", away = dir / "away";
  Value m = Value::NewDict();
  m.as_dict().Set("w", Value(ckpt::testing::Arange({2})));
  ckpt::Env::Default()->CreateDirs(away + "/model");
  ckpt::SavePt(away + "/model/dp_rank_00_tp_rank_00_pp_rank_00.pt", m);
  ckpt::Env::Default()->CreateDirs(tag);
  std::filesystem::create_directory_symlink(away + "/model", tag + "/model");
  ckpt::FaultEnv env(ckpt::Env::Default());
  const std::string e = ckpt::testing::ErrorOf([&] { Inspect(tag, false, &env); });
  EXPECT_NE(e.find(tag + "/model: resolves to "), std::string::npos) << e;
  EXPECT_NE(e.find("outside " + tag), std::string::npos) << e;
  for (const auto& r : env.reads()) EXPECT_EQ(r.find(away), std::string::npos) << r << " was read";
}

}  // namespace
}  // namespace shardkit
