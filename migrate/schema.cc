#include "migrate/schema.h"

#include <map>

#include "migrate/mapping_csv.h"  // generated: kMappingCsv

namespace migrate {
namespace {

// RFC 4180 fields: quoted fields may hold commas and doubled quotes.
std::vector<std::vector<std::string>> ParseCsv(const std::string& text) {
  std::vector<std::vector<std::string>> rows(1);
  std::string field;
  bool quoted = false;
  size_t i = text.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;  // byte-order mark
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') field += '"', ++i;
      else if (c == '"') quoted = false;
      else field += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      rows.back().push_back(field), field.clear();
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      rows.back().push_back(field), field.clear();
      rows.emplace_back();
    } else {
      field += c;
    }
  }
  if (!field.empty() || !rows.back().empty()) rows.back().push_back(field);
  if (rows.back().empty()) rows.pop_back();
  return rows;
}

}  // namespace

const std::vector<MappingRow>& MappingTable() {
  static const std::vector<MappingRow> rows = [] {
    std::vector<MappingRow> out;
    std::string section;
    bool header = true;
    for (auto& r : ParseCsv(kMappingCsv)) {
      if (header) {
        header = false;
        continue;
      }
      r.resize(3);
      if (r[0].rfind("**", 0) == 0) {  // **trainer** opens a section
        section = r[0].substr(2, r[0].size() - 4);
        continue;
      }
      if (r[0].empty()) continue;
      out.push_back({section, r[0], r[1], r[2]});
    }
    return out;
  }();
  return rows;
}

const std::vector<std::string>& NxdtSectionOrder() {
  static const std::vector<std::string> order = {"name", "model_source", "seed", "trainer", "exp_manager",
                                                 "distributed_strategy", "data", "model", "precision"};
  return order;
}

