#include "libtrain/trainer.h"

#include "ckpt/mpi/mpi_group.h"
#include "ckpt/spec/ep_zero1_state.h"
#include "ckpt/spec/model_family.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <set>
#include <nlohmann/json.hpp>

#include "ckpt/store/checkpoint_store.h"
#include "ckpt/store/manifest.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/util/error.h"
#include "ckpt/util/progress.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/shard/sharded_tag.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/training_state.h"
#include "ckpt/pt/xser.h"
#include "libtrain/comm.h"
#include "libtrain/hdf5_dataset.h"
#include "libtrain/indexed_dataset.h"
#include "libtrain/layers.h"
#include "libtrain/model.h"
#include "libtrain/optimizer.h"
#include "libtrain/pipeline.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

// The folder names of the tags resume found damaged, as the store keys them.
std::vector<std::string> DamagedNames(const std::vector<ckpt::DamagedTag>& damaged) {
  std::vector<std::string> names;
  for (const auto& d : damaged) names.push_back(std::filesystem::path(d.path).filename().string());
  return names;
}

// Where a tag cut for another layout goes when resharded for this run: a
// folder beside the checkpoint directory named for the run's degrees (never
// the checkpoint directory itself, which holds the source).
std::string ReshardTarget(const std::string& tag, const TrainConfig& c) {
  const ckpt::RankGrid& run = c.grid;
  return std::filesystem::absolute(c.CheckpointDir()).lexically_normal().string() + "-tp" + std::to_string(run.tp) + "pp" +
         std::to_string(run.pp) + "dp" + std::to_string(run.dp) + (run.ep > 1 ? "ep" + std::to_string(run.ep) : "") + "/" +
         std::filesystem::path(tag).filename().string();
}

// What this run's config says of the model format, for a tag whose manifest
// does not (NxD's, and nnm2nxdt-ckpt's).
ckpt::FormatHints HintsOf(const TrainConfig& c) {
  ckpt::FormatHints h;
  h.heads = c.model.heads, h.kv_heads = c.model.kv_heads, h.vocab_size = c.model.vocab_size > 0 ? c.model.vocab_size : c.model.vocab;
  h.make_vocab_size_divisible_by = c.model.make_vocab_size_divisible_by;
  h.rope_theta = c.model.rope_theta, h.norm_eps = c.model.norm_eps(), h.rotary_percentage = c.model.rotary_percentage;
  return h;
}

// The ckpt-reshard arguments that make `tag` a tag this run can resume from.
ckpt::ReshardArgs ReshardFor(const std::string& tag, const TrainConfig& c) {
  ckpt::ReshardArgs a;
  a.src = std::filesystem::absolute(tag).lexically_normal().string();
  a.dst = ReshardTarget(tag, c);
  a.tp = c.grid.tp, a.pp = c.grid.pp, a.dp = c.grid.dp, a.ep = c.grid.ep, a.zero1 = c.grid.zero1;
  a.pipeline_cuts = c.pipeline_cuts;
  a.hints = HintsOf(c);
  a.tool = "resume-reshard";
  a.weights_only = c.weight_init_only;
  a.verify_source = false;  // resume checked every byte of it against its manifest just now (ResolveResume)
  // The run's model family and, for the HF-style one, its attention tensors and KV replication.
  a.out_model_family = c.model.family;
  if (c.model.family == ckpt::ModelFamily::kHfLlama) {
    a.out_kv_size_multiplier = c.model.kv_size_multiplier, a.out_hw_backend = c.model.hw_backend;
    a.out_fuse_qkv = c.model.fuse_qkv, a.out_qkv_linear = c.model.qkv_linear;
  }
  return a;
}

// The command that reshards a tag for this run, given ReshardFor's arguments.
std::string ReshardAdvice(const ckpt::ReshardArgs& a, const TrainConfig& c) {
  std::string cuts;
  for (int64_t cut : a.pipeline_cuts) cuts += (cuts.empty() ? " --pipeline_cuts " : ",") + std::to_string(cut);
  std::string family;
  if (c.model.family == ckpt::ModelFamily::kHfLlama)
    family = " --out_model_family hf_llama --out_kv_size_multiplier " + std::to_string(c.model.kv_size_multiplier) + " --out_hw_backend " +
             ckpt::BackendName(c.model.hw_backend) + " --out_fuse_qkv " + (c.model.fuse_qkv ? "true" : "false") + " --out_qkv_linear " +
             (c.model.qkv_linear ? "true" : "false");
  // An MoE tag's ep always: ckpt-reshard's default is the source's.
  const std::string ep = c.model.format(c.grid.tp).experts > 0 ? " --ep " + std::to_string(*a.ep) : "";
  return "Reshard it with: ckpt-reshard " + a.src + " " + a.dst + " --tp " + std::to_string(a.tp) + " --pp " + std::to_string(a.pp) +
         " --dp " + std::to_string(*a.dp) + ep + (*a.zero1 ? " --zero1" : " --no-zero1") + cuts + family +
         " and resume from it with exp_manager.resume_from_checkpoint=" + a.dst + " (or set exp_manager.resume_reshard: True)";
}

