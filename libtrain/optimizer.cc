#include "libtrain/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include <tbb/parallel_for.h>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/spec/ep_zero1_state.h"
#include "ckpt/spec/partition.h"
#include "ckpt/spec/model_family.h"
#include "libtrain/comm.h"

namespace train {

AdamW::AdamW(const Model& m, const AdamWConfig& c, Comm* dp, const ExpertGroups& experts) : c_(c), dp_(dp) {
  if (dp_) dp_size_ = dp_->size(), dp_rank_ = dp_->rank();
  reduce_[0].comm = dp_, reduce_[0].size = dp_size_, reduce_[0].rank = dp_rank_;
  // Expert parallelism: the experts' own group (NeuronEPZero1Optimizer: expert state over expert-dp).
  const bool ep = experts.ep && experts.ep->size() > 1;
  if (ep) ep_ = experts.ep, reduce_[1].comm = experts.expert_dp, reduce_[1].size = experts.expert_dp->size(), reduce_[1].rank = experts.expert_dp->rank();
  std::vector<std::string> names;
  std::map<std::string, const std::vector<int64_t>*> shapes;  // this rank's slices
  for (const auto& p : m.layout()) names.push_back(p.name), shapes[p.name] = &m.param(p.name).shape();
  // NxDT's grouping for the model's family, with do_layer_norm_weight_decay as NxDT means it there (ckpt::FamilyGrouping).
  const ckpt::ModelFormat& f = m.format();
  const ckpt::GroupingRule rule = ckpt::NxdtGroupingRule(c.do_layer_norm_weight_decay);
  // A tied copy NeMo does not list takes the embedding's values after every step.
  if (const std::string copy = m.SameStageTiedCopy(); !copy.empty()) {
    names = ckpt::GroupedNames(names, copy, rule);
    if (std::find(names.begin(), names.end(), copy) == names.end())
      mirror_ = {copy, ckpt::ParamName(f, ckpt::Module::kEmbedding)};
    else
      copy_slot_ = copy;
  }
  format_ = f, names_ = names;
  const ckpt::Grouping grouping = ckpt::FamilyGrouping(f, names, rule);
  group_decays_ = grouping.group_decays;
  for (const auto& entry : grouping.order) {
    order_.push_back(entry.name);
    group_.push_back(entry.group);
    Slot s;
    s.shape = *shapes.at(entry.name);
    s.rows = s.shape.empty() ? 1 : s.shape[0];
    s.row_elems = s.rows ? ckpt::ShapeNumel(s.shape) / s.rows : 0;
    s.group = ep && m.IsExpertWeight(entry.name) ? 1 : 0;
    ReduceGroup& rg = reduce_[s.group];
    const int shards = c.zero1 ? rg.size : 1;
    s.shard_rows = ckpt::Zero1ShardRows(s.rows, shards);
    s.own = shards > 1 ? rg.rank : 0;
    std::vector<int64_t> state_shape = s.shape;
    if (!state_shape.empty()) state_shape[0] = s.shard_rows;
    m_.push_back(ckpt::Tensor::Zeros(ckpt::DType::kFloat32, state_shape));
    v_.push_back(ckpt::Tensor::Zeros(ckpt::DType::kFloat32, state_shape));
    if (Sharded()) grad_shard_.emplace_back(static_cast<size_t>(s.shard_rows * s.row_elems));
    // Where the parameter's chunk lies in its group's ZeRO-1 bucket segment.
    offset_.push_back(rg.segment);
    rg.segment += static_cast<size_t>(s.shard_rows * s.row_elems);
    rg.ids.push_back(order_.size() - 1);
    slot_.push_back(std::move(s));
  }
  ResetMasterWeights(m);
}

void AdamW::ResetMasterWeights(const Model& m) {
  master_.clear();
  if (!c_.master_weights) return;
  for (size_t i = 0; i < order_.size(); ++i) {
    const Slot& s = slot_[i];
    const auto [lo, hi] = s.Chunk(s.own);
    ckpt::Tensor w = ckpt::Tensor::Zeros(ckpt::DType::kFloat32, m_[i].shape());
    const float* p = reinterpret_cast<const float*>(m.param(order_[i]).data());
    std::copy(p + lo * s.row_elems, p + hi * s.row_elems, reinterpret_cast<float*>(w.mutable_data()));
    master_.push_back(std::move(w));
  }
}

namespace {
// Sum of squares of n floats, in fixed-size chunks summed in sequence so the
// result does not depend on the threads.
double SumSquares(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(chunks);
  tbb::parallel_for(int64_t{0}, chunks, [&](int64_t c) {
    double s = 0;
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) s += double{x[i]} * x[i];
    part[c] = s;
  });
  double total = 0;
  for (double s : part) total += s;
  return total;
}

void Scale(float* x, int64_t n, double by) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 16), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) x[i] = static_cast<float>(x[i] * by);
  });
}