const std::vector<SchemaKey>& NxdtSchema() {
  using T = ValueType;
  // From NxDT's reference configs (megatron_llama_7B, megatron_gpt, hf_llama_7B).
  static const std::vector<SchemaKey> keys = {
      {"name", T::kString, false},
      {"model_source", T::kString, false},
      {"seed", T::kInt, false},
      {"trainer", T::kMap, false},
      {"trainer.devices", T::kInt, false},
      {"trainer.num_nodes", T::kInt, false},
      {"trainer.max_epochs", T::kInt, true},
      {"trainer.max_steps", T::kInt, false},
      {"trainer.log_every_n_steps", T::kInt, false},
      {"trainer.val_check_interval", T::kNumber, true},
      {"trainer.check_val_every_n_epoch", T::kInt, true},
      {"trainer.num_sanity_val_steps", T::kInt, false},
      {"trainer.limit_val_batches", T::kNumber, false},
      {"trainer.limit_test_batches", T::kNumber, false},
      {"trainer.gradient_clip_val", T::kNumber, true},
      {"exp_manager", T::kMap, false},
      {"exp_manager.log_local_rank_0_only", T::kBool, false},
      {"exp_manager.create_tensorboard_logger", T::kBool, false},
      {"exp_manager.explicit_log_dir", T::kString, true},
      {"exp_manager.exp_dir", T::kString, true},
      {"exp_manager.name", T::kString, true},
      {"exp_manager.resume_if_exists", T::kBool, false},
      {"exp_manager.resume_ignore_no_checkpoint", T::kBool, false},
      {"exp_manager.create_checkpoint_callback", T::kBool, false},
      {"exp_manager.checkpoint_callback_params", T::kMap, false},
      {"exp_manager.checkpoint_callback_params.monitor", T::kString, false},
      {"exp_manager.checkpoint_callback_params.save_top_k", T::kInt, false},
      {"exp_manager.checkpoint_callback_params.mode", T::kString, false},
      {"exp_manager.checkpoint_callback_params.save_last", T::kBool, false},
      {"exp_manager.checkpoint_callback_params.filename", T::kString, false},
      {"exp_manager.checkpoint_callback_params.model_parallel_size", T::kInt, false},
      {"exp_manager.checkpoint_callback_params.every_n_train_steps", T::kInt, true},
      {"exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt", T::kBool, false},
      {"exp_manager.log_parameter_norm", T::kBool, false},
      {"exp_manager.log_gradient_norm", T::kBool, false},
      {"exp_manager.enable_recovery_time_instrumentation", T::kBool, false},
      {"exp_manager.save_xser", T::kBool, false},
      {"exp_manager.load_xser", T::kBool, false},
      {"exp_manager.save_bf16", T::kBool, false},
      {"exp_manager.async_checkpointing", T::kBool, false},
      {"exp_manager.resume_from_checkpoint", T::kString, true},
      {"distributed_strategy", T::kMap, false},
      {"distributed_strategy.tensor_model_parallel_size", T::kInt, false},
      {"distributed_strategy.pipeline_model_parallel_size", T::kInt, false},
      {"distributed_strategy.virtual_pipeline_model_parallel_size", T::kInt, true},
      {"distributed_strategy.zero1", T::kBool, false},
      {"distributed_strategy.sequence_parallel", T::kBool, false},
      {"distributed_strategy.kv_replicator", T::kInt, false},
      {"data", T::kMap, false},
      {"data.micro_batch_size", T::kInt, false},
      {"data.global_batch_size", T::kInt, false},
      {"data.data_prefix", T::kAny, false},
      {"data.index_mapping_dir", T::kString, true},
      {"data.data_impl", T::kString, false},
      {"data.splits_string", T::kString, false},
      {"data.seq_length", T::kInt, false},
      {"data.skip_warmup", T::kBool, false},
      {"data.num_workers", T::kInt, false},
      {"data.dataloader_type", T::kString, false},
      {"data.reset_position_ids", T::kBool, false},
      {"data.reset_attention_mask", T::kBool, false},
      {"data.eod_mask_loss", T::kBool, false},
      {"data.validation_drop_last", T::kBool, false},
      {"data.no_seqlen_plus_one_input_tokens", T::kBool, false},
      {"data.pad_samples_to_global_batch_size", T::kBool, false},
      {"data.tokenizer", T::kMap, false},
      {"data.tokenizer.library", T::kString, false},
      {"data.tokenizer.type", T::kString, false},
      {"data.tokenizer.model", T::kString, true},
      {"data.tokenizer.vocab_file", T::kString, true},
      {"data.tokenizer.merge_file", T::kString, true},
      {"data.tokenizer.delimiter", T::kString, true},
      {"data.tokenizer.sentencepiece_legacy", T::kBool, false},
      {"data.tokenizer.use_fast", T::kBool, false},
      {"model", T::kMap, false},
      {"model.encoder_seq_length", T::kInt, false},
      {"model.max_position_embeddings", T::kInt, false},
      {"model.num_layers", T::kInt, false},
      {"model.hidden_size", T::kInt, false},
      {"model.ffn_hidden_size", T::kInt, false},
      {"model.num_attention_heads", T::kInt, false},
      {"model.num_kv_heads", T::kInt, true},
      {"model.init_method_std", T::kNumber, false},
      {"model.use_scaled_init_method", T::kBool, false},
      {"model.hidden_dropout", T::kNumber, false},
      {"model.attention_dropout", T::kNumber, false},
      {"model.ffn_dropout", T::kNumber, false},
      {"model.kv_channels", T::kInt, true},
      {"model.apply_query_key_layer_scaling", T::kBool, false},
      {"model.normalization", T::kString, false},
      {"model.layernorm_epsilon", T::kNumber, false},
      {"model.do_layer_norm_weight_decay", T::kBool, false},
      {"model.make_vocab_size_divisible_by", T::kInt, false},
      {"model.persist_layer_norm", T::kBool, false},
      {"model.share_embeddings_and_output_weights", T::kBool, false},
      {"model.position_embedding_type", T::kString, false},
      {"model.rotary_percentage", T::kNumber, false},
      {"model.rope_theta", T::kNumber, false},
      // In no reference config, but read by NxDT's megatron models as the rotary base
      // (NxDT models/megatron/megatron_gpt_model.py); NNM has the same key (transformer.py).
      {"model.position_freq_base", T::kNumber, false},
      {"model.activation", T::kString, false},
      {"model.transformer_block_type", T::kString, false},
      {"model.has_bias", T::kBool, false},
      {"model.use_cpu_initialization", T::kBool, false},
      {"model.pipeline_cuts", T::kList, true},
      {"model.activations_checkpoint_granularity", T::kString, true},
      {"model.activations_checkpoint_recompute", T::kList, false},
      {"model.fusions", T::kMap, false},
      {"model.fusions.softmax", T::kBool, false},
      {"model.fusions.flash_attention", T::kBool, false},
      {"model.optim", T::kMap, false},
      {"model.optim.name", T::kString, false},
      {"model.optim.lr", T::kNumber, false},
      {"model.optim.weight_decay", T::kNumber, false},
      {"model.optim.capturable", T::kBool, false},
      {"model.optim.betas", T::kList, false},
      {"model.optim.sched", T::kMap, false},
      {"model.optim.sched.name", T::kString, false},
      {"model.optim.sched.warmup_steps", T::kInt, false},
      {"model.optim.sched.constant_steps", T::kInt, false},
      {"model.optim.sched.min_lr", T::kNumber, false},
      {"model.optim.sched.max_steps", T::kInt, false},
      {"precision", T::kMap, false},
      {"precision.type", T::kString, false},
      {"precision.master_weights", T::kBool, false},
      {"precision.fp32_grad_acc", T::kBool, false},
      {"precision.xla_use_bf16", T::kString, false},
      {"precision.xla_downcast_bf16", T::kString, false},
      {"precision.neuron_rt_stochastic_rounding_en", T::kString, false},
      {"compiler_flags", T::kString, false},
      {"compiler_cache_url", T::kString, false},
      {"aync_exec_max_inflight_requests", T::kInt, false},
      {"bucket_size_collectives", T::kInt, false},
      {"neuron_rt_exec_timeout", T::kInt, false},
      {"neuron_experimental_compress_rg", T::kBool, false},
  };
  return keys;
}

std::optional<SchemaKey> NxdtKey(const std::string& path) {
  for (const auto& k : NxdtSchema())
    if (k.path == path) return k;
  return std::nullopt;
}

int NxdtOrder(const std::string& path) {
  static const std::map<std::string, int> index = [] {
    std::map<std::string, int> m;
    for (size_t i = 0; i < NxdtSchema().size(); ++i) m[NxdtSchema()[i].path] = static_cast<int>(i);
    return m;
  }();
  auto it = index.find(path);
  return it == index.end() ? -1 : it->second;
}

}  // namespace migrate
