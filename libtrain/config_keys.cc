#include "libtrain/config_keys.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "migrate/yaml_tree.h"

namespace train {
namespace {

using U = KeyUse;

constexpr std::string_view kNeuron = "a Neuron compiler or runtime setting";
constexpr std::string_view kNoValidation = "shardkit runs no validation or test";
constexpr std::string_view kManualPrecision =
    "NxDT reads it only with precision.type: manual (examples/training_orchestrator.py process_config, "
    "lightning_modules/model/base.py _initialize_nxd_config)";
constexpr std::string_view kTokenized = "the data is read tokenized; the tokenizer gives the vocabulary size only";

// Every key the 22 example configs of NxDT 9169aa0 use, the keys nnm2nxdt-config
// writes (migrate/schema.cc, and NNM's that it keeps) and shardkit's own. kRead keys are the ones
// train_config.cc reads (its Reader refuses to read any other).
const std::vector<KeyRule>& Table() {
  static const std::vector<KeyRule> table = {
      // Top level.
      {"name", U::kRead, "", {}},
      {"seed", U::kRead, "", {}},
      {"model_source", U::kRead, "", {}},
      {"compiler_flags", U::kIgnored, kNeuron, {}},
      {"compiler_cache_url", U::kIgnored, kNeuron, {}},
      {"aync_exec_max_inflight_requests", U::kIgnored, kNeuron, {}},
      {"bucket_size_collectives", U::kIgnored, kNeuron, {}},
      {"neuron_rt_exec_timeout", U::kIgnored, kNeuron, {}},
      {"neuron_experimental_compress_rg", U::kIgnored, kNeuron, {}},
      // trainer
      {"trainer.devices", U::kRead, "", {}},
      {"trainer.num_nodes", U::kRead, "", {}},
      {"trainer.max_steps", U::kRead, "", {}},
      {"trainer.log_every_n_steps", U::kRead, "", {}},
      {"trainer.gradient_clip_val", U::kRead, "", {}},
      {"trainer.max_epochs", U::kRefused, "stops training after that many epochs; shardkit stops at trainer.max_steps only", {"-1"}},
      {"trainer.lnc", U::kIgnored, "Neuron's logical core size", {}},
      {"trainer.sequential_move_factor", U::kIgnored, "how NxD moves a pipeline-parallel model onto the device", {}},
      {"trainer.check_val_every_n_epoch", U::kIgnored, kNoValidation, {}},
      {"trainer.val_check_interval", U::kIgnored, kNoValidation, {}},
      {"trainer.limit_val_batches", U::kIgnored, kNoValidation, {}},
      {"trainer.limit_test_batches", U::kIgnored, kNoValidation, {}},
      {"trainer.num_sanity_val_steps", U::kIgnored, kNoValidation, {}},
      // exp_manager
      {"exp_manager.explicit_log_dir", U::kRead, "", {}},
      {"exp_manager.exp_dir", U::kRead, "", {}},
      {"exp_manager.name", U::kRead, "", {}},
      {"exp_manager.version", U::kRead, "", {}},
      {"exp_manager.resume_if_exists", U::kRead, "", {}},
      {"exp_manager.resume_ignore_no_checkpoint", U::kRead, "", {}},
      {"exp_manager.resume_from_checkpoint", U::kRead, "", {}},
      {"exp_manager.resume_past_damaged_checkpoints", U::kRead, "", {}},  // shardkit's own
      {"exp_manager.resume_reshard", U::kRead, "", {}},                   // shardkit's own
      {"exp_manager.create_checkpoint_callback", U::kRead, "", {}},
      {"exp_manager.async_checkpointing", U::kRead, "", {}},
      {"exp_manager.save_xser", U::kRead, "", {}},
      {"exp_manager.load_xser", U::kRead, "", {}},
      {"exp_manager.log_parameter_norm", U::kRead, "", {}},
      {"exp_manager.log_gradient_norm", U::kRead, "", {}},
      {"exp_manager.checkpoint_callback_params.save_top_k", U::kRead, "", {}},
      {"exp_manager.checkpoint_callback_params.every_n_train_steps", U::kRead, "", {}},
      {"exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt", U::kRead, "", {}},
      {"exp_manager.checkpoint_callback_params.monitor", U::kRefused,
       "ranks checkpoints by another metric; shardkit keeps the save_top_k newest (monitor: step, mode: max)", {"step"}},
      {"exp_manager.checkpoint_callback_params.mode", U::kRefused,
       "ranks checkpoints another way; shardkit keeps the save_top_k newest (monitor: step, mode: max)", {"max"}},
      {"exp_manager.checkpoint_callback_params.filename", U::kIgnored,
       "tags are named <name>--step=S-consumed_samples=C.ckpt, NxDT's default", {}},
      {"exp_manager.checkpoint_callback_params.save_last", U::kIgnored, "shardkit writes no separate last tag", {"False"}},
      {"exp_manager.checkpoint_callback_params.model_parallel_size", U::kIgnored, "shardkit takes the degrees from distributed_strategy",
       {}},
      {"exp_manager.checkpoint_callback_params.always_save_nemo", U::kIgnored, "NeMo's .nemo archive; NxDT writes none", {"False"}},
      {"exp_manager.checkpoint_callback_params.save_nemo_on_train_end", U::kIgnored, "NeMo's .nemo archive; NxDT writes none",
       {"False"}},
      {"exp_manager.checkpoint_callback_params.train_time_interval", U::kIgnored,
       "checkpoints by wall-clock time; shardkit checkpoints every every_n_train_steps", {}},
      {"exp_manager.save_bf16", U::kRefused, "saves the weights as bfloat16; shardkit saves them in the dtype it trains", {"False"}},
      {"exp_manager.ckpt_ptl_version", U::kIgnored, "the Lightning version NxDT records", {}},
      {"exp_manager.create_tensorboard_logger", U::kIgnored, "shardkit logs to metrics.jsonl", {}},
      {"exp_manager.log_local_rank_0_only", U::kIgnored, "rank 0 logs for the job", {}},
      {"exp_manager.enable_recovery_time_instrumentation", U::kIgnored, "NxDT's timing instrumentation", {}},
      // distributed_strategy
      {"distributed_strategy.tensor_model_parallel_size", U::kRead, "", {}},
      {"distributed_strategy.pipeline_model_parallel_size", U::kRead, "", {}},
      {"distributed_strategy.zero1", U::kRead, "", {}},
      {"distributed_strategy.sequence_parallel", U::kRead, "", {}},
      {"distributed_strategy.kv_replicator", U::kRead, "", {}},
      // NxDT passes it to NxD's pipeline (lightning_modules/model/base.py); NNM's spelling sits under model.
      {"distributed_strategy.virtual_pipeline_model_parallel_size", U::kRead, "interleaved (virtual) pipeline stages", {},
       "distributed_strategy.pipeline_model_parallel_size"},
      {"model.virtual_pipeline_model_parallel_size", U::kRead, "interleaved (virtual) pipeline stages", {},
       "distributed_strategy.pipeline_model_parallel_size"},
      {"distributed_strategy.context_parallel_size", U::kRefused, "context parallelism (the sequence split over ranks, ring attention)",
       {"1"}},
      {"distributed_strategy.expert_model_parallel_size", U::kRead, "", {}},
      {"distributed_strategy.token_shuffle_group_size", U::kRefused, "mixture-of-experts token shuffling", {"1"}},
      // data
      {"data.micro_batch_size", U::kRead, "", {}},
      {"data.global_batch_size", U::kRead, "", {}},
      {"data.seq_length", U::kRead, "", {}},
      {"data.data_impl", U::kRead, "", {}},
      {"data.data_prefix", U::kRead, "", {}},
      {"data.tokenizer.library", U::kRead, "", {}},
      {"data.tokenizer.type", U::kRead, "", {}},
      {"data.tokenizer.vocab_file", U::kRead, "", {}},
      {"data.tokenizer.model", U::kRead, "", {}},
      {"data.tokenizer.merge_file", U::kIgnored, kTokenized, {}},
      {"data.tokenizer.delimiter", U::kIgnored, kTokenized, {}},
      {"data.tokenizer.sentencepiece_legacy", U::kIgnored, kTokenized, {}},
      {"data.tokenizer.use_fast", U::kIgnored, kTokenized, {}},
      // NxDT's HF and alignment data modules (lightning_modules/data/hf_data_module.py,
      // model_alignment_data_module.py) read train_dir: a datasets folder or JSONL.
      {"data.train_dir", U::kRefused,
       "NxDT's HF data module (a datasets folder or JSONL records); shardkit reads Megatron indexed datasets or HDF5 token files "
       "named by data.data_prefix",
       {}},
      {"data.val_dir", U::kIgnored, kNoValidation, {}},
      {"data.dev_choose_samples", U::kRefused, "trains on the first N records of NxDT's alignment data", {}},
      {"data.use_sft_style_data_module", U::kRefused, "NxDT's SFT data module (prompt-masked loss)", {"False"}},
      {"data.packing", U::kRefused, "SFT record packing", {"False"}},
      // Megatron's GPTDataset options (lightning_modules/data/datasets/gpt_dataset_patch.py).
      {"data.eod_mask_loss", U::kRefused, "masks end-of-document tokens out of the loss", {"False"}},
      {"data.reset_attention_mask", U::kRefused, "stops attention at document boundaries", {"False"}},
      {"data.reset_position_ids", U::kRefused, "restarts positions at document boundaries", {"False"}},
      {"data.no_seqlen_plus_one_input_tokens", U::kRefused, "samples seq_length tokens instead of seq_length + 1", {"False"}},
      // NNM's fine-tuning settings, which nnm2nxdt-config carries over; NxDT's megatron data module
      // reads the datasets only with fine_tuning: True, and raises on that (lightning_modules/data/megatron/data_module.py setup).
      {"data.fine_tuning", U::kRefused, "NNM's fine-tuning data path", {"False"}},
      {"data.chat", U::kRefused, "NNM's chat fine-tuning format", {"False"}},
      {"data.train_ds", U::kIgnored, "NNM's fine-tuning dataset, read only with data.fine_tuning: True", {}},
      {"data.validation_ds", U::kIgnored, "NNM's fine-tuning dataset, read only with data.fine_tuning: True", {}},
      {"data.test_ds", U::kIgnored, "NNM's fine-tuning dataset, read only with data.fine_tuning: True", {}},
      {"data.splits_string", U::kIgnored,
       "shardkit samples every document of data.data_prefix for training, in its own order, and holds none back for validation "
       "or test",
       {}},
      {"data.dataloader_type", U::kIgnored, "shardkit samples in its own seeded order (libtrain/indexed_dataset.h SampleSource)", {}},
      {"data.num_workers", U::kIgnored, "a data-loading setting", {}},
      {"data.skip_warmup", U::kIgnored, "a data-loading setting", {}},
      {"data.index_mapping_dir", U::kIgnored, "shardkit builds no index files", {}},
      {"data.validation_drop_last", U::kIgnored, kNoValidation, {}},
      {"data.pad_samples_to_global_batch_size", U::kIgnored, kNoValidation, {"False"}},
      // model
      {"model.model_config", U::kRead, "", {}},
      {"model.fuse_qkv", U::kRead, "", {}},
      {"model.qkv_linear", U::kRead, "", {}},
      {"model.num_layers", U::kRead, "", {}},
      {"model.hidden_size", U::kRead, "", {}},
      {"model.ffn_hidden_size", U::kRead, "", {}},
      {"model.num_attention_heads", U::kRead, "", {}},
      {"model.num_kv_heads", U::kRead, "", {}},
      {"model.kv_channels", U::kRead, "", {}},
      {"model.encoder_seq_length", U::kRead, "", {}},
      {"model.max_position_embeddings", U::kRead, "", {}},
      {"model.sliding_window_size", U::kRead, "", {}},
      {"model.layernorm_epsilon", U::kRead, "", {}},
      {"model.rope_theta", U::kRead, "", {}},
      {"model.position_freq_base", U::kRead, "", {}},
      {"model.rotary_percentage", U::kRead, "", {}},
      {"model.init_method_std", U::kRead, "", {}},
      {"model.use_scaled_init_method", U::kRead, "", {}},
      {"model.normalization", U::kRead, "", {}},
      {"model.activation", U::kRead, "", {}},
      {"model.position_embedding_type", U::kRead, "", {}},
      {"model.transformer_block_type", U::kRead, "", {}},
      {"model.has_bias", U::kRead, "", {}},
      {"model.share_embeddings_and_output_weights", U::kRead, "", {}},
      {"model.hidden_dropout", U::kRead, "", {}},
      {"model.attention_dropout", U::kRead, "", {}},
      {"model.ffn_dropout", U::kRead, "", {}},
      {"model.vocab_size", U::kRead, "", {}},
      {"model.make_vocab_size_divisible_by", U::kRead, "", {}},
      {"model.pipeline_cuts", U::kRead, "", {}},
      {"model.weight_init_only", U::kRead, "", {}},
      {"model.do_layer_norm_weight_decay", U::kRead, "", {}},
      {"model.apply_query_key_layer_scaling", U::kRead, "", {}},
      {"model.activations_checkpoint_granularity", U::kRead, "", {}},
      {"model.activations_checkpoint_recompute", U::kIgnored, "what the backward pass recomputes: memory, not results", {}},
      {"model.fusions", U::kIgnored, "Neuron kernels (flash, ring and fused-softmax attention) of the same attention", {}},
      {"model.use_cpu_initialization", U::kIgnored, "where NxDT initializes the weights", {}},
      {"model.persist_layer_norm", U::kIgnored, "a fused LayerNorm kernel", {}},
      {"model.transpose_nki_inputs", U::kIgnored, "an NKI kernel's input layout", {}},
      // training_orchestrator.py process_config and the models' MoE layers: NxDT's HF-style Mixtral
      // (lightning_modules/model/hf_models/mixtral_model.py _get_model) and its Megatron-style one
      // (lightning_modules/model/megatron/megatron_gpt_model.py, models/megatron/transformer.py
      // NeuronSwitchMLP) read the keys below (train_config.cc ReadMoeSettings).
      {"model.moe.num_experts", U::kRead, "", {}},
      {"model.moe.frequency", U::kRead, "", {}},
      {"model.moe.top_k", U::kRead, "", {}},
      {"model.moe.capacity_factor", U::kRead, "", {}},
      {"model.moe.normalize_top_k_affinities", U::kRead, "", {}},
      {"model.moe.output_router_logits", U::kRead, "", {}},
      {"model.moe.router_aux_loss_coef", U::kRead, "", {}},
      {"model.moe.dropout", U::kRead, "", {}},
      {"model.moe.routing_algorithm", U::kRead, "", {}},
      {"model.moe.dropless", U::kIgnored,
       "NxDT's HF Mixtral does not read it, nor does its Megatron-style model: capacity_factor decides (0 or None: no token "
       "dropped)",
       {}},
      {"model.moe.router_activation", U::kIgnored, "only NxD's RouterSinkhorn reads it; RouterTopK computes softmax", {"softmax"}},
      {"model.moe.sinkhorn_iterations", U::kIgnored, "only NxD's RouterSinkhorn reads it (routing_algorithm: sinkhorn)", {}},
      {"model.moe.sinkhorn_tol", U::kIgnored, "only NxD's RouterSinkhorn reads it (routing_algorithm: sinkhorn)", {}},
      {"model.optim.name", U::kRead,
       "an optimizer other than adamw (torch.optim.AdamW); NxDT's adamw_fp32OptState is NxD's AdamW_FP32OptimParams, HF's "
       "AdamW (epsilon after the bias correction, float64 moments)",
       {"adamw"}},
      {"model.optim.lr", U::kRead, "", {}},
      {"model.optim.weight_decay", U::kRead, "", {}},
      {"model.optim.eps", U::kRead, "", {}},
      {"model.optim.betas", U::kRead, "", {}},
      {"model.optim.capturable", U::kIgnored, "a torch optimizer switch for CUDA graphs: the same update", {}},
      {"model.optim.sched.name", U::kRead, "", {}},
      {"model.optim.sched.warmup_steps", U::kRead, "", {}},
      {"model.optim.sched.constant_steps", U::kRead, "", {}},
      {"model.optim.sched.max_steps", U::kRead, "", {}},
      {"model.optim.sched.min_lr", U::kRead, "", {}},
      // model_alignment_strategy: NxDT's training.py picks DPO/ORPO modules (lightning_modules/model/
      // base_dpo.py, base_orpo.py), SFT's prompt-masked loss and LoRA adapters (llama_model.py lora_config).
      {"model_alignment_strategy.dpo", U::kRefused, "DPO (a preference loss against a reference model)", {}},
      {"model_alignment_strategy.orpo", U::kRefused, "ORPO (an odds-ratio preference loss)", {}},
      {"model_alignment_strategy.sft", U::kRefused, "supervised fine-tuning (JSONL records, the loss on responses only)", {}},
      {"model_alignment_strategy.peft", U::kRefused, "LoRA adapters (parameter-efficient fine-tuning)", {}},
      // precision (training_orchestrator.py process_config; lightning_modules/model/base.py).
      {"precision.type", U::kRead,
       "a precision other than fp32 and mixed_precision (bfloat16 parameters, float32 master weights and moments)",
       {"fp32", "mixed_precision"}},
      {"precision.master_weights", U::kIgnored, kManualPrecision, {}},
      {"precision.fp32_grad_acc", U::kIgnored, kManualPrecision, {}},
      {"precision.xla_use_bf16", U::kIgnored, kManualPrecision, {}},
      {"precision.xla_downcast_bf16", U::kIgnored, kManualPrecision, {}},
      {"precision.neuron_rt_stochastic_rounding_en", U::kIgnored, kManualPrecision, {}},
      {"precision.fp32_grads_cc", U::kIgnored, "NxDT 9169aa0 does not read it", {}},
      {"precision.parallel_layers_reduce_dtype", U::kIgnored, "the dtype of NxD's tensor-parallel reductions; float32 here", {}},
      // NNM's keys that nnm2nxdt-config keeps where they were and NxDT does not read (migrate/migrate_test.cc).
      {"enable_checkpoint_removal_protection", U::kIgnored, "NNM's guard on checkpoint removal; NxDT does not read it", {}},
      {"model.grad_allreduce_chunk_size_mb", U::kIgnored, "an all-reduce bucket size (communication, not results)", {}},
      {"model.save_logits", U::kIgnored, "NNM's logit dumps; NxDT does not read it", {"False"}},
      {"model.save_logits_interval", U::kIgnored, "NNM's logit dumps; NxDT does not read it", {}},
      // shardkit's own
      {"shardkit.hw_backend", U::kRead, "", {}},
  };
  return table;
}

bool SameValue(const std::string& text, std::string_view want) {
  if (text.size() == want.size() &&
      std::equal(text.begin(), text.end(), want.begin(), [](char a, char b) { return std::tolower(a) == std::tolower(b); }))
    return true;
  try {  // 1 and 1.0, -1 and -1.0
    size_t used = 0, used_want = 0;
    const std::string w(want);
    const double a = std::stod(text, &used), b = std::stod(w, &used_want);
    return used == text.size() && used_want == w.size() && a == b;
  } catch (const std::exception&) {
    return false;
  }
}

// Null, an empty mapping or a mapping of unset values: NxDT reads each as unset.
bool Unset(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return true;
  if (!n.IsMap()) return false;
  for (const auto& kv : n)
    if (!Unset(kv.second)) return false;
  return true;
}

std::string Shown(const YAML::Node& n) { return n.IsScalar() ? n.Scalar() : migrate::Describe(n); }

// A number above 1 (NxDT's and Megatron's degrees; an unset key is 1).
bool AboveOne(const YAML::Node& n) {
  if (!n.IsDefined() || !n.IsScalar()) return false;
  try {
    return std::stod(n.Scalar()) > 1;
  } catch (const std::exception&) {
    return false;
  }
}

// Whether the other key the rule names (walked_when) holds its value.
bool WalkedInto(const YAML::Node& root, const KeyRule& rule) {
  if (rule.walked_when.empty()) return false;
  const std::string_view when = rule.walked_when;
  const size_t eq = when.find('=');
  const YAML::Node other = migrate::Find(root, std::string(when.substr(0, eq)));
  return other.IsDefined() && other.IsScalar() && SameValue(other.Scalar(), when.substr(eq + 1));
}

// A key with a rule is judged whole (a section's keys with it); a mapping
// without one is walked into.
void Walk(const YAML::Node& root, const YAML::Node& node, const std::string& path, KeyCheck& out) {
  if (Unset(node)) return;
  const KeyRule* rule = path.empty() ? nullptr : FindKeyRule(path);
  if (rule && node.IsMap() && WalkedInto(root, *rule)) rule = nullptr;
  if (!rule && node.IsMap()) {
    for (const auto& kv : node) Walk(root, kv.second, path.empty() ? kv.first.Scalar() : path + "." + kv.first.Scalar(), out);
    return;
  }
  if (!rule) {
    out.refused.push_back(path + ": not a key shardkit knows (NxDT's example configs, docs/commands.md); shardkit does not "
                                 "implement it");
    return;
  }
  const bool listed = std::any_of(rule->values.begin(), rule->values.end(),
                                  [&](std::string_view v) { return node.IsScalar() && SameValue(node.Scalar(), v); });
  const std::string why(rule->why);
  switch (rule->use) {
    case U::kRead:
      if (!rule->values.empty() && !listed)
        out.refused.push_back(path + ": '" + Shown(node) + "': " + why + "; shardkit does not implement it");
      else if (!rule->needs_above_one.empty() && AboveOne(node) && !AboveOne(migrate::Find(root, std::string(rule->needs_above_one))))
        out.refused.push_back(path + ": " + Shown(node) + ": " + why + "; shardkit does not implement it without " +
                              std::string(rule->needs_above_one) + " above 1");
      return;
    case U::kIgnored:
      if (!listed) out.ignored.push_back(path + " (" + why + ")");
      return;
    case U::kRefused:
      if (!listed) out.refused.push_back(path + (node.IsMap() ? "" : ": " + Shown(node)) + ": " + why + "; shardkit does not implement it");
      return;
  }
}

}  // namespace

const KeyRule* FindKeyRule(std::string_view dotted) {
  for (const KeyRule& r : Table())
    if (r.key == dotted) return &r;
  return nullptr;
}

KeyCheck CheckConfigKeys(const YAML::Node& root) {
  KeyCheck out;
  Walk(root, root, "", out);
  return out;
}

}  // namespace train