// Over the whole model: this rank's slices, copies counted once
// (Model::CountsInNorm), summed over the tensor and pipeline ranks.
// Under expert parallelism `ep` adds the other ep ranks' experts.
double SumSquares(Model& m, bool grads, Comm* ep) {
  double total = 0, experts = 0;
  for (const auto& p : m.layout()) {
    const ckpt::Tensor& t = grads ? m.grad(p.name) : m.param(p.name);
    const int64_t rows = t.dim() ? t.shape()[0] : 1;
    (ep && m.IsExpertWeight(p.name) ? experts : total) += SumSquares(reinterpret_cast<const float*>(t.data()), t.numel() / rows * m.CountedRows(p.name));
  }
  if (ep) ep->AllReduceSum(&experts, 1);
  total += experts;
  m.SumOverModel(&total, 1);
  return total;
}
}  // namespace

std::span<float> AdamW::Gradient(Model& m, size_t i) {
  if (Sharded()) return grad_shard_[i];
  ckpt::Tensor& g = m.grad(order_[i]);
  return {reinterpret_cast<float*>(g.mutable_data()), static_cast<size_t>(g.numel())};
}

void AdamW::AllReduceGroup(Model& m, const ReduceGroup& g) {
  if (g.size < 2) return;
  std::vector<float> bucket;
  for (size_t i : g.ids) {
    const ckpt::Tensor& t = m.grad(order_[i]);
    bucket.insert(bucket.end(), reinterpret_cast<const float*>(t.data()), reinterpret_cast<const float*>(t.data()) + t.numel());
  }
  g.comm->AllReduceSum(bucket.data(), bucket.size());
  size_t at = 0;
  for (size_t i : g.ids) {
    ckpt::Tensor& t = m.grad(order_[i]);
    std::copy_n(bucket.data() + at, t.numel(), reinterpret_cast<float*>(t.mutable_data()));
    at += static_cast<size_t>(t.numel());
  }
}

void AdamW::ReduceScatterGroup(Model& m, const ReduceGroup& g) {
  // A bucket holding rank r's chunk of each of the group's parameters in segment r (at offset_[i]),
  // so rank r receives the sums of its own chunks.
  std::vector<float> bucket(g.segment * g.size, 0.0f), mine(g.segment);
  for (size_t i : g.ids) {
    const Slot& s = slot_[i];
    const float* grad = reinterpret_cast<const float*>(m.grad(order_[i]).data());
    for (int r = 0; r < g.size; ++r) {
      const auto [lo, hi] = s.Chunk(r);
      std::copy(grad + lo * s.row_elems, grad + hi * s.row_elems, bucket.data() + r * g.segment + offset_[i]);
    }
  }
  if (g.size > 1) g.comm->ReduceScatterSum(bucket.data(), mine.data(), g.segment);
  else mine = bucket;
  for (size_t i : g.ids) std::copy_n(mine.data() + offset_[i], grad_shard_[i].size(), grad_shard_[i].data());
}