// Why a tag laid out as `L` cannot be resumed by this run as it is cut ("" when it can): its
// degrees, or its pipeline stages' layers. A tag without optimizer files
// (weights only) needs only tp and the stages to match.
std::string MismatchOf(const ckpt::TagDescription& L, const TrainConfig& c) {
  const ckpt::RankGrid &was = L.grid, &run = c.grid;
  // Optimizer files must be cut as this run cuts them: in dp ZeRO-1 shards, or whole (plain, or
  // ZeRO-1 over one rank, whose one shard is the whole state).
  auto shards = [](const ckpt::RankGrid& g) { return g.zero1 ? g.dp : 1; };
  // The expert-parallel size too: it names the model files and lays the optimizer's out.
  if (was.tp != run.tp || was.pp != run.pp || was.ep != run.ep || (L.has_optimizer && shards(was) != shards(run)))
    return "written at " + was.ToString() + ", but this run is " + run.ToString();
  // Same degrees, but other tensors or another head placement: loading it as it is would mix heads up.
  const ckpt::ModelFormat want = c.model.format(run.tp);
  const ckpt::ModelFormat& f = L.format;
  if (f.family != want.family)
    return std::string("its model family is ") + ckpt::FamilyName(f.family) + ", but this run's is " + ckpt::FamilyName(want.family);
  if (f.family == ckpt::ModelFamily::kHfLlama) {
    auto kv = [&](const ckpt::ModelFormat& x) {
      return std::string("fuse_qkv ") + (x.fuse_qkv ? "true" : "false") + ", qkv_linear " + (x.qkv_linear ? "true" : "false") +
             ", kv_replicator " + std::to_string(x.kv_size_multiplier) +
             (ckpt::BackendMatters(x, run.tp) ? std::string(" (") + ckpt::BackendName(x.hw_backend) + ")" : "");
    };
    if (kv(f) != kv(want)) return "its attention is laid out with " + kv(f) + ", but this run's with " + kv(want);
  }
  if (L.stage_bounds != c.stage_bounds) {
    auto stages = [](const std::vector<int64_t>& b) {
      std::string s;
      for (size_t i = 0; i + 1 < b.size(); ++i) s += (i ? ", " : "") + std::to_string(b[i]) + ".." + std::to_string(b[i + 1] - 1);
      return s;
    };
    return "its pipeline stages hold layers " + stages(L.stage_bounds) + ", but this run's hold " + stages(c.stage_bounds) +
           " (other pipeline cuts)";
  }
  return "";
}

// The stage map this run records and resumes: per pp rank, one layer range
// per model chunk (virtual stages p, p + pp, ..., as NxD places them: ckpt::RankLayerRanges).
ckpt::StageMap RunStageMap(const TrainConfig& c) {
  return ckpt::StageMapOf(c.stage_bounds, static_cast<int>(c.stage_bounds.size() - 1) / c.grid.pp);
}

// A stage map as its layer ranges, pp rank by pp rank ("0..1 | 2..3", "0..0 2..2 | 1..1 3..3").
std::string StageMapText(const ckpt::StageMap& m) {
  std::string s;
  for (size_t p = 0; p < m.size(); ++p) {
    s += p ? " | " : "";
    for (size_t i = 0; i < m[p].size(); ++i) s += (i ? " " : "") + std::to_string(m[p][i].first) + ".." + std::to_string(m[p][i].second - 1);
  }
  return s;
}

// MismatchOf the layout manifest `m` records, when it records all that asks (the grid, the stage
// map, the model format) and a format this run's config agrees with, so that reading the tag's
// files (ShardedTag, which checks the config's hints against the manifest) could tell nothing
// more; else nullopt, and the files are read as before.
std::optional<std::string> RecordedMismatch(const ckpt::Manifest& m, const TrainConfig& c) {
  if (!m.layout || !m.model || *m.model != c.model.format(m.grid.tp)) return std::nullopt;
  std::optional<std::vector<int64_t>> bounds = ckpt::StageBoundsOf(m.layout->stages);
  // Virtual stages (several ranges per pp rank), in the tag or in this run: the stage maps
  // themselves must agree (the tag's degrees first, as MismatchOf words them).
  if (!bounds || c.virtual_pipeline > 1) {
    if (m.grid.tp != c.grid.tp || m.grid.pp != c.grid.pp) return "written at " + m.grid.ToString() + ", but this run is " + c.grid.ToString();
    if (m.layout->stages != RunStageMap(c))
      return "its pipeline ranks hold layers " + StageMapText(m.layout->stages) + ", but this run's hold " + StageMapText(RunStageMap(c)) +
             " (other pipeline cuts or virtual_pipeline_model_parallel_size)";
    bounds = c.stage_bounds;
  }
  ckpt::TagDescription L;
  L.grid = m.grid, L.stage_bounds = *bounds, L.format = *m.model;
  L.has_optimizer = !c.weight_init_only && std::any_of(m.files.begin(), m.files.end(), [](const auto& f) { return f.first.starts_with("optim/"); });
  return MismatchOf(L, c);
}

// Why `tag` cannot be resumed by this run as it is cut ("" when it can): from its manifest when
// that tells (RecordedMismatch), else from its files.
std::string LayoutMismatch(ckpt::Env* env, const std::string& tag, const TrainConfig& c) {
  if (env->Exists(tag + "/" + ckpt::kManifestFile)) {
    std::optional<ckpt::Manifest> m;
    try {
      m = ckpt::Manifest::Load(env, tag + "/" + ckpt::kManifestFile);
    } catch (const ckpt::Error&) {
      // ShardedTag::Open reports it, as before
    }
    if (m)
      if (std::optional<std::string> why = RecordedMismatch(*m, c)) return *why;
  }
  const auto t = ckpt::ShardedTag::Open(env, tag, HintsOf(c), {.weights_only = c.weight_init_only});
  return MismatchOf(t->layout(), c);
}

