#include "convert/converter.h"

#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>

#include "ckpt/util/error.h"
#include "ckpt/store/output_guard.h"
#include "ckpt/util/progress.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/pt/xser.h"
#include "convert/nnm_convert.h"
#include "convert/nnm_source.h"

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
  log("dry run: " + src.root + " (" + src.layout + ", tp=" + std::to_string(src.grid.tp) + " pp=" + std::to_string(src.grid.pp) +
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

}  // namespace

ConvertSummary RunConversion(const ConverterArgs& a, ckpt::Env* env, const std::function<void(const std::string&)>& log) {
  const auto t0 = Clock::now();
  if (a.nxdt_ckpt_path.empty() == a.checkpoint_dir.empty())
    throw ckpt::Error("give exactly one of --nxdt_ckpt_path (the output tag folder) and --checkpoint_dir (a folder to create the tag in)");
  const NnmSource src = FindNnmCheckpoint(env, a.nnm_ckpt_path, a.checkpoint_name, log);
  if ((a.tp && a.tp != src.grid.tp) || (a.pp && a.pp != src.grid.pp))
    throw ckpt::Error(a.nnm_ckpt_path + ": holds a tp=" + std::to_string(src.grid.tp) + " pp=" + std::to_string(src.grid.pp) + " checkpoint (" +
                      src.layout + " layout, " + std::to_string(src.files.size()) + " rank files), but --tp " + std::to_string(a.tp) +
                      " --pp " + std::to_string(a.pp) + " was given");

  // Load every input (pickles only: tensor bytes stay mapped) in parallel.
  std::vector<RankInput> inputs(src.files.size());
  tbb::parallel_for(size_t{0}, inputs.size(), [&](size_t i) {
    RankInput& in = inputs[i];
    in.path = src.files[i];
    in.checkpoint = ckpt::LoadPtOrXser(in.path, {}, env);
    for (int d = 0; d < src.zero1_dp(); ++d) {
      in.zero1_paths.push_back(src.zero1_files[i * src.zero1_dp() + d]);
      in.zero1.push_back(ckpt::LoadPtOrXser(in.zero1_paths.back(), {}, env));
    }
  });
  ConvertPlan plan = PlanConversion(src, inputs,
                                    {a.n_layers, a.weights_only, a.save_xser,
                                     a.nxdt_optimizer_groups ? OptimizerGroups::kNxdt : OptimizerGroups::kKeep, a.require_optimizer});
  const std::string tag_dir = TagDirFor(a, src, plan);
  ckpt::CheckOutputs({{tag_dir, a.nxdt_ckpt_path.empty() ? "--checkpoint_dir" : "--nxdt_ckpt_path", true}},
                     {{a.nnm_ckpt_path, "--nnm_ckpt_path"}});
  ConvertSummary sum;
  sum.tag_dir = tag_dir;
  sum.inputs = static_cast<int>(src.files.size() + src.zero1_files.size());
  if (a.dry_run) {
    PrintPlan(src, plan, tag_dir, a.weights_only, log);
    return sum;
  }
  const ckpt::StagedTag staged = ckpt::StageFor(tag_dir, "nnm2nxdt");
  if (a.group->rank() == 0) {
    for (const auto& n : plan.notes) log("note: " + n);
    for (const auto& line : OptimizerReport(plan, a.weights_only)) log(line);
    ckpt::PrepareTarget(env, staged, a.overwrite, log);
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
  ckpt::CommitStaged(env, staged, *a.group, ci);
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return sum;
}

}  // namespace convert