double AdamW::ReduceAndClip(Model& m, double scale, double max_norm) {
  // One collective per group: the model's flat gradient buffer (no expert parallelism), each
  // group's gradients, or with ZeRO-1 each group's bucket of chunks.
  if (Sharded()) {
    for (const ReduceGroup& g : reduce_) ReduceScatterGroup(m, g);
  } else if (!ep_) {
    if (dp_ && dp_size_ > 1) dp_->AllReduceSum(m.flat_grads(), m.flat_size());
  } else {
    for (const ReduceGroup& g : reduce_) AllReduceGroup(m, g);
  }
  double sum_squares = 0, expert_squares = 0;  // this rank's experts under expert parallelism
  for (size_t i = 0; i < order_.size(); ++i) {
    const std::span<float> g = Gradient(m, i);
    const int64_t n = static_cast<int64_t>(g.size());
    if (scale != 1.0) Scale(g.data(), n, scale);
    // A tensor-parallel replica counts once: the rows of this rank's part that count (a ZeRO-1 shard holds rows from `lo`).
    const Slot& s = slot_[i];
    const int64_t lo = Sharded() ? s.Chunk(s.own).first : 0;
    const int64_t counted = std::clamp<int64_t>(m.CountedRows(order_[i]) - lo, 0, s.row_elems ? n / s.row_elems : 0);
    (s.group ? expert_squares : sum_squares) += SumSquares(g.data(), counted * s.row_elems);
  }
  // ZeRO-1 shards partition every group over dp (expert chunks: one per ep and expert-dp rank);
  // whole gradients are replicated over dp but each ep rank's experts are its own.
  if (!Sharded() && ep_) ep_->AllReduceSum(&expert_squares, 1);
  sum_squares += expert_squares;
  if (Sharded()) dp_->AllReduceSum(&sum_squares, 1);
  m.SumOverModel(&sum_squares, 1);
  const double norm = std::sqrt(sum_squares);
  const double coef = max_norm / (norm + 1e-6);
  if (max_norm > 0 && coef < 1)
    for (size_t i = 0; i < order_.size(); ++i) {
      const std::span<float> g = Gradient(m, i);
      Scale(g.data(), static_cast<int64_t>(g.size()), coef);
    }
  return norm;
}

void AdamW::MirrorTiedCopy(Model& m) const {
  if (mirror_.first.empty()) return;
  const ckpt::Tensor& from = m.param(mirror_.second);
  std::memcpy(m.param(mirror_.first).mutable_data(), from.data(), from.nbytes());
}

void AdamW::Step(Model& m, double lr) {
  ++step_;
  const double bc1 = 1 - std::pow(c_.beta1, static_cast<double>(step_));
  const double bc2 = 1 - std::pow(c_.beta2, static_cast<double>(step_));
  const float step_size = static_cast<float>(lr / bc1), bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float b1 = static_cast<float>(c_.beta1), b2 = static_cast<float>(c_.beta2), eps = static_cast<float>(c_.eps);
  for (size_t i = 0; i < order_.size(); ++i) {
    const Slot& s = slot_[i];
    // This rank's rows of the parameter (all of them unless sharded).
    const auto [lo, hi] = s.Chunk(s.own);
    float* param = reinterpret_cast<float*>(m.param(order_[i]).mutable_data()) + lo * s.row_elems;
    // With master weights the update runs on the float32 master copy, and
    // the parameter becomes its bfloat16 rounding.
    float* w = master_.empty() ? param : reinterpret_cast<float*>(master_[i].mutable_data());
    const float* g = Gradient(m, i).data();
    float* mo = reinterpret_cast<float*>(m_[i].mutable_data());
    float* vo = reinterpret_cast<float*>(v_[i].mutable_data());
    const float decay = group_decays_[group_[i]] ? static_cast<float>(1 - lr * c_.weight_decay) : 1.0f;
    const int64_t n = (hi - lo) * s.row_elems;
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 16), [&](const tbb::blocked_range<int64_t>& r) {
      for (int64_t j = r.begin(); j < r.end(); ++j) {  // elementwise: the same result on any split
        w[j] *= decay;
        mo[j] = b1 * mo[j] + (1 - b1) * g[j];
        vo[j] = b2 * vo[j] + (1 - b2) * g[j] * g[j];
        w[j] -= step_size * mo[j] / (std::sqrt(vo[j]) / bc2_sqrt + eps);
        if (w != param) param[j] = ckpt::RoundToBFloat16(w[j]);
      }
    });
  }
  if (!Sharded()) return MirrorTiedCopy(m);
  // Every rank's updated rows back into the whole parameters: one all-gather of each group's segments.
  for (const ReduceGroup& g : reduce_) {
    std::vector<float> mine(g.segment, 0.0f), all(g.segment * g.size);
    for (size_t i : g.ids) {
      const Slot& s = slot_[i];
      const auto [lo, hi] = s.Chunk(s.own);
      const float* p = reinterpret_cast<const float*>(m.param(order_[i]).data());
      std::copy(p + lo * s.row_elems, p + hi * s.row_elems, mine.data() + offset_[i]);
    }
    if (g.size > 1) g.comm->AllGather(mine.data(), all.data(), g.segment);
    else all = mine;
    for (size_t i : g.ids) {
      const Slot& s = slot_[i];
      float* whole = reinterpret_cast<float*>(m.param(order_[i]).mutable_data());
      for (int r = 0; r < g.size; ++r) {
        const auto [lo, hi] = s.Chunk(r);
        std::copy_n(all.data() + r * g.segment + offset_[i], (hi - lo) * s.row_elems, whole + lo * s.row_elems);
      }
    }
  }
  MirrorTiedCopy(m);
}

