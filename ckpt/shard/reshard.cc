#include "ckpt/shard/reshard.h"

#include "ckpt/shard/stream_budget.h"
#include "ckpt/spec/lora.h"

#include "ckpt/spec/model_family.h"
#include "ckpt/shard/renamed_state.h"
#include "ckpt/shard/source_registry.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <map>
#include <random>
#include <tuple>

#include "ckpt/util/error.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/spec/ep_zero1_state.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/spec/partition.h"
#include "ckpt/util/progress.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/resume.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/store/tag_writer.h"

namespace ckpt {
namespace {

constexpr int64_t kMaxRankFiles = int64_t{1} << 16;

using ckpt::Error;
using ckpt::ParamRule;
using ckpt::StateField;
using ckpt::Value;
using Clock = std::chrono::steady_clock;


// One target tensor (or ZeRO-1 shard of one): the rows [row_lo, row_lo +
// rows) of the target rank's local tensor of a parameter, copied from the
// source box by box (the rank's boxes, ckpt/spec/shard_spec.h BoxesOf), each
// box's part of a chunk as the longest runs contiguous in both tensors.
struct TargetSlice {
  const ckpt::LogicalState* src;
  std::string name;  // the logical parameter read
  StateField field;
  std::vector<ckpt::Box> boxes;  // the target rank's, in local row-major order
  std::vector<int64_t> local;    // the unsharded local shape
  std::vector<int64_t> global;   // the logical shape
  int64_t row_lo, rows;          // rows of `local` this slice holds; past local[0] they are ZeRO-1 padding (zeros)
  size_t es;
  // Fingerprints: boxes[i] is summed into `fp` when primary[i] (its first
  // holder in the target: replicas are summed once), up to logical_numel
  // (vocab padding rows are not part of the logical tensor).
  ckpt::FingerprintCollector* fp;
  std::vector<char> primary;
  uint64_t logical_numel;

  // The box holding local point q.
  size_t BoxHolding(const std::vector<int64_t>& q) const {
    for (size_t k = 0; k < boxes.size(); ++k) {
      bool in = true;
      for (size_t d = 0; d < q.size() && in; ++d) in = q[d] >= boxes[k].local[d] && q[d] < boxes[k].local[d] + boxes[k].size[d];
      if (in) return k;
    }
    return 0;
  }

  // Bytes [offset, offset + out.size()) of the slice, row-major.
  void Produce(uint64_t offset, std::span<uint8_t> out) const {
    const uint64_t numel = static_cast<uint64_t>(ckpt::ShapeNumel(local));
    const uint64_t inner = local.empty() ? 1 : numel / std::max<int64_t>(local[0], 1);
    uint64_t e = static_cast<uint64_t>(row_lo) * inner + offset / es, n = out.size() / es;
    uint8_t* o = out.data();
    ckpt::Touched touched(out.size());  // source pages: at most a chunk's worth, as the budget counts them
    std::vector<int64_t> q, g;
    while (n > 0) {
      if (e >= numel) {  // ZeRO-1 padding
        std::memset(o, 0, n * es);
        break;
      }
      ckpt::PointOf(static_cast<int64_t>(e), local, q);
      const size_t k = BoxHolding(q);
      const ckpt::Box& b = boxes[k];
      g = q;
      for (size_t d = 0; d < g.size(); ++d) g[d] += b.offset[d] - b.local[d];
      // The run must be contiguous in the local tensor and in the logical one.
      const uint64_t take = std::min<uint64_t>({n, static_cast<uint64_t>(ckpt::RunInBox(b.local, b.size, local, q)),
                                                static_cast<uint64_t>(ckpt::RunInBox(b.offset, b.size, global, g))});
      const uint64_t flat = static_cast<uint64_t>(ckpt::FlatIndex(g, global));
      src->Read(name, field, flat, {o, take * es}, &touched);
      if (primary[k] && flat < logical_numel) fp->Add(name, field, flat * es, {o, std::min<uint64_t>(take, logical_numel - flat) * es});
      o += take * es, e += take, n -= take;
    }
  }
};

Value SliceTensor(std::shared_ptr<TargetSlice> s, ckpt::DType dtype) {
  std::vector<int64_t> shape = s->local;
  shape[0] = s->rows;
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  const uint64_t bytes = static_cast<uint64_t>(ckpt::ShapeNumel(shape)) * s->es;
  auto storage = ckpt::Storage::Generated(bytes, [s](uint64_t off, std::span<uint8_t> out) { s->Produce(off, out); });
  return Value(ckpt::Tensor(dtype, shape, strides, 0, storage));
}

struct PlannedFile {
  ckpt::FileToWrite file;
  uint64_t bytes = 0;  // tensor bytes
  int unit = -1;       // rank files are spread over the processes; -1: rank 0
  int ep = -1;         // an expert-parallel model file's ep rank (xser: its expert weights are marked)
};

class Planner {
 public:
  Planner(const ckpt::LogicalState& src, const ckpt::ModelFormat& format, ckpt::RankGrid to, std::vector<int64_t> bounds, int virtual_stages,
          size_t chunk, ckpt::FingerprintCollector* fp)
      : src_(src), fmt_(format), to_(to), bounds_(std::move(bounds)), virtual_stages_(virtual_stages), chunk_(chunk), fp_(fp) {
    rules_ = ckpt::LogicalParameters(fmt_, to.tp);
    optimizer_rules_ = ckpt::OptimizerParameters(fmt_, to.tp);
    for (const auto& t : ckpt::LogicalTensors(src)) logical_numel_[t.name] = t.numel;
  }