// Whether `tag`'s manifest says its optimizer files hold fp32 master weights (false without a manifest:
// the reshard engine then finds out from the files).
bool HoldsMasterWeights(ckpt::Env* env, const std::string& tag) {
  if (!env->Exists(tag + "/" + ckpt::kManifestFile)) return false;
  const std::optional<ckpt::RecordedLayout> layout = ckpt::Manifest::Load(env, tag + "/" + ckpt::kManifestFile).layout;
  return layout && layout->master_weights;
}

// The rank whose files `rel` (a path in a tag) belongs to: model/ or optim/
// and a rank file name, or an xser part of one; else nullopt.
std::optional<ckpt::RankCoord> RankFileCoord(const std::string& rel) {
  if (!rel.starts_with("model/") && !rel.starts_with("optim/")) return std::nullopt;
  const std::string name = rel.substr(6);
  const size_t pt = name.find(".pt");
  if (pt == std::string::npos) return std::nullopt;
  try {
    return ckpt::ParseRankFileName(name.substr(0, pt + 3));
  } catch (const ckpt::Error&) {
    return std::nullopt;
  }
}

// The listed files of a candidate tag whose contents rank `at` (world rank `rank`) reads for
// resume's verification. Resumed as it is (`as_is`), each rank checks the rank files it loads
// (RestoreFromTag's), and rank 0 the tag's own files and any no rank loads; to be resharded, every
// rank an equal share, each file once, since the reshard reads them all.
std::vector<std::string> FilesToCheck(const ckpt::Manifest& m, bool as_is, const TrainConfig& c, ckpt::RankCoord at, int rank) {
  std::vector<std::string> out;
  size_t i = 0;
  for (const auto& [rel, digest] : m.files) {
    const size_t index = i++;
    if (!as_is) {
      if (static_cast<int>(index % c.grid.world_size()) == rank) out.push_back(rel);
      continue;
    }
    // Which file each rank loads is RankGrid::FileOf's to say: a rank file is loaded when its own
    // coordinates' rank loads it, and is mine when this rank's does.
    const std::optional<ckpt::RankCoord> of = RankFileCoord(rel);
    const ckpt::RankFileKind kind = rel.starts_with("model/") ? ckpt::RankFileKind::kModel : ckpt::RankFileKind::kOptim;
    const std::string file = of ? ckpt::RankFilePath(kind, *of) : "";
    // A model file named by ep rank e is loaded by dp rank e (of ep rank e, RankGrid::EpOf).
    std::optional<ckpt::RankCoord> loader = of;
    if (of && of->ep) loader->dp = *of->ep, loader->ep.reset();
    const bool loaded = of && loader->tp < c.grid.tp && loader->pp < c.grid.pp && loader->dp < c.grid.dp &&
                        !(kind == ckpt::RankFileKind::kOptim && c.weight_init_only) && c.grid.FileOf(kind, *loader) == file;
    const bool mine = loaded && c.grid.FileOf(kind, at) == file;
    if (mine || (!loaded && rank == 0)) out.push_back(rel);
  }
  return out;
}

// Every rank's problems, on every rank, each once (ranks that load the same file find the same).
std::vector<ckpt::TagProblem> GatherProblems(Comm& world, const std::vector<ckpt::TagProblem>& mine) {
  std::set<std::pair<std::string, std::string>> all;
  for (int r = 0; r < world.size(); ++r) {
    std::string text;  // each string as its length, a newline and its bytes (a problem may quote any bytes)
    if (r == world.rank())
      for (const auto& p : mine)
        for (const std::string* part : {&p.file, &p.what}) text += std::to_string(part->size()) + "\n" + *part;
    world.Broadcast(&text, r);
    for (size_t at = 0; at < text.size();) {
      std::string parts[2];
      for (std::string& part : parts) {
        const size_t nl = text.find('\n', at), n = std::stoul(text.substr(at, nl - at));
        part = text.substr(nl + 1, n);
        at = nl + 1 + n;
      }
      all.insert({std::move(parts[0]), std::move(parts[1])});
    }
  }
  std::vector<ckpt::TagProblem> out;
  for (const auto& [file, what] : all) out.push_back({file, what});
  return out;
}

// Resume's content check spread over the job (ckpt::ContentCheck): rank 0, choosing the tag,
// names each candidate whose manifest answers whether it fits (RecordedMismatch) to every rank
// ("l" as it is loaded, "a" all of it for a reshard, then the tag); each checks its share
// (FilesToCheck) and all gather the problems. Ranks but 0 run CheckCandidatesForRankZero until
// rank 0 names none (an empty command).
std::optional<std::vector<ckpt::TagProblem>> CheckCandidateTogether(ckpt::Env* env, Comm& world, const std::string& tag,
                                                                    const ckpt::Manifest& m, const TrainConfig& c, ckpt::RankCoord at) {
  const std::optional<std::string> why = RecordedMismatch(m, c);
  if (!why) return std::nullopt;
  std::string command = std::string(why->empty() ? "l" : "a") + "\n" + tag;
  world.Broadcast(&command, 0);
  return GatherProblems(world, ckpt::VerifyListedContent(env, tag, m, FilesToCheck(m, why->empty(), c, at, world.rank())));
}