ckpt::OptimizerFile AdamW::FileOfIds(const std::function<bool(size_t)>& in, double lr) const {
  ckpt::OptimizerFile f;
  f.zero1 = c_.zero1;
  std::vector<int64_t> file_id(order_.size(), -1);  // ours -> the file's, numbered from 0 in id order
  for (size_t i = 0; i < order_.size(); ++i) {
    if (!in(i)) continue;
    file_id[i] = static_cast<int64_t>(f.params.size());
    ckpt::Tensor step = ckpt::Tensor::Zeros(ckpt::DType::kFloat32, {});
    reinterpret_cast<float*>(step.mutable_data())[0] = static_cast<float>(step_);
    ckpt::ParamState ps{ckpt::Value(step), ckpt::Value(m_[i]), ckpt::Value(v_[i]), std::nullopt, slot_[i].shape};
    if (SavesMasterWeights()) ps.master = ckpt::Value(master_[i]);
    f.params.push_back(std::move(ps));
  }
  f.param_groups = ckpt::Value::List();
  // Every group of the grouping, empty ones too: NeMo's rule has already
  // dropped its empty groups, and NxDT's HF-style models keep theirs (as
  // NeuronEPZero1Optimizer's recursive_filter keeps a part's empty groups).
  for (int g = 0; g < static_cast<int>(group_decays_.size()); ++g) {
    ckpt::Value ids = ckpt::Value::List();
    for (size_t i = 0; i < order_.size(); ++i)
      if (group_[i] == g && file_id[i] >= 0) ids.as_seq().items.push_back(ckpt::Value(file_id[i]));
    f.param_groups.as_seq().items.push_back(GroupDict(g, ids, lr));
  }
  return f;
}

ckpt::Value AdamW::GroupDict(int g, const ckpt::Value& ids, double lr) const {
  ckpt::Value pg = ckpt::Value::NewDict();
  auto& d = pg.as_dict();
  // NeMo's groups carry is_expert, after the no-decay group's weight_decay, as its dict literals
  // order them (utils.py get_params_for_weight_decay_optimization; False for every group, experts
  // included: tests/data/upstream/nxd_mixtral's Megatron-style tags).
  if (Megatron() && !group_decays_[g]) d.Set("weight_decay", ckpt::Value(0.0));
  if (Megatron()) d.Set("is_expert", ckpt::Value(false));
  d.Set("lr", ckpt::Value(lr));
  // A list, as NxD's saves have it (torch_xla's container rewrite turns AdamW's tuple into one).
  d.Set("betas", ckpt::Value::List({ckpt::Value(c_.beta1), ckpt::Value(c_.beta2)}));
  d.Set("eps", ckpt::Value(c_.eps));
  d.Set("weight_decay", ckpt::Value(group_decays_[g] ? c_.weight_decay : 0.0));
  d.Set("amsgrad", ckpt::Value(false));
  d.Set("maximize", ckpt::Value(false));
  d.Set("foreach", ckpt::Value());
  d.Set("capturable", ckpt::Value(false));
  d.Set("params", ids);
  return pg;
}

ckpt::Value AdamW::StateDict(double lr) const {
  if (!ep_) return FileOfIds([](size_t) { return true; }, lr).ToValue();
  // NxD's NeuronEPZero1Optimizer: the non-expert optimizer's file and the expert one's, combined.
  return ckpt::EpZero1File{FileOfIds([&](size_t i) { return slot_[i].group == 0; }, lr),
                           FileOfIds([&](size_t i) { return slot_[i].group == 1; }, lr)}
      .ToValue();
}