  std::vector<PlannedFile> Plan() {
    std::vector<PlannedFile> out;
    int unit = 0;
    std::vector<ckpt::StageParam> stage, optimized;
    // Each model file, then the optim files of its place; the files walk stage by stage.
    to_.ForEachRankFile(ckpt::RankFileKind::kModel, [&](const ckpt::RankCoord& at) {
      if (at.tp == 0) {
        stage = ckpt::StageParameters(rules_, bounds_, at.pp, ckpt::TiedCopyNaming::kNxdt, virtual_stages_);
        optimized = ckpt::StageParameters(optimizer_rules_, bounds_, at.pp, ckpt::TiedCopyNaming::kNxdt, virtual_stages_);
      }
      out.push_back(ModelFile(stage, at, unit++));
      // NeuronEPZero1Optimizer's files are named by dp rank alone: written once per tp and pp place.
      if (!src_.layout().has_optimizer || at.ep.value_or(0) > 0) return;
      to_.ForEachRankFile(ckpt::RankFileKind::kOptim, at, [&](const ckpt::RankCoord& o) { out.push_back(OptimFile(optimized, o.tp, o.pp, o.dp, unit++)); });
    });
    return out;
  }

 private:
  // The target rank at tp rank t, ep rank e (every other axis 1).
  ckpt::AxisCoords At(int t, int e) const {
    ckpt::AxisCoords at = ckpt::AxisCoords::Tp(to_.tp, t);
    at[ckpt::Axis::kEp] = {to_.ep, e};
    return at;
  }

  std::shared_ptr<TargetSlice> Slice(const ckpt::StageParam& sp, StateField f, const ckpt::AxisCoords& at, int p, int64_t row_lo, int64_t rows) {
    const ParamRule& rule = *sp.rule;
    auto s = std::make_shared<TargetSlice>();
    s->src = &src_;
    s->name = rule.name;
    s->field = f;
    s->boxes = ckpt::LocalBoxes(rule, at);
    s->local = ckpt::LocalShape(rule, at);
    s->global = rule.shape;
    s->row_lo = row_lo;
    s->rows = rows < 0 ? s->local[0] : rows;
    s->es = ckpt::ElementSize(src_.dtype(rule.name, f));
    s->fp = fp_;
    s->logical_numel = logical_numel_.at(rule.name);
    // A box's first holder (stage, tp and ep rank) sums it; every ZeRO-1
    // shard of that holder sums its part.
    const std::pair<int, int> me{p, ckpt::ExtentIndex::HolderId(at)};
    for (const ckpt::Box& box : s->boxes) {
      if (sp.tied_copy()) {  // GPT's tied output copy: the embedding's holder sums it
        s->primary.push_back(false);
        continue;
      }
      const auto holder = first_holder_.try_emplace({rule.name, f, box.offset}, me).first->second;
      s->primary.push_back(holder == me);
    }
    return s;
  }

  PlannedFile ModelFile(const std::vector<ckpt::StageParam>& stage, const ckpt::RankCoord& c, int unit) {
    PlannedFile pf;
    const int p = c.pp;
    const ckpt::AxisCoords at = At(c.tp, c.ep.value_or(0));
    Value model = Value::NewDict(src_.model_dict_ordered());
    auto& d = model.as_dict();
    AddBuffersAfter("", d, p);
    for (const auto& sp : stage) {
      auto s = Slice(sp, StateField::kParam, at, p, 0, -1);
      pf.bytes += static_cast<uint64_t>(ckpt::ShapeNumel(s->local)) * s->es;
      d.Set(sp.name, SliceTensor(s, src_.dtype(sp.rule->name, StateField::kParam)));
      ckpt::SetSpmdRanksAfter(fmt_, to_.ep, sp.name, d);  // at ep > 1, as NxD's ExpertMLPsV2 registers them
      AddBuffersAfter(sp.name, d, p);
    }
    // LoRA's lora_config holds a float (lora_dropout), which torch 1.13's weights_only loader refuses.
    pf.file = {ckpt::RankFilePath(ckpt::RankFileKind::kModel, c), model, {.weights_only = !fmt_.lora.on(), .stream_chunk = chunk_, .stream_buffers = chunks_}};
    pf.unit = unit;
    if (c.ep) pf.ep = *c.ep;
    return pf;
  }