void CheckCandidatesForRankZero(ckpt::Env* env, Comm& world, const TrainConfig& c, ckpt::RankCoord at) {
  for (;;) {
    std::string command;
    world.Broadcast(&command, 0);
    if (command.empty()) return;
    const std::string tag = command.substr(2);
    const ckpt::Manifest m = ckpt::Manifest::Load(env, tag + "/" + ckpt::kManifestFile);
    GatherProblems(world, ckpt::VerifyListedContent(env, tag, m, FilesToCheck(m, command[0] == 'l', c, at, world.rank())));
  }
}

// The tensors (in CopyForSnapshot's order, which is xser's tid order) that dp
// rank `dp` of `dps` writes of an xser file the dp ranks hold alike.
ckpt::TensorFilter BinnedForXser(const ckpt::Value& live, std::optional<ckpt::DType> floats_to, int dps, int dp) {
  auto bins = std::make_shared<std::vector<int>>(ckpt::XserBins(ckpt::SnapshotTensorBytes(live, floats_to), dps));
  return [bins, dp](size_t i) { return (*bins)[i] == dp; };
}

// What a rank writes of one of its (tp, pp) files: nothing, all of it, or its
// bin of the tensors. A file the dp ranks hold alike (`replicated`: the model;
// the optimizer without ZeRO-1) comes from the first of the ranks that hold it,
// or as xser from every one of them, each its bin, as NxD's save_checkpoint
// deals them. Those ranks are the expert-data-parallel group (the dp group at
// ep 1): NxD saves the model with groups=get_expert_data_parallel_replica_groups().
enum class FileShare { kNone, kWhole, kBin };
struct Replicas {
  int size = 1, index = 0;  // how many ranks hold the file alike, and this rank's place among them
};
Replicas ReplicasOf(const TrainConfig& c, int dp_rank) { return {c.grid.dp / c.grid.ep, dp_rank / c.grid.ep}; }
FileShare ShareOf(const TrainConfig& c, int dp_rank, bool replicated) {
  const Replicas r = ReplicasOf(c, dp_rank);
  if (replicated && c.save_xser && r.size > 1) return FileShare::kBin;
  return !replicated || r.index == 0 ? FileShare::kWhole : FileShare::kNone;
}

// An id every rank shares for a multi-rank save: rank 0's, broadcast.
std::string SharedSaveId(Comm& world, const std::string& what) {
  std::string id = world.rank() == 0 ? what + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device()()) : "";
  world.Broadcast(&id, 0);
  return id;
}

// Where a resumed run stands, as NxDT resumes it.
struct ResumePoint {
  int64_t step = 0, consumed = 0;
  std::optional<int64_t> schedule_step;  // where the LR schedule stands, when the tag says so (else at `step`)
};

// Loads this rank's model and optimizer files of `tag` (each plain .pt or
// xser, like NxD's load_checkpoint) and reads where training stands.
ResumePoint RestoreFromTag(ckpt::Env* env, const std::string& tag, const TrainConfig& c, ckpt::RankCoord coord, Model& model,
                           AdamW& adamw, const std::function<void(const std::string&)>& log) {
  ResumePoint at;
  try {
    const std::string model_file = c.grid.FileOf(ckpt::RankFileKind::kModel, coord);
    const std::string optim_file = c.grid.FileOf(ckpt::RankFileKind::kOptim, coord);
    // Each file as it is, plain .pt or xser, like NxD's load_checkpoint.
    model.LoadStateDict(ckpt::LoadTagFile(env, tag, model_file));
    adamw.ResetMasterWeights(model);
    if (c.weight_init_only)
      log("info: model.weight_init_only: " + tag + "'s optimizer state is not read; the optimizer starts fresh, as in NxDT");
    else if (!env->IsDirectory(tag + "/optim"))  // weights only, e.g. converted from NNM's HF import
      log("info: " + tag + " holds no optimizer state; the optimizer starts fresh");
    else if (!env->Exists(tag + "/" + optim_file))
      throw ckpt::Error(optim_file + " is missing (this rank's optimizer state)");
    else {
      if (!adamw.LoadStateDict(ckpt::LoadTagFile(env, tag, optim_file)) && c.optim.master_weights)
        log("info: the checkpoint holds no master weights (use_master_weights_in_ckpt was off); they restart from its "
            "bfloat16 parameters, as in NxDT");
      if (!adamw.regrouped().empty())
        log("info: " + optim_file + " groups its parameters as " + adamw.regrouped() +
            "; its state was read by name, and this run groups them as NxDT does (saved so from now on)");
    }
    // As NxDT resumes (the step from Lightning's loops, else global_step; the schedule from
    // lr_schedulers[0]), but from what the tag records: a name that disagrees is only a warning.
    const ckpt::TrainingPosition pos = ckpt::ReadTrainingPosition(env, tag);
    for (const auto& note : pos.notes) log(note);
    at.step = pos.step;
    at.consumed = pos.consumed_samples.value_or(0);
    if (pos.step_recorded) at.schedule_step = pos.schedule_step.value_or(0);
  } catch (const ckpt::Error& e) {
    throw ckpt::Error(tag + ": cannot resume: " + e.what());
  }
  return at;
}

}  // namespace

