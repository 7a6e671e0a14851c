#include "convert/converter.h"

#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>

#include "ckpt/util/error.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/util/progress.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/plain_data.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/pt/xser.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/shard/sharded_tag.h"
#include "convert/nnm_convert.h"
#include "convert/nnm_source.h"
#include "convert/nnm_state.h"

namespace convert {
namespace {

using Clock = std::chrono::steady_clock;

std::string TagDirFor(const ConverterArgs& a, const NnmSource& src, const ConvertPlan& plan) {
  // "out.ckpt/" names out.ckpt: its staging folder goes beside it, not inside.
  if (!a.nxdt_ckpt_path.empty()) return ckpt::WithoutTrailingSeparators(a.nxdt_ckpt_path);
  ckpt::TagName t;
  t.name = src.name ? src.name->name : CheckpointStem(src.file_name);
  t.step = plan.global_step;
  t.consumed_samples = plan.consumed_samples;
  t.last = src.name && src.name->last;
  return a.checkpoint_dir + "/" + ckpt::FormatTagName(t);
}

// What the optimizer state was and what is written.
std::vector<std::string> OptimizerReport(const ConvertPlan& plan, bool weights_only) {
  if (weights_only) return {"optimizer: not converted (--weights_only)"};
  if (!plan.optimizer) return {"optimizer: the input holds none; the output has none, so training resumes with a fresh optimizer"};
  return {"optimizer grouping found: " + plan.source_grouping,
          "optimizer grouping written: " + plan.target_grouping + "; train with model.do_layer_norm_weight_decay: " +
              (plan.do_layer_norm_weight_decay ? "True" : "False")};
}

void PrintPlan(const NnmSource& src, const ConvertPlan& plan, const std::string& tag_dir, bool weights_only,
               const std::function<void(const std::string&)>& log) {
  log("dry run: " + src.root + " (" + src.folders + ", tp=" + std::to_string(src.grid.tp) + " pp=" + std::to_string(src.grid.pp) +
      (src.zero1_dp() ? ", ZeRO-1 dp=" + std::to_string(src.zero1_dp()) : "") + ", file " + src.file_name + ") -> " + tag_dir);
  log("  step " + std::to_string(plan.global_step) + ", epoch " + std::to_string(plan.epoch) + ", consumed samples " +
      std::to_string(static_cast<int64_t>(plan.consumed_samples)) + ", " + std::to_string(plan.total_layers) + " layers");
  for (size_t c = 0; c < plan.layers.size(); ++c)
    for (size_t p = 0; p < plan.layers[c].size(); ++p)
      log("  stage " + std::to_string(p) + (plan.layers.size() > 1 ? " chunk " + std::to_string(c) : "") + ": " +
          std::to_string(plan.layers[c][p]) + " layers");
  uint64_t total = 0;
  for (const auto& f : plan.files) {
    log("  write " + f.file.relpath + ": " + std::to_string(f.tensors) + " tensors, " + ckpt::HumanBytes(f.bytes) + " from " + f.source);
    total += f.bytes;
  }
  for (size_t p = 0; p < plan.renames.size(); ++p)
    for (const auto& r : plan.renames[p])
      log("  rename (pp " + std::to_string(p) + ") " + r.from + " -> " + r.to);
  for (const auto& n : plan.notes) log("  note: " + n);
  for (const auto& line : OptimizerReport(plan, weights_only)) log("  " + line);
  log("  total " + std::to_string(plan.files.size()) + " files, " + ckpt::HumanBytes(total));
}

// The layers each pp rank holds as NNM's chunks lay them out: chunk c of
// stage p follows every earlier chunk of every stage (nnm_convert.cc's
// offsets), so with several chunks a rank holds several ranges (virtual
// stages). Nullopt when a chunk is empty, which a stage map cannot record.
std::optional<ckpt::StageMap> StageMapOfPlan(const ConvertPlan& plan) {
  ckpt::StageMap m(plan.grid.pp);
  int64_t first = 0;
  for (const auto& chunk : plan.layers)
    for (size_t p = 0; p < chunk.size() && p < m.size(); ++p) {
      if (chunk[p] <= 0) return std::nullopt;
      m[p].push_back({first, first + chunk[p]});
      first += chunk[p];
    }
  return m;
}

// Whether the optimizer files written hold fp32 master weights (NNM's ZeRO-1
// sharded_master_weights, carried over as they are).
bool WritesMasterWeights(const ConvertPlan& plan) {
  for (const auto& f : plan.files)
    if (f.file.relpath.starts_with("optim/") && f.file.value.is_dict() && f.file.value.as_dict().Find("sharded_master_weights")) return true;
  return false;
}

const char kFormatSources[] = "nnm2nxdt-ckpt reads the model's format from the checkpoint's hyper_parameters.cfg, else from --nnm_config "
                              "(the NNM job's YAML), --model_config (the HF config.json) or --heads/--kv_heads";

// `tag`: PlannedTag(plan), when the caller built it already.
ConvertSummary ConvertAndRelayout(const ConverterArgs& a, const NnmSource& src, ConvertPlan& plan, const std::string& tag_dir, ckpt::Env* env,
                                  const std::function<void(const std::string&)>& log, Clock::time_point t0,
                                  std::unique_ptr<ckpt::ShardedTag> tag = nullptr) {
  ConvertSummary sum;
  sum.tag_dir = tag_dir;
  sum.inputs = static_cast<int>(src.files.size() + src.zero1_files.size());
  uint64_t bytes = 0;
  for (const auto& f : plan.files) bytes += f.bytes, sum.tensors += f.tensors;
  if (!tag) try {
      tag = PlannedTag(src, plan, a.hints, {.trust_first_replica = a.trust_first_replica});
    } catch (const ckpt::FormatUnknown& e) {
      throw ckpt::Error(std::string(e.what()) + "\n(changing degrees needs the model's format: " + kFormatSources + ")");
    }
  if (a.group->rank() == 0) {
    for (const auto& n : plan.notes) log("note: " + n);  // not format_unrecorded: the manifest records the format
    for (const auto& line : OptimizerReport(plan, a.weights_only)) log(line);
    for (const auto& n : tag->format_notes()) log("note: " + n);
  }
  ckpt::ReshardArgs r;
  r.src = src.root;
  r.dst = tag_dir;
  r.tp = a.tp ? a.tp : src.grid.tp;
  r.pp = a.pp ? a.pp : src.grid.pp;
  r.pipeline_cuts = a.pipeline_cuts;
  r.keep_virtual_stages = true;  // NNM's model chunks stay NxD's virtual stages while the pipeline is kept
  r.memory_budget = a.memory_budget;
  r.threads = a.threads;
  r.dry_run = a.dry_run, r.overwrite = a.overwrite, r.weights_only = a.weights_only;
  r.save_xser = a.save_xser;
  r.hints = a.hints;
  r.trust_first_replica = a.trust_first_replica;
  r.group = a.group;
  r.progress_bar = a.progress_bar;
  r.tool = "nnm2nxdt";
  ckpt::ReshardSummary rs;
  rs.src_tag = src.root;
  rs.bytes_read = bytes;
  rs = ckpt::WriteInLayout(*tag, ckpt::WithoutTrailingSeparators(tag_dir), r, env, log, t0, rs);
  sum.files = rs.files;
  sum.bytes = rs.bytes_written;
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return sum;
}

}  // namespace

ConvertSummary RunConversion(const ConverterArgs& a, ckpt::Env* env, const std::function<void(const std::string&)>& log) {
  const auto t0 = Clock::now();
  if (a.nxdt_ckpt_path.empty() == a.checkpoint_dir.empty())
    throw ckpt::Error("give exactly one of --nxdt_ckpt_path (the output tag folder) and --checkpoint_dir (a folder to create the tag in)");
  const NnmSource src = FindNnmCheckpoint(env, a.nnm_ckpt_path, a.checkpoint_name, log);
  const bool relayout = (a.tp && a.tp != src.grid.tp) || (a.pp && a.pp != src.grid.pp) || !a.pipeline_cuts.empty();
  if (relayout && a.group->rank() == 0)
    log(a.nnm_ckpt_path + ": a tp=" + std::to_string(src.grid.tp) + " pp=" + std::to_string(src.grid.pp) + " checkpoint (" + src.folders +
        " folders); converting to tp=" + std::to_string(a.tp ? a.tp : src.grid.tp) + " pp=" + std::to_string(a.pp ? a.pp : src.grid.pp) +
        " in one pass");

  // Load every input (pickles only: tensor bytes stay mapped) in parallel.
  const std::vector<RankInput> inputs = LoadNnmInputs(env, src);
  // Planned as plain files: the engine splits xser files itself.
  const ConvertOptions opts{a.n_layers, a.weights_only, false, a.nxdt_optimizer_groups ? OptimizerGroups::kNxdt : OptimizerGroups::kKeep,
                            a.require_optimizer};
  ConvertPlan plan = PlanConversion(src, inputs, opts);
  const std::string tag_dir = TagDirFor(a, src, plan);
  ckpt::CheckOutputs({{tag_dir, a.nxdt_ckpt_path.empty() ? "--checkpoint_dir" : "--nxdt_ckpt_path", true}},
                     {{a.nnm_ckpt_path, "--nnm_ckpt_path"}});
  if (relayout) return ConvertAndRelayout(a, src, plan, tag_dir, env, log, t0);

  // At NNM's own degrees too, the engine writes the tag when the planned files
  // read as one (the model format is known, replicas are equal): the manifest
  // then records the format and every tensor's fingerprint, and model files
  // list their entries in the family's module order. Otherwise the files are
  // written as mapped, one for one, and a note says what the manifest lacks.
  // Hints the checkpoint contradicts are refused either way.
  // Only reading the view decides; an error while writing is the engine's and ends the run.
  std::unique_ptr<ckpt::ShardedTag> view;
  std::string why_mapped = "NNM's unmerged SwiGLU is merged as it is written";
  if (!GeneratedFile(plan)) {
    try {
      view = PlannedTag(src, plan, a.hints, {.trust_first_replica = a.trust_first_replica});
    } catch (const ckpt::FormatUnknown& e) {
      why_mapped = e.what();
    } catch (const ckpt::Error& e) {
      if (a.hints.Any()) throw;
      why_mapped = e.what();
    }
  }
  if (view) return ConvertAndRelayout(a, src, plan, tag_dir, env, log, t0, std::move(view));
  if (a.save_xser) {
    ConvertOptions xser = opts;
    xser.save_xser = true;
    plan = PlanConversion(src, inputs, xser);
  }
  if (!plan.format_unrecorded.empty()) plan.notes.push_back(plan.format_unrecorded);
  plan.notes.push_back("written file for file as mapped; the manifest records no model format and no fingerprints (" + why_mapped + ")");
  ConvertSummary sum;
  sum.tag_dir = tag_dir;
  sum.inputs = static_cast<int>(src.files.size() + src.zero1_files.size());
  if (a.dry_run) {
    PrintPlan(src, plan, tag_dir, a.weights_only, log);
    return sum;
  }
  const ckpt::StagedTag staged = ckpt::StageFor(tag_dir, "nnm2nxdt");
  std::unique_ptr<ckpt::FileLock> writing;  // rank 0's writer lock, until the tag is published or deleted
  if (a.group->rank() == 0) {
    for (const auto& n : plan.notes) log("note: " + n);
    for (const auto& line : OptimizerReport(plan, a.weights_only)) log(line);
    writing = ckpt::PrepareTarget(env, staged, a.overwrite, log);
  }

  const std::string save_id = ckpt::BeginStaged(env, staged, *a.group, "nnm2nxdt");

  std::vector<const PlannedFile*> planned;
  for (const auto& f : plan.files)
    if (ckpt::WritesUnit(f.unit, a.group->rank(), a.group->size())) planned.push_back(&f);
  std::stable_sort(planned.begin(), planned.end(), [](auto* x, auto* y) { return x->bytes > y->bytes; });  // big first: balance
  std::vector<ckpt::FileToWrite> mine;
  std::vector<uint64_t> tensor_bytes;  // what the progress bar counts
  for (auto* f : planned) mine.push_back(f->file), tensor_bytes.push_back(f->bytes), sum.tensors += f->tensors;
  sum.files = static_cast<int>(mine.size());
  sum.bytes = ckpt::WriteRankFilesReporting(env, staged.staging, a.group->rank(), save_id, mine, tensor_bytes, a.progress_bar, log, t0);
  ckpt::CommitInfo ci;
  ci.save_id = save_id;
  ci.step = plan.global_step;
  ci.consumed_samples = plan.consumed_samples;
  ci.grid = plan.grid;
  if (plan.optimizer)
    ci.optimizer_grouping = ckpt::NxdtGroupingRule(plan.do_layer_norm_weight_decay);
  ci.stages = StageMapOfPlan(plan);
  ci.master_weights = plan.optimizer && WritesMasterWeights(plan);
  ckpt::CommitStaged(env, staged, *a.group, ci, &writing);
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return sum;
}

}  // namespace convert