  // Stage p's buffers that followed `key` in the source (and those that followed them), in place.
  void AddBuffersAfter(const std::string& key, ckpt::Dict& d, int p) const {
    for (const auto& b : src_.buffers())
      if (b.after == key && ckpt::RankHoldsLayer(bounds_, virtual_stages_, p, b.layer)) {
        d.Set(b.name, b.value);
        AddBuffersAfter(b.name, d, p);
      }
  }

  PlannedFile OptimFile(const std::vector<ckpt::StageParam>& stage, int t, int p, int d, int unit) {
    PlannedFile pf;
    std::vector<std::string> names;
    for (const auto& sp : stage) names.push_back(sp.name);
    const ckpt::GroupingRule rule = src_.layout().grouping;  // carried through
    const ckpt::Grouping g = ckpt::FamilyGrouping(fmt_, ckpt::GroupedNames(names, ckpt::SameStageTiedCopy(stage), rule), rule);
    auto param = [&](const std::string& name) -> const ckpt::StageParam& { return stage[std::find(names.begin(), names.end(), name) - names.begin()]; };
    Value file;
    if (to_.ep > 1) {
      file = EpOptimFile(g, param, t, p, d, pf).ToValue();
    } else {
      ckpt::OptimizerFile of;
      of.zero1 = to_.zero1;
      of.param_groups = ckpt::ParamGroupsFor(src_.ParamGroups(), g);
      for (const auto& slot : g.order) of.params.push_back(State(param(slot.name), At(t, 0), p, d, to_.zero1 ? to_.dp : 1, pf));
      file = of.ToValue();
    }
    pf.file = {ckpt::RankFilePath(ckpt::RankFileKind::kOptim, {d, t, p}), file, {.weights_only = false, .stream_chunk = chunk_, .stream_buffers = chunks_}};
    pf.unit = unit;
    return pf;
  }

  // NxD's NeuronEPZero1Optimizer file of dp rank d (ckpt/spec/ep_zero1_state.h
  // EpZero1Entries: which shard of whose experts it holds).
  ckpt::EpZero1File EpOptimFile(const ckpt::Grouping& g, const std::function<const ckpt::StageParam&(const std::string&)>& param, int t, int p,
                                int d, PlannedFile& pf) {
    const ckpt::EpGroupings parts = ckpt::SplitGroupingByExperts(g, [&](const std::string& n) { return ckpt::IsExpertWeight(fmt_, n); });
    ckpt::EpZero1File ef;
    ef.non_expert.zero1 = ef.expert.zero1 = true;
    ef.non_expert.param_groups = ckpt::ParamGroupsFor(src_.ParamGroups(), parts.non_expert);
    ef.expert.param_groups = ckpt::ParamGroupsFor(src_.ParamGroups(), parts.expert);
    for (const ckpt::EpZero1Entry& e : ckpt::EpZero1Entries(parts, to_, d)) {
      ckpt::AxisCoords at = At(t, e.shard.ep_rank);
      (e.expert ? ef.expert : ef.non_expert).params.push_back(State(param(e.name), at, p, e.shard.shard, e.shard.shards, pf));
    }
    return ef;
  }

  // A parameter's state in an optimizer file: chunk `shard` of `shards` of
  // dim 0 of its local tensor at `at` (ZeRO-1), or the whole (shards 1).
  ckpt::ParamState State(const ckpt::StageParam& sp, const ckpt::AxisCoords& at, int p, int shard, int shards, PlannedFile& pf) {
    ckpt::ParamState ps;
    if (!src_.Has(sp.rule->name, StateField::kExpAvg) && fmt_.lora.on()) return ps;  // LoRA's frozen base: no state
    const auto local = ckpt::LocalShape(*sp.rule, at);
    const int64_t rows = to_.zero1 ? ckpt::Zero1ShardRows(local[0], shards) : local[0];
    ps.step = src_.Step(sp.rule->name);
    // GPT's tied copy: a step of its own, as every parameter's state has (not the embedding's, shared).
    if (sp.tied_copy() && ps.step.is_tensor()) ps.step = Value(ps.step.as_tensor().Clone());
    ps.shape = local;
    auto tensor = [&](StateField f) {
      auto s = Slice(sp, f, at, p, shard * rows, rows);
      pf.bytes += static_cast<uint64_t>(rows * (ckpt::ShapeNumel(local) / local[0])) * s->es;
      return SliceTensor(s, src_.dtype(sp.rule->name, f));
    };
    ps.exp_avg = tensor(StateField::kExpAvg);
    ps.exp_avg_sq = tensor(StateField::kExpAvgSq);
    if (src_.layout().master_weights) ps.master = tensor(StateField::kMaster);
    return ps;
  }