ckpt::OptimizerFile AdamW::Combined(const ckpt::EpZero1File& file) const {
  std::vector<size_t> ours[2];  // our ids of the non-expert and of the expert optimizer, in id order
  for (size_t i = 0; i < order_.size(); ++i) ours[slot_[i].group].push_back(i);
  const ckpt::OptimizerFile* parts[2] = {&file.non_expert, &file.expert};
  ckpt::OptimizerFile f;
  f.zero1 = true;
  f.params.resize(order_.size());
  std::vector<std::vector<int64_t>> groups(group_decays_.size());
  for (int p = 0; p < 2; ++p) {
    const char* part = p ? "expert" : "non-expert";
    if (parts[p]->params.size() != ours[p].size())
      throw ckpt::Error(std::string("optimizer state's ") + part + " optimizer holds " + std::to_string(parts[p]->params.size()) +
                        " parameters, this run's " + std::to_string(ours[p].size()));
    for (size_t k = 0; k < ours[p].size(); ++k) f.params[ours[p][k]] = parts[p]->params[k];
    const auto& pgs = parts[p]->param_groups.as_seq().items;
    if (pgs.size() != groups.size())
      throw ckpt::Error(std::string("optimizer state's ") + part + " optimizer has " + std::to_string(pgs.size()) + " param_groups, this run " +
                        std::to_string(groups.size()));
    for (size_t g = 0; g < pgs.size(); ++g)
      for (const auto& id : pgs[g].as_dict().At("params").as_seq().items) {
        const int64_t k = ckpt::AsInteger(id, "optimizer 'param_groups' id");
        if (k < 0 || k >= static_cast<int64_t>(ours[p].size()))
          throw ckpt::Error(std::string("optimizer state's ") + part + " param_groups list id " + std::to_string(k) + ", past its parameters");
        groups[g].push_back(static_cast<int64_t>(ours[p][k]));
      }
  }
  // The groups as one optimizer would number them (FileIds then checks them against this run's).
  f.param_groups = ckpt::Value::List();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::sort(groups[g].begin(), groups[g].end());
    ckpt::Value ids = ckpt::Value::List();
    for (int64_t i : groups[g]) ids.as_seq().items.push_back(ckpt::Value(i));
    f.param_groups.as_seq().items.push_back(GroupDict(static_cast<int>(g), ids, 0.0));
  }
  return f;
}