TrainResult RunTraining(const TrainConfig& c, const std::function<void(const std::string&)>& say, ckpt::Env* env) {
  TrainResult result;
  const ParallelComms pc = MakeParallelComms(c.grid, c.source);
  const bool rank0 = pc.world->rank() == 0;
  // One voice: rank 0 logs for the job (every rank computes the same metrics).
  const std::function<void(const std::string&)> log = [&](const std::string& l) {
    if (rank0) say(l);
  };
  for (const auto& k : c.ignored) log("info: " + k + " is accepted and ignored");
  if (const std::string note = ckpt::MegatronKvReplicationNote(c.model.format(c.grid.tp), c.grid.tp); !note.empty()) log("warning: " + note);
  // Data.
  std::vector<std::shared_ptr<TokenSource>> datasets;
  std::vector<double> weights;
  for (const auto& [w, prefix] : c.data_prefix) {
    try {  // the data the config names is input: missing or malformed, the config's error
      if (c.data_impl == "hdf5") datasets.push_back(std::make_shared<Hdf5Dataset>(prefix));
      else datasets.push_back(std::make_shared<IndexedDataset>(prefix, env));
    } catch (const ckpt::Error& e) {
      throw ConfigError(c.source + ": data.data_prefix: " + e.what());
    }
    weights.push_back(w);
  }
  SampleSource data(datasets, weights, c.seq_length, c.seed);
  // A replicated KV group (fewer groups than tp ranks) is summed over the ranks sharing it.
  std::unique_ptr<Comm> kv_comm;
  if (const std::vector<int> holders = KvHolders(c.model, c.grid.tp, pc.coord.tp); !holders.empty()) {
    const std::vector<int> tp_group = c.grid.Group(pc.world->rank(), {ckpt::Axis::kTp});
    std::vector<int> ranks;
    for (int t : holders) ranks.push_back(tp_group[t]);
    kv_comm = pc.world->Group(ranks);
  }
  // GPT's tied output: the first and last stages' copies of the embedding sum their gradients (with
  // virtual stages too: pp rank 0 holds the first of them, pp rank pp - 1 the last).
  std::unique_ptr<Comm> embedding_comm;
  if (c.model.tied_output && c.grid.pp > 1) {
    ckpt::RankCoord first = pc.coord, last = pc.coord;
    first.pp = 0, last.pp = c.grid.pp - 1;
    embedding_comm = pc.world->Group({c.grid.RankOf(first), c.grid.RankOf(last)});
  }
  // Expert parallelism: the MoE layers exchange tokens over the ep group, expert gradients are summed over expert-dp.
  Comm* ep_comm = c.grid.ep > 1 ? pc.ep.get() : nullptr;
  ExpertParallel ep{c.grid.ep, pc.ep->rank(), [ep_comm](const float* in, float* out, size_t block) { ep_comm->AllToAll(in, out, block); }};
  Model model(c.model, TensorParallel{c.grid.tp, pc.coord.tp, c.sequence_parallel, c.grid.tp > 1 ? pc.tp.get() : nullptr, kv_comm.get()},
              PipelineStage{c.grid.pp, pc.coord.pp, c.stage_bounds, c.grid.pp > 1 ? pc.pp.get() : nullptr, embedding_comm.get(), c.virtual_pipeline},
              ep);
  model.InitWeights();
  AdamW adamw(model, c.optim, pc.dp.get(), {pc.expert_dp.get(), ep_comm});

  // Resume.
  const std::string run_dir = c.RunDir(), ckpt_dir = c.CheckpointDir();
  if (rank0) env->CreateDirs(run_dir);
  int64_t step = 0, consumed = 0;
  std::optional<int64_t> schedule_step;  // where the LR schedule stands, when a tag says so (else at `step`)
  // Rank 0 chooses the tag and every rank takes its choice. Every byte of the tag is checked
  // against its manifest before it is loaded; a damaged tag is skipped for the next one that
  // verifies, and kept (retention neither counts nor deletes it).
  // A tag whose manifest records its layout is checked by every rank together: each reads the
  // files it loads (or, for a reshard, its share), so no rank reads another's files first.
  std::vector<ckpt::DamagedTag> damaged;
  std::string chosen;
  if (rank0) {
    const auto t = ckpt::ResolveResume(env, ckpt_dir,
                                       {.resume_if_exists = c.resume_if_exists,
                                        .resume_ignore_no_checkpoint = c.resume_ignore_no_checkpoint,
                                        .resume_from_checkpoint = c.resume_from_checkpoint,
                                        .verify_checksums = true,
                                        .start_over_damaged = c.resume_past_damaged_checkpoints,
                                        .weights_only = c.weight_init_only,
                                        .content_check = [&](const std::string& dir, const ckpt::Manifest& m) {
                                          return CheckCandidateTogether(env, *pc.world, dir, m, c, pc.coord);
                                        }},
                                       log, &damaged);
    chosen = t.value_or("");
    std::string no_more;
    pc.world->Broadcast(&no_more, 0);
  } else {
    CheckCandidatesForRankZero(env, *pc.world, c, pc.coord);
  }
  pc.world->Broadcast(&chosen, 0);
  std::optional<std::string> tag = chosen.empty() ? std::nullopt : std::optional(chosen);
  if (tag) {
    // A tag cut for other degrees is refused, or with resume_reshard resharded for this run by every
    // rank together (each writes its share of the files, rank 0 commits) and resumed from. Rank 0
    // decides what to do and every rank follows, so all take the same collectives.
    const ckpt::ReshardArgs reshard = ReshardFor(*tag, c);
    std::string action;  // "" (as it is), "reuse", "reshard", or "!" and the error
    if (rank0) {
      try {
        const ckpt::ResumePlan plan = ckpt::PlanResume(env, *tag, c.resume_reshard, reshard.dst,
                                                       [&](const std::string& dir) { return LayoutMismatch(env, dir, c); },
                                                       ReshardAdvice(reshard, c));
        // At ep > 1 the engine writes NxD's NeuronEPZero1Optimizer state, which has no place for fp32 master weights
        // (ckpt/spec/ep_zero1_state.h EpOptimizerBarOf, the engine's check); a tag holding them is refused here, before
        // every rank starts the reshard. The tag's manifest is read for it only at ep > 1, where the bar can apply.
        if (plan.kind == ckpt::ResumePlan::Kind::kReshard && c.grid.ep > 1 &&
            ckpt::EpOptimizerBarOf(c.grid.ep, !c.weight_init_only, c.grid.zero1, HoldsMasterWeights(env, *tag)) ==
                ckpt::EpOptimizerBar::kMasterWeights)
          throw ckpt::Error(*tag + ": cannot resume_reshard it at distributed_strategy.expert_model_parallel_size " +
                            std::to_string(c.grid.ep) + ": it holds fp32 master weights, which NxD's NeuronEPZero1Optimizer state has no place for; resume it at ep 1, "
                            "or with model.weight_init_only");
        if (plan.kind != ckpt::ResumePlan::Kind::kAsIs && c.virtual_pipeline > 1)
          throw ckpt::Error(*tag + ": cannot resume: it is laid out for another pipeline, and resume_reshard does not write interleaved "
                                   "(virtual) pipeline stages; resume it at its own layout, or without " + c.virtual_pipeline_key);
        action = plan.kind == ckpt::ResumePlan::Kind::kReshard ? "reshard" : plan.kind == ckpt::ResumePlan::Kind::kReuse ? "reuse" : "";
        if (!plan.note.empty()) log("resume: " + plan.note);
      } catch (const ckpt::Error& e) {
        action = "!" + std::string(e.what());
      }
    }
    pc.world->Broadcast(&action, 0);
    if (!action.empty() && action[0] == '!') throw ckpt::Error(action.substr(1));
    if (action == "reshard") {
      ckpt::ReshardArgs a = reshard;
      a.group = &ckpt::WorldGroup();  // the job's ranks write the resharded tag together
      a.progress_bar = false;
      ckpt::RunReshard(a, env, log);  // returns on every rank once rank 0 has committed it
    }
    if (!action.empty()) tag = reshard.dst;
  }
  if (tag) {
    const ResumePoint at = RestoreFromTag(env, *tag, c, pc.coord, model, adamw, log);
    step = at.step, consumed = at.consumed, schedule_step = at.schedule_step;
    result.resumed_from = *tag;
    log("resumed from " + *tag + " at step " + std::to_string(step) + ", " + std::to_string(consumed) + " samples consumed");
  }
  result.start_step = step;
  int64_t sched_at = schedule_step.value_or(step);
  if (sched_at != step) log("info: the LR schedule stands at step " + std::to_string(sched_at) + " (the tag's lr_schedulers), training at step " + std::to_string(step));

  std::unique_ptr<ckpt::CheckpointStore> store;
  auto pool = ckpt::SnapshotPool::Create();
  if (c.create_checkpoint_callback) {
    const std::string job_id = SharedSaveId(*pc.world, "train");  // one id for the job's saves
    store = std::make_unique<ckpt::CheckpointStore>(
        ckpt::StoreOptions{.dir = ckpt_dir, .save_top_k = static_cast<int>(c.save_top_k), .async = c.async_checkpointing, .env = env, .log = log,
                           .damaged = DamagedNames(damaged), .model = model.config().format(c.grid.tp),
                           .optimizer_grouping = ckpt::NxdtGroupingRule(c.optim.do_layer_norm_weight_decay),
                           .stages = RunStageMap(c), .master_weights = adamw.SavesMasterWeights()},
        ckpt::MpiLaunch{.rank = pc.world->rank(), .world_size = pc.world->size(), .job_id = job_id});
    // Snapshot buffers, faulted in before the first step: for what this rank copies (save's `add`).
    auto reserve = [&](const ckpt::Value& live, std::optional<ckpt::DType> floats_to, bool replicated) {
      const FileShare share = ShareOf(c, pc.coord.dp, replicated);
      const Replicas r = ReplicasOf(c, pc.coord.dp);
      if (share == FileShare::kBin) pool->Reserve(live, floats_to, BinnedForXser(live, floats_to, r.size, r.index));
      else if (share == FileShare::kWhole) pool->Reserve(live, floats_to);
    };
    reserve(model.CheckpointDict(), model.checkpoint_dtype(), true);
    reserve(adamw.StateDict(0), std::nullopt, !c.grid.zero1);
  }
  // This rank's totals: step time, its communication, and time blocked saving (for timing.json).
  struct {
    double step = 0, collective = 0, recv_wait = 0, save = 0, collective_floats = 0, sent_floats = 0, steps = 0, alltoall_floats = 0;
  } timing;
  auto save = [&](int64_t global_step, int64_t sched_step, double lr) {
    if (!store) return;
    struct Timer {
      double* total;
      Clock::time_point start;
      ~Timer() { *total += std::chrono::duration<double>(Clock::now() - start).count(); }
    } timer{&timing.save, Clock::now()};
    ckpt::SchedulerState sched;
    sched.last_epoch = sched_step;
    sched.carried = {{"base_lrs", ckpt::Value::List({ckpt::Value(c.optim.lr)})},
                     {"_last_lr", ckpt::Value::List({ckpt::Value(lr)})},
                     {"name", ckpt::Value(c.sched.name)}};
    // What NxDT reads back (ckpt/store/training_state.h): global_step, epoch and lr_schedulers; the
    // consumed samples also travel in the tag's name.
    ckpt::UserContent user{.epoch = 0, .global_step = global_step, .consumed_samples = static_cast<double>(consumed), .carried = {}};
    user.carried.emplace_back("lr_schedulers",
                              ckpt::Value::List({ckpt::LrSchedulerEntry(c.optim.lr, sched_step, LrAt(c.sched, c.optim.lr, sched_step))}));
    ckpt::Snapshot snap;
    snap.tag = {c.name, global_step, static_cast<double>(consumed), false};
    snap.grid = c.grid;
    // This rank's share of its model and optimizer files (ShareOf); the tag's own files from rank 0.
    // Under expert parallelism an xser model file marks the expert weights, and an ep rank above 0
    // writes only their tensor files (ckpt::XserFiles), as NxD's _xser_save_data does.
    const auto expert = [&](const std::string& key) { return ckpt::IsExpertWeight(model.format(), key); };
    auto add = [&](const std::string& rel, const ckpt::Value& live, std::optional<ckpt::DType> floats_to, bool weights_only, bool replicated) {
      const FileShare share = ShareOf(c, pc.coord.dp, replicated);
      const bool ep_model = replicated && c.grid.ep > 1;  // the model file at ep > 1 (the optimizer is ZeRO-1 there)
      const std::function<bool(const std::string&)> marks = ep_model ? std::function<bool(const std::string&)>(expert) : nullptr;
      const bool experts_only = ep_model && c.grid.EpOf(pc.coord) > 0;
      if (share == FileShare::kBin) {
        const Replicas r = ReplicasOf(c, pc.coord.dp);
        const ckpt::TensorFilter mine = BinnedForXser(live, floats_to, r.size, r.index);
        ckpt::FileToWrite f{rel, ckpt::CopyForSnapshot(live, pool.get(), floats_to, mine), {.weights_only = weights_only}};
        for (auto& part : ckpt::XserFilesOfBin(f, r.size, r.index, marks, experts_only)) snap.files.push_back(std::move(part));
        return;
      }
      if (share == FileShare::kNone) return;
      ckpt::FileToWrite f{rel, ckpt::CopyForSnapshot(live, pool.get(), floats_to), {.weights_only = weights_only}};
      if (!c.save_xser) snap.files.push_back(std::move(f));
      else for (auto& part : ckpt::XserFiles(f, marks, experts_only)) snap.files.push_back(std::move(part));
    };
    add(c.grid.FileOf(ckpt::RankFileKind::kModel, pc.coord), model.CheckpointDict(), model.checkpoint_dtype(), true, true);
    add(c.grid.FileOf(ckpt::RankFileKind::kOptim, pc.coord), adamw.StateDict(lr), std::nullopt, false, !c.grid.zero1);
    if (rank0) {
      snap.files.push_back({ckpt::kSchedulerFile, sched.ToValue(), {}});
      snap.files.push_back({ckpt::kUserContentFile, user.ToValue(), {}});
    }
    store->Save(std::move(snap));
  };

  // Appended to across resumes; each line handed to the OS as it is written, so a killed run keeps its steps.
  std::unique_ptr<ckpt::WritableFile> metrics;
  if (rank0) metrics = env->NewAppendableFile(run_dir + "/metrics.jsonl");
  const bool tty = rank0 && ::isatty(2);
  // Micro-batches per step over the job, and this rank's share: as Megatron's sampler deals them,
  // global micro-batch g = m * dp + dp_rank holds samples consumed + g * B .. + B - 1.
  const int64_t micro = c.global_batch_size / c.micro_batch_size, B = c.micro_batch_size, T = c.seq_length;
  const int64_t dp = c.grid.dp, my_micro = micro / dp;
  std::vector<int32_t> sample(T + 1);
  auto load = [&](int64_t m, MicroBatch* mb) {
    const int64_t first = consumed + (m * dp + pc.coord.dp) * B;
    mb->tokens.resize(B * T), mb->targets.resize(B * T);
    for (int64_t b = 0; b < B; ++b) {
      data.Sample(first + b, sample.data());
      std::copy(sample.begin(), sample.end() - 1, mb->tokens.begin() + b * T);
      std::copy(sample.begin() + 1, sample.end(), mb->targets.begin() + b * T);
    }
    // Dropout masks are a function of the seed and the batch's place in the data, so a resumed
    // run, and any data-parallel layout, draws the same.
    mb->dropout_key = DropoutStream(c.seed, static_cast<uint64_t>(first));
  };
  double lr = 0;
  int64_t last_saved = tag ? step : -1;
  while (step < c.max_steps) {
    const auto t0 = Clock::now();
    const CommStats comm0 = Comm::Stats();
    model.ZeroGrad();
    // The last stage's losses, summed over the stages (the others add 0) and the data-parallel ranks.
    double loss = RunPipelineStep(model, my_micro, B, T, load) / static_cast<double>(micro);
    pc.pp->AllReduceSum(&loss, 1);
    model.ReduceReplicaGrads();
    pc.dp->AllReduceSum(&loss, 1);
    // Summed over every rank's micro-batches, then the mean over them.
    const double grad_norm = adamw.ReduceAndClip(model, 1.0 / static_cast<double>(micro), c.gradient_clip_val);
    lr = LrAt(c.sched, c.optim.lr, sched_at);
    adamw.Step(model, lr);
    consumed += c.global_batch_size;
    ++step, ++sched_at;
    result.losses.push_back(loss);
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const CommStats& comm1 = Comm::Stats();
    const double collective = comm1.collective_seconds - comm0.collective_seconds, wait = comm1.recv_wait_seconds - comm0.recv_wait_seconds;
    const double floats = static_cast<double>(comm1.collective_floats - comm0.collective_floats);
    const double sent = static_cast<double>(comm1.sent_floats - comm0.sent_floats);
    timing.step += secs, timing.collective += collective, timing.recv_wait += wait, ++timing.steps;
    const double alltoall = static_cast<double>(comm1.alltoall_floats - comm0.alltoall_floats);  // the MoE token exchange
    timing.collective_floats += floats, timing.sent_floats += sent, timing.alltoall_floats += alltoall;
    const double tps = static_cast<double>(c.global_batch_size * T) / secs;
    nlohmann::ordered_json j = {{"step", step}, {"loss", loss}, {"lr", lr}, {"consumed_samples", consumed}, {"tokens_per_s", tps}};
    if (pc.world->size() > 1)  // rank 0's share of the step: in collectives, and blocked on the next pipeline stage
      j["comm_seconds"] = collective, j["recv_wait_seconds"] = wait, j["comm_bytes"] = 4 * (floats + sent);
    if (ep_comm) j["alltoall_bytes"] = 4 * alltoall;  // rank 0's, sent to the other ep ranks
    if (c.log_gradient_norm) j["grad_norm"] = grad_norm;
    if (c.log_parameter_norm) j["param_norm"] = ParamNorm(model, ep_comm);
    if (metrics) {
      const std::string line = j.dump() + "\n";
      metrics->Append({reinterpret_cast<const uint8_t*>(line.data()), line.size()});
      metrics->Flush();
    }
    if (step % c.log_every_n_steps == 0 || step == c.max_steps) {
      char line[256];
      std::snprintf(line, sizeof line, "step %lld/%lld loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f",
                    static_cast<long long>(step), static_cast<long long>(c.max_steps), loss, lr, grad_norm, tps);
      if (tty) std::fprintf(stderr, "\r%s %s", ckpt::ProgressBar(step, c.max_steps).c_str(), line), std::fflush(stderr);
      else log(line);
    }
    if (c.every_n_train_steps > 0 && step % c.every_n_train_steps == 0) save(step, sched_at, lr), last_saved = step;
  }
  if (tty) std::fprintf(stderr, "\n");
  if (last_saved != step) save(step, sched_at, lr);
  if (store) {
    const auto f0 = Clock::now();
    store->Finalize();
    timing.save += std::chrono::duration<double>(Clock::now() - f0).count();
  }
  result.end_step = step;
  // Every rank's totals, to rank 0: <run>/timing.json (benchmarks/train_parallel.py reads it).
  constexpr int kFields = 8;
  std::vector<double> all(kFields * pc.world->size(), 0.0);
  const double mine[kFields] = {timing.steps, timing.step, timing.collective, timing.recv_wait, timing.save, timing.collective_floats, timing.sent_floats,
                                timing.alltoall_floats};
  std::copy(mine, mine + kFields, all.begin() + kFields * pc.world->rank());
  pc.world->AllReduceSum(all.data(), all.size());
  if (rank0) {
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (int r = 0; r < pc.world->size(); ++r) {
      const double* t = &all[kFields * r];
      const ckpt::RankCoord at = c.grid.CoordOf(r);
      ranks.push_back({{"rank", r}, {"dp", at.dp}, {"tp", at.tp}, {"pp", at.pp}, {"steps", t[0]}, {"step_seconds", t[1]},
                       {"collective_seconds", t[2]}, {"recv_wait_seconds", t[3]}, {"save_seconds", t[4]},
                       {"collective_bytes", 4 * t[5]}, {"sent_bytes", 4 * t[6]}, {"alltoall_bytes", 4 * t[7]}});
    }
    const std::string text = nlohmann::ordered_json{{"grid", c.grid.ToString()}, {"ranks", ranks}}.dump(2) + "\n";
    ckpt::WriteFileAtomically(env, run_dir + "/timing.json",
                              [&](ckpt::WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()}); });
  }
  return result;
}

}  // namespace train