  const ckpt::LogicalState& src_;
  const ckpt::ModelFormat& fmt_;  // the target's
  ckpt::RankGrid to_;
  std::vector<int64_t> bounds_;
  int virtual_stages_;
  size_t chunk_;
  // Every file's chunks, reused: at most one per writing thread is alive, in use or free.
  std::shared_ptr<ckpt::StoragePool> chunks_ = ckpt::StoragePool::Create();
  ckpt::FingerprintCollector* fp_;
  std::vector<ParamRule> rules_, optimizer_rules_;  // LogicalParameters, OptimizerParameters
  std::map<std::string, uint64_t> logical_numel_;
  std::map<std::tuple<std::string, StateField, std::vector<int64_t>>, std::pair<int, int>> first_holder_;
};

// LoRA adapters are named after their base's tensors (ckpt/spec/lora.h): `to`,
// unless it re-lays those (attention tensors, family), which is not done for them.
const ckpt::ModelFormat& LoraKeepsItsNames(const ckpt::ModelFormat& from, const ckpt::ModelFormat& to) {
  if (from.lora.on() && (to.family != from.family || to.fuse_qkv != from.fuse_qkv || to.qkv_linear != from.qkv_linear))
    throw Error("the tag holds LoRA adapters (" + ckpt::DescribeLora(from.lora) +
                "); re-laying its attention tensors or family (--out_fuse_qkv, --out_qkv_linear, --out_model_family) is not supported for them");
  return to;
}

// The target's model format: the source's, with the HF-style family's attention options applied.
ckpt::ModelFormat TargetFormat(const ckpt::ModelFormat& from, const ReshardArgs& a) {
  ckpt::ModelFormat to = from;
  const bool asked = a.out_kv_size_multiplier || a.out_hw_backend || a.out_fuse_qkv || a.out_qkv_linear;
  if (a.out_model_family && *a.out_model_family != from.family) {
    to.family = *a.out_model_family;
    to.fuse_qkv = true, to.qkv_linear = false, to.kv_size_multiplier = 1, to.hw_backend = ckpt::HwBackend::kUnknown;  // NxDT's defaults
    // The HF-style family does not pad the vocabulary; NxDT's megatron models pad to a multiple of 128 x tp.
    to.make_vocab_size_divisible_by = to.family == ckpt::ModelFamily::kHfLlama ? 1 : 128;
  }
  if (!asked) return LoraKeepsItsNames(from, to);
  if (to.family != ckpt::ModelFamily::kHfLlama)
    throw Error("--out_kv_size_multiplier, --out_hw_backend, --out_fuse_qkv and --out_qkv_linear apply to HF-style tags (model_source: hf) only");
  if (a.out_fuse_qkv) to.fuse_qkv = *a.out_fuse_qkv;
  if (a.out_qkv_linear) to.qkv_linear = *a.out_qkv_linear;
  if (a.out_kv_size_multiplier) to.kv_size_multiplier = *a.out_kv_size_multiplier;
  if (a.out_hw_backend) to.hw_backend = *a.out_hw_backend;
  return LoraKeepsItsNames(from, to);
}

// The target's ep (the source's unless --ep), inside dp (RankGrid::ep). An
// expert-parallel target's optimizer is NxD's NeuronEPZero1Optimizer
// (ckpt/spec/ep_zero1_state.h EpOptimizerBarOf): ZeRO-1, without master weights.
int TargetEp(const ReshardArgs& a, const ckpt::TagDescription& L, bool zero1, int& dp, std::vector<std::string>& notes) {
  const int ep = a.ep.value_or(L.grid.ep);
  if (ep < 1 || ep > ckpt::kMaxRanks) throw Error("--ep " + std::to_string(ep) + " is not from 1 to " + std::to_string(ckpt::kMaxRanks));
  const ckpt::EpOptimizerBar bar = ckpt::EpOptimizerBarOf(ep, L.has_optimizer, zero1, L.master_weights);
  if (bar == ckpt::EpOptimizerBar::kPlain)
    throw Error("--ep " + std::to_string(ep) + ": NxD saves an expert-parallel MoE optimizer as NeuronEPZero1Optimizer (ZeRO-1) state; shardkit "
                "writes no plain optimizer files at ep > 1; keep --zero1 or pass --weights_only");
  if (bar == ckpt::EpOptimizerBar::kMasterWeights)
    throw Error("--ep " + std::to_string(ep) + ": the source holds fp32 master weights, which NxD's NeuronEPZero1Optimizer state dict has no "
                "place for (it saves none); pass --weights_only, or keep ep 1");
  if (dp % ep == 0) return ep;
  if (a.dp) throw Error("--ep " + std::to_string(ep) + " does not divide --dp " + std::to_string(dp) + " (NxD lays expert parallelism inside data parallelism)");
  notes.push_back("dp " + std::to_string(dp) + " -> " + std::to_string(ep) + ": the ep size must divide dp (NxD lays expert parallelism inside it)");
  dp = ep;
  return ep;
}

std::string StagesString(const std::vector<int64_t>& b, int virtual_stages) {
  std::string s;
  for (size_t i = 0; i + 1 < b.size(); ++i) s += (i ? "/" : "") + std::to_string(b[i + 1] - b[i]);
  return virtual_stages > 1 ? s + " (" + std::to_string(virtual_stages) + " virtual stages per pp rank)" : s;
}

}  // namespace

SourceTag FindSourceTag(const std::string& src_arg, bool verify, ckpt::Env* env, const LogFn& log) {
  const std::string src = ckpt::WithoutTrailingSeparators(src_arg);
  if (!env->IsDirectory(src)) throw Error(src + ": no such folder");
  if (ckpt::LooksLikeTag(env, src)) {
    if (ckpt::IsModelOnlyFolder(env, src))
      log(src + ": model/ alone (as NxD's checkpoint_converter.py writes it): read as a weights-only tag");
    else if (!env->Exists(src + "/" + ckpt::kDoneMarker))
      throw Error(src + ": has no `done` marker, so its save never finished; refusing to read an incomplete tag");
    return {src, false};
  }
  const auto newest = ckpt::FindLatestCheckpoint(env, src, verify, log);
  if (!newest) throw Error(src + ": is neither a checkpoint tag (no model/ folder) nor a folder holding a complete tag");
  log("source: " + *newest + " (the newest complete tag in " + src + ")");
  return {*newest, verify};
}

uint64_t CurrentRss() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

uint64_t PeakRss() {
  // VmHWM, not getrusage's ru_maxrss: Linux carries the latter over from the
  // process that forked us, so a tool started by a large parent would report its size.
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

ReshardSummary RunReshard(const ReshardArgs& a, ckpt::Env* env, const LogFn& log) {
  const auto t0 = Clock::now();
  ReshardSummary sum;
  const SourceTag found = FindSourceTag(a.src, a.verify_source, env, log);
  sum.src_tag = found.tag;
  const bool check_here = a.verify_source && !found.checked && a.group->rank() == 0;
  // A source whose manifest records its files' CRC-32s is checked with what the copy reads of
  // it (SourceCheck's folded check); one without (NxD's) is loaded whole beside the copy.
  const bool folded = a.verify_source && !found.checked && env->Exists(found.tag + "/" + ckpt::kManifestFile);
  ckpt::ReadFold reads;
  ckpt::FoldingEnv folding(env, &reads);
  SourceCheck check(env, found.tag, check_here, a.weights_only, folded ? &reads : nullptr, a.group);
  try {
    const ckpt::OpenedSource src = ckpt::SourceRegistry::Default().Open(
        folded ? &folding : env, sum.src_tag, {.hints = a.hints, .weights_only = a.weights_only, .trust_first_replica = a.trust_first_replica}, "tag");
    if (src.optimizer_skipped) sum.notes.push_back("--weights_only: the source's optimizer state is not read; the target has none");
    for (const auto& n : src.notes) sum.notes.push_back(n);
    sum.bytes_read = src.bytes;
    ReshardArgs checked = a;
    checked.source_check = &check;
    return WriteInLayout(*src.state, src.tag_name, checked, env, log, t0, std::move(sum));
  } catch (const Error&) {
    check.ThrowIfFailed(log);
    throw;
  }
}

ReshardSummary WriteInLayout(const ckpt::LogicalState& source, const std::string& source_tag_name, const ReshardArgs& a, ckpt::Env* env,
                             const LogFn& log, std::chrono::steady_clock::time_point t0, ReshardSummary sum) {
  const ckpt::LogicalState* src = &source;
  const ckpt::TagDescription& L = src->layout();
  sum.format = L.format;
  sum.from = L.grid;
  sum.from_bounds = L.stage_bounds, sum.from_virtual_stages = L.virtual_stages;

  ckpt::RankGrid to;
  to.tp = a.tp, to.pp = a.pp;
  to.dp = a.dp.value_or(L.grid.dp);
  to.zero1 = a.zero1.value_or(L.grid.zero1);
  if (to.zero1 && to.dp < 1) throw Error("--dp must be at least 1");
  to.ep = TargetEp(a, L, to.zero1, to.dp, sum.notes);
  if (int64_t{to.tp} * to.pp * to.dp > ckpt::kMaxRanks) throw Error("the target grid has more than " + std::to_string(ckpt::kMaxRanks) + " ranks");
  // The plan holds an entry per tensor per rank file; a grid past any real job's (tp 64, pp 32,
  // dp 32 with ZeRO-1 is 65,536 files) is refused before planning grows without bound.
  if (const int64_t files = int64_t{to.tp} * to.pp * ((to.zero1 ? to.dp : 1) + to.ep - 1); files > kMaxRankFiles)
    throw Error("the target grid tp=" + std::to_string(to.tp) + " pp=" + std::to_string(to.pp) + " dp=" + std::to_string(to.dp) +
                (to.zero1 ? " with ZeRO-1" : "") + " needs " + std::to_string(files) + " rank files; one pass writes at most " +
                std::to_string(kMaxRankFiles));
  const ckpt::ModelFormat to_format = TargetFormat(L.format, a);
  if (const std::string why = to_format.CheckTensorParallel(to.tp); !why.empty()) throw Error("--tp " + std::to_string(to.tp) + ": " + why);
  if (const std::string why = to_format.CheckExpertParallel(to.ep); !why.empty()) throw Error("--ep " + std::to_string(to.ep) + ": " + why);
  if (ckpt::BackendMatters(to_format, to.tp) && to_format.hw_backend == ckpt::HwBackend::kUnknown)
    throw Error("--tp " + std::to_string(to.tp) + " with kv_size_multiplier " + std::to_string(to_format.kv_size_multiplier) +
                " lays KV heads out by the backend, which the source's data cannot tell; give --out_hw_backend trn1 or trn2");
  if (to_format.family == ckpt::ModelFamily::kHfLlama &&
      (to_format.kv_size_multiplier != L.format.kv_size_multiplier || (to_format.hw_backend != L.format.hw_backend && ckpt::BackendMatters(to_format, to.tp))))
    sum.notes.push_back(std::string("KV replication: kv_size_multiplier ") + std::to_string(L.format.kv_size_multiplier) + " (" +
                        ckpt::BackendName(L.format.hw_backend) + ") -> " + std::to_string(to_format.kv_size_multiplier) + " (" +
                        ckpt::BackendName(to_format.hw_backend) + ")");
  sum.format = to_format;
  if (const std::string note = ckpt::MegatronKvReplicationNote(to_format, to.tp); !note.empty()) sum.notes.push_back("warning: " + note);
  std::optional<ckpt::RenamedState> renamed;
  if (!ckpt::SameLogicalNames(L.format, to_format)) {
    if (to_format.family != L.format.family) {
      if (L.has_optimizer)
        throw Error(sum.src_tag + ": --out_model_family " + ckpt::FamilyName(to_format.family) +
                    " re-lays weights only: the two families group optimizer state differently (ckpt::FamilyGrouping); pass --weights_only");
      sum.notes.push_back(std::string("model family: ") + ckpt::FamilyName(L.format.family) + " -> " + ckpt::FamilyName(to_format.family) +
                          (to_format.family == ckpt::ModelFamily::kMegatron ? " (vocabulary padded to a multiple of 128 x tp, NxDT's default)" : ""));
    }
    renamed.emplace(*src, to_format);
    src = &*renamed;
  }
  sum.to = to;
  const bool layout_kept = a.keep_virtual_stages && to.pp == L.grid.pp && a.pipeline_cuts.empty();
  sum.to_virtual_stages = a.virtual_pipeline_size.value_or(layout_kept ? L.virtual_stages : 1);
  sum.to_bounds = ckpt::VirtualStageBounds(L.format.layers, to.pp, sum.to_virtual_stages, a.pipeline_cuts);
  if (L.master_weights && !to.zero1)
    throw Error(sum.src_tag + ": holds fp32 master weights (ZeRO-1 sharded_master_weights), which a plain optimizer file cannot hold; "
                "keep --zero1 (any --dp, 1 included)");
  sum.vocab_rows_from = L.format.PaddedVocab(L.grid.tp);
  sum.vocab_rows_to = to_format.PaddedVocab(to.tp);
  if (sum.vocab_rows_to < sum.vocab_rows_from)
    sum.notes.push_back("the vocabulary padding shrinks from " + std::to_string(sum.vocab_rows_from) + " to " +
                        std::to_string(sum.vocab_rows_to) + " rows: the padding rows past it are dropped (no token uses them)");
  if (sum.vocab_rows_to > sum.vocab_rows_from)
    sum.notes.push_back("the vocabulary padding grows from " + std::to_string(sum.vocab_rows_from) + " to " +
                        std::to_string(sum.vocab_rows_to) + " rows: the new padding rows are zero");
  if (!L.format_from_manifest) sum.notes.push_back("model format (no manifest records it): " + L.format.Describe());
  if (!L.has_optimizer && !a.weights_only) sum.notes.push_back("the source holds no optimizer state; the target has none either");
  const bool xser = a.save_xser.value_or(src->xser());
  sum.notes.push_back(std::string("container: ") + (xser ? "xser (X.pt, X.pt.tensors/tensor_<tid>.pt, X.pt.info.pt)" : "plain .pt") +
                      (a.save_xser ? "" : ", as the source's"));

  // The output, named as the trainer names tags with --checkpoint_dir.
  if (a.dst.empty() == a.checkpoint_dir.empty()) throw Error("give exactly one of DST (the new tag folder) and --checkpoint_dir");
  if (!a.dst.empty()) {
    sum.dst_tag = ckpt::WithoutTrailingSeparators(a.dst);
  } else {
    ckpt::TagName tn;
    const auto src_name = ckpt::ParseTagName(source_tag_name);
    tn.name = src_name ? src_name->name : "megatron";
    tn.step = src->step(), tn.consumed_samples = src->consumed_samples();
    if (!src->consumed_samples_known())
      sum.notes.push_back(source_tag_name + " records no consumed samples (NxD's own trainer keeps none); the new tag's name says 0");
    sum.dst_tag = a.checkpoint_dir + "/" + ckpt::FormatTagName(tn);
  }
  ckpt::CheckOutputs({{sum.dst_tag, a.dst.empty() ? "--checkpoint_dir" : "DST", true}}, {{sum.src_tag, "SRC"}});

  // Memory: each writing thread is a stream (ckpt/shard/stream_budget.h): one
  // chunk of output (kept in the planner's pool for the next file, never more
  // chunks than threads) and the source pages it was copied from.
  const uint64_t base = CurrentRss() + src->ReadMemory() + (a.source_check ? a.source_check->memory() : 0);
  sum.stream_chunk = ckpt::StreamChunk(a.memory_budget, base, a.threads);
  if (a.source_check) a.source_check->Start();

  ckpt::FingerprintCollector fingerprints;
  Planner planner(*src, to_format, to, sum.to_bounds, sum.to_virtual_stages, sum.stream_chunk, &fingerprints);
  std::vector<PlannedFile> plan = planner.Plan();
  for (const char* f : {ckpt::kSchedulerFile, ckpt::kUserContentFile})
    if (auto v = src->TagFile(f)) plan.push_back({{f, std::move(*v), {}}, 0, -1, -1});

  if (a.group->rank() == 0) {
    log(std::string(a.tool == "reshard" ? "resharding " : "writing ") + sum.src_tag + ": " + L.grid.ToString() + ", stages " + StagesString(L.stage_bounds, L.virtual_stages) + " -> " +
        to.ToString() + ", stages " + StagesString(sum.to_bounds, sum.to_virtual_stages));
    for (const auto& n : sum.notes) log("note: " + n);
  }
  if (a.dry_run) {
    uint64_t bytes = 0;
    for (const auto& f : plan) bytes += f.bytes;
    sum.files = static_cast<int>(plan.size());
    sum.bytes_written = bytes;
    if (a.group->rank() == 0)
      for (const auto& f : plan) log("would write " + f.file.relpath + " (" + ckpt::HumanBytes(f.bytes) + " of tensors)");
    if (a.source_check) a.source_check->Wait(log);
    sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    sum.peak_rss = PeakRss();
    return sum;
  }

  // The whole output must fit before any of it is written: a hostile or mistyped source
  // declaring a huge model ends here, not after filling the disk.
  if (a.group->rank() == 0) {
    uint64_t bytes = 0;
    for (const auto& f : plan) bytes += f.bytes;
    const std::filesystem::path dst(sum.dst_tag);
    const std::string parent = dst.has_parent_path() ? dst.parent_path().string() : ".";
    if (env->IsDirectory(parent))
      if (const uint64_t free = env->AvailableBytes(parent); bytes > free)
        throw Error(sum.dst_tag + ": the output needs " + ckpt::HumanBytes(bytes) + " of tensors, but " + parent + " has " + ckpt::HumanBytes(free) +
                    " free; nothing was written");
  }
  const ckpt::StagedTag staged = ckpt::StageFor(sum.dst_tag, a.tool);
  std::unique_ptr<ckpt::FileLock> writing;  // rank 0's writer lock, until the tag is published or deleted
  if (a.group->rank() == 0) writing = ckpt::PrepareTarget(env, staged, a.overwrite, log);
  const std::string save_id = ckpt::BeginStaged(env, staged, *a.group, a.tool);

  auto write_and_commit = [&] {
    std::vector<ckpt::FileToWrite> mine;
    std::vector<uint64_t> tensor_bytes;  // what the progress bar counts
    std::stable_sort(plan.begin(), plan.end(), [](const auto& x, const auto& y) { return x.bytes > y.bytes; });  // big first: balance
    for (auto& f : plan) {
      if (!ckpt::WritesUnit(f.unit, a.group->rank(), a.group->size())) continue;
      if (!xser || f.unit < 0) {  // tag-level files (scheduler, user content) are plain .pt in either container, as NxD writes them
        mine.push_back(f.file), tensor_bytes.push_back(f.bytes);
        continue;
      }
      const auto expert = [&](const std::string& key) { return ckpt::IsExpertWeight(to_format, key); };
      for (auto& part : f.ep < 0 ? ckpt::XserFiles(f.file) : ckpt::XserFiles(f.file, expert, f.ep > 0)) {
        tensor_bytes.push_back(part.value.is_tensor() ? part.value.as_tensor().nbytes() : 0);
        mine.push_back(std::move(part));
      }
    }
    sum.files = static_cast<int>(mine.size());
    sum.bytes_written = ckpt::WriteRankFilesReporting(env, staged.staging, a.group->rank(), save_id, mine, tensor_bytes, a.progress_bar, log, t0,
                                                      [&] { return fingerprints.ToJson(); });
    ckpt::CommitInfo ci;
    ci.save_id = save_id;
    ci.step = src->step();
    ci.consumed_samples = src->consumed_samples();
    ci.grid = to;
    ci.model = to_format;
    if (src->layout().has_optimizer) ci.optimizer_grouping = src->layout().grouping;
    ci.stages = ckpt::StageMapOf(sum.to_bounds, sum.to_virtual_stages);
    ci.master_weights = src->layout().has_optimizer && src->layout().master_weights;  // the planner copies them when the source has them
    ci.complete_manifest = [&](const std::vector<ckpt::RankRecord>& records, ckpt::Manifest& m) {
      ckpt::FingerprintCollector all;
      for (size_t r = 0; r < records.size(); ++r)
        all.MergeJson(records[r].extra, ckpt::RankRecordPath(staged.staging, static_cast<int>(r)));
      m.tensors = all.Finish(ckpt::LogicalTensors(*src));
      // What the source says it holds is what was written: a source whose
      // data no longer match its recorded fingerprints leaves no `done`.
      if (const auto& want = src->recorded_fingerprints())
        for (const auto& [name, fields] : *m.tensors)
          for (const auto& [field, f] : fields) {
            const auto n = want->find(name);
            if (n == want->end() || !n->second.count(field)) continue;
            if (!(n->second.at(field) == f))
              throw Error(src->path() + ": " + name + " " + field + " reads with fingerprint " + ckpt::CrcHex(f.crc32) +
                          ", but the source records " + ckpt::CrcHex(n->second.at(field).crc32) + ": its data changed since it was written");
          }
    };
    // Rank 0 commits for the group; a source that no longer matches its
    // fingerprints leaves nothing behind.
    if (a.source_check) a.source_check->Wait(log);
    ckpt::CommitStaged(env, staged, *a.group, ci, &writing);
  };
  try {
    write_and_commit();
  } catch (const Error&) {
    // A write that failed (a full disk) leaves nothing behind. Under mpirun
    // the tool aborts the group instead: its peers may still be writing, and
    // the staging folder has no `done` either way.
    // Only while this process still holds the writer lock: once CommitStaged
    // released it, the staging folder may be a next writer's.
    if (a.group->size() == 1 && writing && env->Exists(staged.staging)) ckpt::DeleteTag(env, staged.staging);
    throw;
  }
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  sum.peak_rss = PeakRss();
  return sum;
}

}  // namespace ckpt