std::vector<size_t> AdamW::FileIds(const ckpt::Value& groups, bool zero1) {
  // The ids each non-empty group must list, as StateDict writes them.
  std::vector<std::vector<int64_t>> want(group_decays_.size());
  for (size_t i = 0; i < order_.size(); ++i) want[group_[i]].push_back(static_cast<int64_t>(i));
  std::erase_if(want, [](const auto& ids) { return ids.empty(); });
  std::vector<size_t> ids(order_.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i;
  regrouped_.clear();
  std::vector<std::vector<int64_t>> got;
  if (!groups.is_seq()) throw ckpt::Error("optimizer 'param_groups' is a " + groups.kind_name() + ", not a list");
  for (const auto& g : groups.as_seq().items) {
    if (!g.is_dict()) throw ckpt::Error("optimizer 'param_groups' holds a " + g.kind_name() + ", not a dict");
    const ckpt::Value& ids = g.as_dict().At("params");
    if (!ids.is_seq()) throw ckpt::Error("optimizer 'param_groups' params is a " + ids.kind_name() + ", not a list");
    got.emplace_back();
    for (const auto& id : ids.as_seq().items) got.back().push_back(ckpt::AsInteger(id, "optimizer 'param_groups' id"));
  }
  std::erase_if(got, [](const auto& ids) { return ids.empty(); });
  if (got == want) return ids;
  // GPT's tied weight listed twice at pp = 1, numbered as torch numbers it: the embedding's position
  // holds the copy's id (Optimizer.state_dict's pack_group). A plain state dict keys the weight's state
  // by that id; a ZeRO-1 one by position, the copy's shard without state and with a stale master
  // (NxD's gradient hook; tests/data/upstream/nxdt_megatron): both are read from the embedding's.
  if (!copy_slot_.empty()) {
    const size_t e = std::find(order_.begin(), order_.end(), ckpt::ParamName(format_, ckpt::Module::kEmbedding)) - order_.begin();
    const size_t c = std::find(order_.begin(), order_.end(), copy_slot_) - order_.begin();
    std::vector<int64_t> flat;
    std::vector<size_t> got_sizes, want_sizes;
    for (const auto& g : got) flat.insert(flat.end(), g.begin(), g.end()), got_sizes.push_back(g.size());
    for (const auto& g : want) want_sizes.push_back(g.size());
    bool torch_shared = got_sizes == want_sizes && e < flat.size() && c < flat.size() && flat[e] == static_cast<int64_t>(c);
    for (size_t k = 0; torch_shared && k < flat.size(); ++k) torch_shared = flat[k] == static_cast<int64_t>(k) || k == e;
    if (torch_shared) {
      if (zero1) ids[c] = e;
      else ids[e] = c;
      return ids;
    }
  }
  // What shardkit's trainer wrote before (Megatron-style names only), read by name: grouped by name,
  // and at pp = 1 without GPT's tied output copy, whose state is then the embedding's.
  if (Megatron()) {
    const std::string emb = ckpt::ParamName(format_, ckpt::Module::kEmbedding);
    std::vector<std::string> without_copy = names_;
    std::erase_if(without_copy, [&](const std::string& n) { return n == copy_slot_; });
    const ckpt::GroupingRule rule = ckpt::NxdtGroupingRule(c_.do_layer_norm_weight_decay);
    std::vector<ckpt::Grouping> older = {ckpt::FamilyGrouping(format_, names_, ckpt::GroupingRule::kNameSplit)};
    if (without_copy.size() != names_.size())
      older.push_back(ckpt::FamilyGrouping(format_, without_copy, rule)),
          older.push_back(ckpt::FamilyGrouping(format_, without_copy, ckpt::GroupingRule::kNameSplit));
    for (const ckpt::Grouping& g : older) {
      std::vector<std::vector<int64_t>> theirs(g.groups);
      for (size_t j = 0; j < g.order.size(); ++j) theirs[g.order[j].group].push_back(static_cast<int64_t>(j));
      std::erase_if(theirs, [](const auto& x) { return x.empty(); });
      if (got != theirs) continue;
      std::map<std::string, size_t> file_id;
      for (size_t j = 0; j < g.order.size(); ++j) file_id[g.order[j].name] = j;
      for (size_t i = 0; i < order_.size(); ++i) ids[i] = file_id.count(order_[i]) ? file_id[order_[i]] : file_id.at(emb);
      regrouped_ = g.id + " (" + g.description + ")" + (g.order.size() < order_.size() ? ", without GPT's tied output copy" : "");
      return ids;
    }
  }
  auto sizes = [](const std::vector<std::vector<int64_t>>& gs) {
    std::string s;
    for (const auto& g : gs) s += (s.empty() ? "" : "/") + std::to_string(g.size());
    return s.empty() ? std::string("none") : s;
  };
  throw ckpt::Error("optimizer param_groups hold " + sizes(got) + " parameter ids, but this run groups them as " + sizes(want) +
                    (sizes(got) == sizes(want) ? " in another order" : "") + " (model.do_layer_norm_weight_decay: " +
                    (c_.do_layer_norm_weight_decay ? "True" : "False") +
                    "): the checkpoint was grouped differently, so its moments would go to the wrong parameters");
}

bool AdamW::LoadStateDict(const ckpt::Value& sd) {
  if (ckpt::IsEpZero1File(sd) != (ep_ != nullptr))
    throw ckpt::Error(ep_ ? "optimizer state is not NxD's NeuronEPZero1Optimizer's, which a run with expert parallelism reads"
                          : "optimizer state is NxD's NeuronEPZero1Optimizer's (expert parallelism), which a run without it does not read");
  if (!ep_) return LoadFile(sd);
  return LoadFile(Combined(ckpt::ParseEpZero1File(sd, "optimizer state")).ToValue());
}

bool AdamW::LoadFile(const ckpt::Value& sd) {
  const ckpt::OptimizerFileView file(sd, "optimizer state");
  const bool zero1 = file.zero1();
  const ckpt::Dict& state = file.Moments();
  auto what = [&](size_t i) { return "parameter " + std::to_string(i) + " (" + order_[i] + ")"; };
  auto copy = [&](const ckpt::Value& v, ckpt::Tensor& dst, const std::string& key, size_t i) {
    const ckpt::Tensor& t = v.as_tensor();
    if (t.shape() != dst.shape()) {
      throw ckpt::Error("optimizer " + key + " of " + what(i) + " is " + ckpt::ShapeString(t.shape()) + ", not " +
                        ckpt::ShapeString(dst.shape()) +
                        (zero1 ? " (a ZeRO-1 shard of a run with another data-parallel size? this run has " + std::to_string(dp_size_) + ")" : ""));
    }
    if (!ckpt::CanCast(t.dtype(), ckpt::DType::kFloat32))
      throw ckpt::Error("optimizer " + key + " of " + what(i) + " is " + std::string(ckpt::DTypeName(t.dtype())));
    ckpt::CastInto(t, dst);
  };
  const std::vector<size_t> file_id = FileIds(file.param_groups(), zero1);
  int64_t step = -1;
  for (size_t i = 0; i < order_.size(); ++i) {
    const ckpt::Value* s = ckpt::EntryById(state, file_id[i]);
    if (!s) throw ckpt::Error("optimizer state has no entry for " + what(i));
    copy(s->as_dict().At("exp_avg"), m_[i], "exp_avg", i);
    copy(s->as_dict().At("exp_avg_sq"), v_[i], "exp_avg_sq", i);
    const double st = ckpt::AsScalar(s->as_dict().At("step"));
    if (st < 0 || st != std::floor(st)) throw ckpt::Error("optimizer step of " + what(i) + " is " + std::to_string(st));
    step = static_cast<int64_t>(st);
  }
  step_ = step < 0 ? 0 : step;
  const ckpt::Dict* master = file.Masters();
  if (!master || master_.empty()) return false;
  for (size_t i = 0; i < order_.size(); ++i) {
    const ckpt::Value* w = ckpt::EntryById(*master, file_id[i]);
    if (!w) throw ckpt::Error("sharded_master_weights has no entry for " + what(i));
    copy(*w, master_[i], "master weight", i);
  }
  return true;
}

double ParamNorm(Model& m, Comm* ep) { return std::sqrt(SumSquares(m, false, ep)); }

double LrAt(const ScheduleConfig& s, double base, int64_t step) {
  const double w = static_cast<double>(s.warmup_steps);
  if (s.name == "LinearAnnealingWithWarmUp") {  // transformers' linear schedule with warmup
    if (step < s.warmup_steps) return base * static_cast<double>(step) / std::max(1.0, w);
    return base * std::max(0.0, static_cast<double>(s.max_steps - step) / std::max<double>(1, s.max_steps - s.warmup_steps));
  }
  if (s.name != "CosineAnnealing") throw ckpt::Error("unknown scheduler '" + s.name + "' (CosineAnnealing or LinearAnnealingWithWarmUp)");
  // NeMo's CosineAnnealing (WarmupAnnealHoldPolicy).
  const int64_t decay_steps = s.max_steps - (s.constant_steps + s.warmup_steps);
  auto megatron = [&](int64_t st) {  // linear warmup, cosine decay, then min_lr (used when constant_steps > 0)
    if (s.warmup_steps > 0 && st <= s.warmup_steps) return base * static_cast<double>(st) / w;
    if (st > s.warmup_steps + decay_steps) return s.min_lr;
    const double ratio = static_cast<double>(st - s.warmup_steps) / static_cast<double>(decay_steps);
    return s.min_lr + 0.5 * (std::cos(M_PI * ratio) + 1.0) * (base - s.min_lr);
  };
  if (s.warmup_steps > 0 && step <= s.warmup_steps)
    return s.constant_steps > 0 ? megatron(step) : base * static_cast<double>(step + 1) / (w + 1);
  if (s.constant_steps > 0 && s.warmup_steps + decay_steps < step && step <= s.max_steps) return megatron(step);
  if (step > s.max_steps) return s.min_lr;
  if (s.constant_steps > 0) return megatron(step);
  const double mult = 0.5 * (1 + std::cos(M_PI * static_cast<double>(step - s.warmup_steps) / static_cast<double>(s.max_steps - s.warmup_steps)));
  return (base - s.min_lr) * mult + s.min_lr;
}

}  // namespace train
