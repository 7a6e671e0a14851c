#include "convert/nnm_state.h"

#include <tbb/parallel_for.h>

#include <map>

#include "ckpt/pt/plain_data.h"
#include "ckpt/pt/xser.h"
#include "ckpt/util/input_guard.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/spec/optimizer_groups.h"

namespace convert {

std::vector<RankInput> LoadNnmInputs(ckpt::Env* env, const NnmSource& src) {
  std::vector<RankInput> inputs(src.files.size());
  tbb::parallel_for(size_t{0}, inputs.size(), [&](size_t i) {
    RankInput& in = inputs[i];
    in.path = src.files[i];
    // Made plain as read: NNM's hyper_parameters (omegaconf) become dicts, and
    // anything shardkit would not write again is refused naming its file.
    const ckpt::LoadOptions confined{.confine_to = src.folder};  // an xser file's tensor folder too
    in.checkpoint = ckpt::PlainCheckpointData(ckpt::LoadPtOrXser(in.path, confined, env), in.path);
    for (int d = 0; d < src.zero1_dp(); ++d) {
      in.zero1_paths.push_back(src.zero1_files[i * src.zero1_dp() + d]);
      in.zero1.push_back(ckpt::PlainCheckpointData(ckpt::LoadPtOrXser(in.zero1_paths.back(), confined, env), in.zero1_paths.back()));
    }
  });
  return inputs;
}

const PlannedFile* GeneratedFile(const ConvertPlan& plan) {
  for (const auto& f : plan.files) {
    bool generated = false;
    ckpt::ForEachTensor(f.file.value, [&](const ckpt::Tensor& x) { generated |= x.storage() && x.storage()->producer(); });
    if (generated) return &f;
  }
  return nullptr;
}

std::unique_ptr<ckpt::ShardedTag> PlannedTag(const NnmSource& src, const ConvertPlan& plan, const ckpt::FormatHints& hints,
                                             const ckpt::TagReadOptions& opts) {
  if (const PlannedFile* f = GeneratedFile(plan))
    throw ckpt::Error(f->source + ": holds NNM's unmerged SwiGLU (dense_h_to_4h_2), which is merged only as it is written, so it " +
                      "cannot be re-cut in the same pass: convert at the checkpoint's own degrees (--tp " + std::to_string(src.grid.tp) +
                      " --pp " + std::to_string(src.grid.pp) + "), then ckpt-reshard the result");
  std::map<std::string, ckpt::Value> files;
  for (const auto& f : plan.files) files.emplace(f.file.relpath, f.file.value);
  ckpt::Manifest m;  // what the manifest of the converted tag at NNM's degrees would say
  m.step = plan.global_step;
  m.consumed_samples = plan.consumed_samples;
  m.grid = plan.grid;
  if (plan.optimizer) m.optimizer_grouping = ckpt::NxdtGroupingRule(plan.do_layer_norm_weight_decay);
  return ckpt::ShardedTag::FromFiles(src.root, std::move(files), m, hints, opts);
}

bool LooksLikeNnmCheckpoint(ckpt::Env* env, const std::string& path) {
  if (!env->Exists(path)) return false;
  if (!env->IsDirectory(path)) return path.ends_with(".ckpt");
  if (ckpt::HoldsNnmRankFolders(env, path)) return true;
  if (ckpt::LooksLikeTag(env, path)) return false;
  for (const auto& n : env->ListDir(path))
    if (n.ends_with(".ckpt") && !n.starts_with(".") && !ckpt::IsTempPath(n) && !env->IsDirectory(path + "/" + n)) return true;
  return false;
}

ckpt::SourceKind NnmSourceKind() {
  ckpt::SourceKind k;
  k.name = "nnm";
  k.description = "an NNM checkpoint (Lightning files in tp_rank_XX_pp_rank_XXX or mp_rank_XX folders, or one file)";
  k.detect = LooksLikeNnmCheckpoint;
  k.open = [](ckpt::Env* env, const std::string& path, const ckpt::SourceOptions& o) {
    const NnmSource src = FindNnmCheckpoint(env, path, o.checkpoint_name, o.log ? o.log : [](const std::string&) {});
    const std::vector<RankInput> inputs = LoadNnmInputs(env, src);
    ConvertOptions opts;
    opts.weights_only = o.weights_only;
    const ConvertPlan plan = PlanConversion(src, inputs, opts);
    auto tag = PlannedTag(src, plan, o.hints, {.trust_first_replica = o.trust_first_replica});
    ckpt::OpenedSource s;
    s.tag_name = src.file_name;
    for (const auto& f : plan.files) s.bytes += f.bytes;
    s.notes = plan.notes;
    for (const auto& n : tag->format_notes()) s.notes.push_back(n);
    s.state = std::move(tag);
    return s;
  };
  return k;
}

}  // namespace convert
