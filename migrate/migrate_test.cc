#include "migrate/migrate.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "migrate/overrides.h"
#include "migrate/schema.h"

namespace migrate {
namespace {

std::string ReadFile(const std::string& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string Data(const std::string& rel) { return std::string(SHARDKIT_TEST_DATA) + "/" + rel; }

std::vector<Override> RecipeOverrides() {
  std::vector<Override> out;
  std::istringstream in(ReadFile(Data("nnm_llama_7b_overrides.txt")));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') out.push_back(ParseOverride(line));
  return out;
}

// The environment test_llama.sh exports.
const std::map<std::string, std::string> kRecipeEnv = {
    {"XLA_USE_BF16", "1"},
    {"NEURON_RT_STOCHASTIC_ROUNDING_EN", "1"},
    {"NEURON_CC_FLAGS", "--model-type transformer --distribution-strategy=nemo --cache_dir=/root/neuron_cache/llama/host"},
    {"NEURON_RT_EXEC_TIMEOUT", "10"},
    {"NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS", "3"},
};

Migration Migrate7B() {
  YAML::Node nnm = LoadYaml(ReadFile(Data("configs/megatron_llama_config.yaml")), "megatron_llama_config.yaml");
  ApplyOverrides(nnm, RecipeOverrides());
  return Migrate(nnm, {.env = kRecipeEnv});
}

std::set<std::string> KeyTree(const YAML::Node& n) {
  std::vector<std::string> leaves;
  Leaves(n, "", &leaves);
  return {leaves.begin(), leaves.end()};
}

const ReportEntry* EntryFor(const Report& r, const std::string& key) {
  for (const auto& e : r.entries)
    if (e.key == key) return &e;
  return nullptr;
}

// The NNM example with NNM's 7B recipe overrides becomes NxDT's 7B config's
// key tree, apart from the keys listed here with the reason for each.
TEST(Migrate, Llama7BRecipeMatchesNxdtsLlama7BKeyTree) {
  const Migration m = Migrate7B();
  const auto ours = KeyTree(m.config);
  const auto nxdt = KeyTree(LoadYaml(ReadFile(Data("configs/megatron_llama_7B_config.yaml")), "nxdt.yaml"));
  const std::map<std::string, std::string> only_ours = {
      // NNM's fine-tuning dataloader settings live under data in NNM too; NxDT's
      // pretraining example has none, the migration keeps them (moved) for users who fine-tune.
      {"data.chat", "NNM fine-tuning setting"},
      {"data.fine_tuning", "NNM fine-tuning setting"},
      {"data.train_ds.*", "NNM fine-tuning dataset"},
      {"data.validation_ds.*", "NNM fine-tuning dataset"},
      {"data.test_ds.*", "NNM fine-tuning dataset"},
      // Lightning checkpoint-callback options NxDT passes through; the recipe adds train_time_interval.
      {"exp_manager.checkpoint_callback_params.always_save_nemo", "NeMo callback option in NNM's config"},
      {"exp_manager.checkpoint_callback_params.save_nemo_on_train_end", "NeMo callback option in NNM's config"},
      {"exp_manager.checkpoint_callback_params.train_time_interval", "added by the 7B recipe's override"},
      // In neither the mapping table nor NxDT's schema: kept in place with a warning.
      {"enable_checkpoint_removal_protection", "unknown to NxDT; warned"},
      {"model.grad_allreduce_chunk_size_mb", "unknown to NxDT; warned"},
  };
  const std::map<std::string, std::string> only_nxdt = {
      // Neuron runtime settings the 7B recipe's environment does not set
      // (compiler flags, cache, exec timeout and inflight requests come from it).
      {"bucket_size_collectives", "not set by the NNM recipe; NxDT's default applies"},
      {"neuron_experimental_compress_rg", "not set by the NNM recipe; NxDT's default applies"},
      // NxDT-only settings with no NNM counterpart: NxDT's defaults apply.
      {"exp_manager.checkpoint_callback_params.every_n_train_steps", "NxDT-only; default applies"},
      {"exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt", "NxDT-only; default applies"},
      {"exp_manager.save_bf16", "NxDT-only; default applies"},
      {"model.fusions.flash_attention", "NxDT-only (NKI kernel); default applies"},
      {"model.num_kv_heads", "NNM's Llama had no GQA; NxDT defaults it to num_attention_heads"},
      {"trainer.check_val_every_n_epoch", "NxDT-only; default applies"},
      {"trainer.num_sanity_val_steps", "NxDT-only; default applies"},
      // The recipe selects full checkpointing; NxDT's example uses selective.
      {"model.activations_checkpoint_recompute", "only with selective granularity; the 7B recipe uses full"},
  };
  auto listed = [](const std::map<std::string, std::string>& allowed, const std::string& key) {
    for (const auto& [k, why] : allowed)
      if (k == key || (k.ends_with(".*") && key.rfind(k.substr(0, k.size() - 1), 0) == 0)) return true;
    return false;
  };
  std::set<std::string> matched_ours, matched_nxdt;
  for (const auto& k : ours)
    if (!nxdt.count(k)) {
      EXPECT_TRUE(listed(only_ours, k)) << "only in the migrated config: " << k;
      matched_ours.insert(k);
    }
  for (const auto& k : nxdt)
    if (!ours.count(k)) {
      EXPECT_TRUE(listed(only_nxdt, k)) << "only in NxDT's config: " << k;
      matched_nxdt.insert(k);
    }
  for (const auto& [k, why] : only_nxdt) EXPECT_TRUE(matched_nxdt.count(k)) << "listed but not different: " << k;
  EXPECT_TRUE(m.report.check_problems.empty()) << m.report.check_problems[0];
}

TEST(Migrate, RecipeValuesLandWhereNxdtWantsThem) {
  const Migration m = Migrate7B();
  const auto& c = m.config;
  EXPECT_EQ(Find(c, "model_source").Scalar(), "megatron");
  EXPECT_EQ(Find(c, "seed").Scalar(), "1234");
  EXPECT_EQ(Find(c, "distributed_strategy.tensor_model_parallel_size").Scalar(), "8");
  EXPECT_EQ(Find(c, "distributed_strategy.zero1").Scalar(), "False");
  EXPECT_EQ(Find(c, "data.global_batch_size").Scalar(), "256");
  EXPECT_EQ(Find(c, "data.tokenizer.type").Scalar(), "/root/scripts/example_datasets/llamav2_weights/7b-hf");
  EXPECT_EQ(Describe(Find(c, "data.data_prefix")), "[1.0, /root/scripts/data/books/book.jsonl-processed_text_document]");
  EXPECT_EQ(Find(c, "exp_manager.save_xser").Scalar(), "False");  // the recipe's +model.save_xser=False
  EXPECT_EQ(Find(c, "model.fusions.softmax").Scalar(), "False");  // masked_softmax_fusion
  EXPECT_EQ(Find(c, "exp_manager.log_parameter_norm").Scalar(), "True");
  EXPECT_EQ(Find(c, "precision.type").Scalar(), "bf16SR");  // XLA_USE_BF16=1 + stochastic rounding, no master weights
  EXPECT_EQ(Find(c, "compiler_flags").Scalar(), "--model-type transformer --distribution-strategy=nemo");
  EXPECT_EQ(Find(c, "compiler_cache_url").Scalar(), "/root/neuron_cache/llama/host");
  EXPECT_EQ(Find(c, "neuron_rt_exec_timeout").Scalar(), "10");
  EXPECT_EQ(Find(c, "aync_exec_max_inflight_requests").Scalar(), "3");
  EXPECT_EQ(Find(c, "exp_manager.checkpoint_callback_params.model_parallel_size").Scalar(),
            "${multiply:${distributed_strategy.tensor_model_parallel_size}, ${distributed_strategy.pipeline_model_parallel_size}}");
  // Types survive: a float written 3.0e-4 keeps its text; quoted strings stay quoted; null stays null.
  EXPECT_EQ(Find(c, "model.optim.lr").Scalar(), "3.0e-4");
  EXPECT_TRUE(IsQuoted(Find(c, "model.normalization")));
  EXPECT_TRUE(Find(c, "trainer.max_epochs").IsNull());
  EXPECT_TRUE(Find(c, "model.optim.betas").IsSequence());
  // Every input key has a fate.
  std::vector<std::string> leaves;
  YAML::Node nnm = LoadYaml(ReadFile(Data("configs/megatron_llama_config.yaml")), "x");
  ApplyOverrides(nnm, RecipeOverrides());
  Leaves(nnm, "", &leaves);
  for (const auto& l : leaves) EXPECT_NE(EntryFor(m.report, l), nullptr) << l;
}

TEST(Migrate, InterpolationsFollowTheirTargets) {
  const Migration m = Migrate(LoadYaml(ReadFile(Data("configs/megatron_llama_config.yaml")), "x"), {});
  const auto& c = m.config;
  EXPECT_EQ(Find(c, "model.max_position_embeddings").Scalar(), "${.encoder_seq_length}");  // still siblings
  EXPECT_EQ(Find(c, "data.seq_length").Scalar(), "${model.encoder_seq_length}");
  EXPECT_EQ(Find(c, "data.train_ds.global_batch_size").Scalar(), "${data.global_batch_size}");
  EXPECT_EQ(Find(c, "data.validation_ds.memmap_workers").Scalar(), "${data.train_ds.memmap_workers}");
  const ReportEntry* e = EntryFor(m.report, "model.data.train_ds.micro_batch_size");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->fate, "changed");
  EXPECT_EQ(e->from_value, "${model.micro_batch_size}");
  EXPECT_EQ(e->to_value, "${data.micro_batch_size}");
  // A reference to a dropped key is resolved to its value, keeping the type.
  YAML::Node nnm = LoadYaml("model:\n  hysteresis: 2\n  x: ${model.hysteresis}\n  y: n${.hysteresis}\n", "h.yaml");
  const Migration h = Migrate(nnm, {});
  EXPECT_EQ(Find(h.config, "model.x").Scalar(), "2");
  EXPECT_FALSE(IsQuoted(Find(h.config, "model.x")));
  EXPECT_EQ(Find(h.config, "model.y").Scalar(), "n2");
}

TEST(Migrate, InterpolationPointingNowhereIsNamed) {
  YAML::Node nnm = LoadYaml("trainer:\n  devices: 1\nmodel:\n  a: ${model.missing}\n", "bad.yaml");
  try {
    Migrate(nnm, {.source = "bad.yaml"});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "bad.yaml:4: key 'model.a': interpolation '${model.missing}' points to 'model.missing', which is not in the config");
  }
}

TEST(Migrate, OverridesApplyBeforeMigration) {
  YAML::Node nnm = LoadYaml(ReadFile(Data("configs/megatron_llama_config.yaml")), "x");
  ApplyOverrides(nnm, {ParseOverride("model.tensor_model_parallel_size=4"), ParseOverride("~model.optim.sched"),
                       ParseOverride("+model.load_xser=True")});
  const Migration m = Migrate(nnm, {});
  EXPECT_EQ(Find(m.config, "distributed_strategy.tensor_model_parallel_size").Scalar(), "4");
  EXPECT_FALSE(Has(m.config, "model.optim.sched"));
  EXPECT_EQ(Find(m.config, "exp_manager.load_xser").Scalar(), "True");
}

TEST(Migrate, PrecisionFollowsNnmSettingsAndEnvironment) {
  auto type = [](const std::string& yaml, std::map<std::string, std::string> env) {
    return Find(Migrate(LoadYaml(yaml, "p"), {.env = env}).config, "precision.type").Scalar();
  };
  const std::map<std::string, std::string> bf16_sr = {{"XLA_USE_BF16", "1"}, {"NEURON_RT_STOCHASTIC_ROUNDING_EN", "1"}};
  const std::map<std::string, std::string> bf16 = {{"XLA_USE_BF16", "1"}, {"NEURON_RT_STOCHASTIC_ROUNDING_EN", "0"}};
  const std::map<std::string, std::string> fp32 = {{"XLA_USE_BF16", "0"}, {"NEURON_RT_STOCHASTIC_ROUNDING_EN", "0"}};
  EXPECT_EQ(type("trainer: {precision: 32}\n", bf16_sr), "bf16SR");
  EXPECT_EQ(type("trainer: {precision: 32}\n", fp32), "fp32");
  EXPECT_EQ(type("trainer: {precision: bf16}\n", fp32), "autocast");
  EXPECT_EQ(type("model: {megatron_amp_O2: True}\n", bf16), "mixed_precision");
  EXPECT_EQ(type("model: {zero_use_master_weight: True, zero_use_fp32_grad_accum: True}\n", bf16_sr), "mixed_precisionSR");
  YAML::Node manual = Migrate(LoadYaml("model: {zero_use_master_weight: True}\n", "p"), {.env = bf16}).config;
  EXPECT_EQ(Find(manual, "precision.type").Scalar(), "manual");
  EXPECT_EQ(Find(manual, "precision.master_weights").Scalar(), "True");
  EXPECT_EQ(Find(manual, "precision.fp32_grad_acc").Scalar(), "False");
}

// NxDT's megatron models decay every norm weight (NeMo v2.1.0's rule over NxD's
// norms), whatever do_layer_norm_weight_decay says: the value is kept, and a
// LayerNorm model, whose norm weights NNM did not decay, is warned about.
TEST(Migrate, NormWeightDecayIsKeptAndLayerNormModelsAreWarned) {
  auto migrate = [](const std::string& model) {
    return Migrate(LoadYaml("model:\n" + model, "inline.yaml"), {.env = kRecipeEnv});
  };
  auto value = [](const Migration& m) { return Find(m.config, "model.do_layer_norm_weight_decay").Scalar(); };
  auto warned = [](const Migration& m) {
    for (const auto& w : m.report.warnings)
      if (w.find("NNM did not decay LayerNorm weights") != std::string::npos) return true;
    return false;
  };
  const Migration rms = migrate("  normalization: rmsnorm\n  do_layer_norm_weight_decay: False\n");
  EXPECT_EQ(value(rms), "False");
  EXPECT_EQ(EntryFor(rms.report, "model.do_layer_norm_weight_decay")->fate, "kept");
  EXPECT_FALSE(warned(rms));
  const Migration ln = migrate("  normalization: layernorm\n  do_layer_norm_weight_decay: False\n");
  EXPECT_EQ(value(ln), "False");
  EXPECT_EQ(EntryFor(ln.report, "model.do_layer_norm_weight_decay")->fate, "kept");
  EXPECT_TRUE(warned(ln));
  EXPECT_TRUE(warned(migrate("  hidden_size: 64\n")));  // NNM's default normalization is layernorm
}

TEST(Migrate, OutputIsByteStable) {
  const std::string a = EmitYaml(Migrate7B().config), b = EmitYaml(Migrate7B().config);
  EXPECT_EQ(a, b);
  EXPECT_EQ(EmitYaml(LoadYaml(a, "again")), a);  // reads back to the same text
}

// One test per row of NxDT's mapping table; the expectations are written out
// from the table by hand, not computed.
struct RowExpectation {
  const char* fate;  // kept | moved | dropped
  const char* to;    // for moved
};

const std::map<std::string, RowExpectation>& Expected() {
  static const std::map<std::string, RowExpectation> e = [] {
    std::map<std::string, RowExpectation> m;
    for (const char* k : {"name", "trainer.devices", "trainer.num_nodes", "trainer.max_epochs", "trainer.max_steps",
                          "trainer.log_every_n_steps", "trainer.val_check_interval", "trainer.limit_val_batches",
                          "trainer.limit_test_batches", "trainer.gradient_clip_val", "exp_manager.log_local_rank_0_only",
                          "exp_manager.create_tensorboard_logger", "exp_manager.explicit_log_dir", "exp_manager.exp_dir",
                          "exp_manager.name", "exp_manager.resume_if_exists", "exp_manager.resume_ignore_no_checkpoint",
                          "exp_manager.create_checkpoint_callback", "exp_manager.checkpoint_callback_params",
                          "model.encoder_seq_length", "model.max_position_embeddings", "model.make_vocab_size_divisible_by",
                          "model.persist_layer_norm", "model.share_embeddings_and_output_weights",
                          "model.position_embedding_type", "model.rotary_percentage", "model.transformer_block_type",
                          "model.has_bias", "model.use_cpu_initialization", "model.activations_checkpoint_granularity",
                          "model.optim"})
      m[k] = {"kept", ""};
    const std::pair<const char*, const char*> moves[] = {
        {"model.tensor_model_parallel_size", "distributed_strategy.tensor_model_parallel_size"},
        {"model.pipeline_model_parallel_size", "distributed_strategy.pipeline_model_parallel_size"},
        {"model.virtual_pipeline_model_parallel_size", "distributed_strategy.virtual_pipeline_model_parallel_size"},
        {"model.sequence_parallel", "distributed_strategy.sequence_parallel"},
        {"model.wrap_with_zero", "distributed_strategy.zero1"},
        {"model.micro_batch_size", "data.micro_batch_size"},
        {"model.global_batch_size", "data.global_batch_size"},
        {"model.tokenizer", "data.tokenizer"},
        {"model.data", "data"},
        {"model.masked_softmax_fusion", "model.fusions.softmax"},
        {"model.seed", "seed"},
        {"model.resume_from_checkpoint", "exp_manager.resume_from_checkpoint"},
        {"model.log_parameter_norm", "exp_manager.log_parameter_norm"},  // the table's typo, corrected
        {"model.log_gradient_norm", "exp_manager.log_gradient_norm"},
        {"model.enable_recovery_time_instrumentation", "exp_manager.enable_recovery_time_instrumentation"},
        {"model.async_checkpointing", "exp_manager.async_checkpointing"},
    };
    for (const auto& [k, to] : moves) m[k] = {"moved", to};
    for (const char* k : {"restore_from_path", "trainer.accelerator", "trainer.precision", "trainer.logger",
                          "trainer.enable_checkpointing", "trainer.replace_sampler_ddp", "trainer.accumulate_grad_batches",
                          "trainer.benchmark", "trainer.enable_model_summary", "exp_manager.create_wandb_logger",
                          "exp_manager.wandb_logger_kwargs", "model.pre_process", "model.post_process",
                          "model.native_amp_init_scale", "model.native_amp_growth_interval", "model.hysteresis",
                          "model.fp32_residual_connection", "model.fp16_lm_cross_entropy", "model.megatron_amp_O2",
                          "model.grad_div_ar_fusion", "model.gradient_accumulation_fusion", "model.bias_activation_fusion",
                          "model.bias_dropout_add_fusion", "model.onnx_safe", "model.apex_transformer_log_level",
                          "model.gradient_as_bucket_view", "model.sync_batch_comm", "model.flexible_pipeline_parallel_stages",
                          "model.activations_checkpoint_method", "model.activations_checkpoint_num_layers",
                          "model.num_micro_batches_with_partial_activation_checkpoints",
                          "model.activations_checkpoint_layers_per_pipeline", "model.disable_layer_norm_checkpointing",
                          "model.zero_use_master_weight", "model.zero_use_fp32_grad_accum", "model.transformer_engine",
                          "model.fp8", "model.fp8_e4m3", "model.fp8_hybrid", "model.fp8_margin", "model.use_emha",
                          "model.convert_to_hf", "model.nsys_profile"})
      m[k] = {"dropped", ""};
    return m;
  }();
  return e;
}

class MappingRowTest : public ::testing::TestWithParam<size_t> {};

TEST_P(MappingRowTest, RowIsApplied) {
  const MappingRow& row = MappingTable().at(GetParam());
  const std::string path = row.section.empty() ? row.key : row.section + "." + row.key;
  auto it = Expected().find(path);
  ASSERT_NE(it, Expected().end()) << "no expectation for table row " << path;
  // A config holding just this key (a mapping gets one child) with a telltale value.
  YAML::Node nnm(YAML::NodeType::Map);
  const bool is_map = path == "model.data" || path == "model.tokenizer" || path == "model.optim" ||
                      path == "exp_manager.checkpoint_callback_params" || path == "exp_manager.wandb_logger_kwargs" ||
                      path == "model.nsys_profile";
  const std::string leaf = is_map ? path + ".probe" : path;
  Set(nnm, leaf, YAML::Load("'telltale'"));
  const Migration m = Migrate(nnm, {.env = {{"XLA_USE_BF16", "1"}, {"NEURON_RT_STOCHASTIC_ROUNDING_EN", "1"}}});
  const ReportEntry* e = EntryFor(m.report, leaf);
  ASSERT_TRUE(e) << leaf;
  EXPECT_EQ(e->fate, std::string(it->second.fate)) << e->reason;
  if (std::string(it->second.fate) == "moved") {
    const std::string to = std::string(it->second.to) + (is_map ? ".probe" : "");
    EXPECT_EQ(e->to, to);
    EXPECT_EQ(Find(m.config, to).Scalar(), "telltale");
  } else if (std::string(it->second.fate) == "kept") {
    EXPECT_EQ(Find(m.config, leaf).Scalar(), "telltale");
  } else {
    EXPECT_FALSE(Has(m.config, leaf));
    // The reason quotes the table.
    EXPECT_NE(e->reason.find(row.mapping == "Supported via precision config" || row.mapping.rfind("replaced by", 0) == 0
                                 ? "precision" : row.mapping),
              std::string::npos) << e->reason;
    if (!row.comment.empty()) {
      EXPECT_NE(e->reason.find(row.comment), std::string::npos) << e->reason;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Table, MappingRowTest, ::testing::Range<size_t>(0, MappingTable().size()),
                         [](const ::testing::TestParamInfo<size_t>& i) {
                           const MappingRow& r = MappingTable().at(i.param);
                           std::string n = (r.section.empty() ? "top" : r.section) + "_" + r.key;
                           for (char& c : n) {
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return n;
                         });

TEST(MappingTable, HasTheRowsNxdtPublishes) {
  // 93 lines: 90 key rows under three section headings (trainer, exp_manager, model).
  EXPECT_EQ(MappingTable().size(), 90u);
  EXPECT_EQ(Expected().size(), 90u);
}

}  // namespace
}  // namespace migrate
