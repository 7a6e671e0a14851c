#include "libtrain/model.h"

#include <cstdio>
#include <cstdlib>

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/optimizer_groups.h"
#include "libtrain/comm.h"
#include "libtrain/layers.h"

namespace train {

namespace {
using ckpt::Module;
}  // namespace

double ModelConfig::norm_eps() const {
  char text[32];
  std::snprintf(text, sizeof text, "%.7g", static_cast<double>(eps));  // a float holds 7 significant digits
  return std::strtod(text, nullptr);
}

ckpt::ModelFormat ModelConfig::format(int tp) const {
  ckpt::ModelFormat f;
  f.hidden = hidden, f.ffn = ffn, f.heads = heads, f.kv_heads = kv_heads, f.layers = layers;
  f.vocab_size = vocab_size > 0 ? vocab_size : vocab;
  f.make_vocab_size_divisible_by = make_vocab_size_divisible_by;
  if (f.PaddedVocab(tp) != vocab) f.vocab_size = vocab, f.make_vocab_size_divisible_by = 1;  // vocab set directly (tests)
  f.layernorm = layernorm, f.gelu = gelu, f.bias = bias, f.learned_positions = learned_positions;
  f.max_positions = max_positions, f.tied_output = tied_output;
  f.rope_theta = rope_theta, f.norm_eps = norm_eps(), f.rotary_percentage = rotary_percentage;
  f.family = family;
  f.experts = experts, f.moe_top_k = moe_top_k, f.moe_frequency = moe_frequency;
  if (family == ckpt::ModelFamily::kHfLlama)
    f.fuse_qkv = fuse_qkv, f.qkv_linear = qkv_linear, f.kv_size_multiplier = kv_size_multiplier, f.hw_backend = hw_backend;
  return f;
}

Model::~Model() = default;

Model::Model(const ModelConfig& c, const TensorParallel& tp, const PipelineStage& pp, const ExpertParallel& ep)
    : c_(c), tp_(tp), pp_(pp), ep_(ep), format_(c.format(tp.size)), logical_(ckpt::LogicalParameters(format_, tp.size)) {
  if (c.hidden % c.heads) throw ckpt::Error("hidden_size must be divisible by num_attention_heads");
  if (c.heads % c.kv_heads) throw ckpt::Error("num_attention_heads must be divisible by num_kv_heads");
  if (c.learned_positions && c.max_positions < 1) throw ckpt::Error("learned position embeddings need max_position_embeddings");
  if (const std::string why = format_.CheckTensorParallel(tp.size); !why.empty()) throw ckpt::Error(why);
  if (format_.moe()) CheckMoe();
  if (const std::string why = format_.CheckExpertParallel(ep.size); !why.empty()) throw ckpt::Error(why);
  if (c.vocab % tp.size)
    throw ckpt::Error("tensor parallel degree " + std::to_string(tp.size) + " does not divide the padded vocabulary (" +
                      std::to_string(c.vocab) + ")");
  const std::vector<int> kv_holders = KvHolders(c, tp.size, tp.rank);
  if ((tp.size > 1) != (tp.comm != nullptr) || kv_holders.empty() == (tp.kv_comm != nullptr))
    throw ckpt::Error("internal: tensor-parallel communicators do not match the degree");
  kv_first_holder_ = kv_holders.empty() || kv_holders.front() == tp.rank;
  const int64_t n = tp.size, r = tp.rank;
  nh_ = c.heads / n;
  attention_ = ckpt::AttentionTensorsOf(format_);
  // This rank's query heads and KV heads (global numbers, local order), paired as one process pairs
  // them: head h with KV head h / (heads / kv_heads). The HF-style family places them by NxD's rule
  // (ckpt/spec/model_family.h); Megatron's are in order, KV groups below tp replicated over consecutive ranks.
  std::vector<int64_t> q, kv;
  if (c.family == ckpt::ModelFamily::kHfLlama) {
    q = ckpt::QueryHeadsOfRank(format_, tp.size, tp.rank), kv = ckpt::KvHeadsOfRank(format_, tp.size, tp.rank);
  } else {
    for (int64_t h = 0; h < nh_; ++h) q.push_back(r * nh_ + h);
    const int64_t first = c.kv_heads >= n ? r * (c.kv_heads / n) : ckpt::KvReplicasOf(c.kv_heads, tp.size, tp.rank).group;
    for (int64_t g = 0; g < std::max<int64_t>(1, c.kv_heads / n); ++g) kv.push_back(first + g);
  }
  G_ = static_cast<int64_t>(kv.size());
  for (int64_t h : q) {
    const auto at = std::find(kv.begin(), kv.end(), h / (c.heads / c.kv_heads));
    if (at == kv.end()) throw ckpt::Error("internal: tp rank " + std::to_string(r) + " holds query head " + std::to_string(h) + " but not its KV head");
    global_head_.push_back(h), local_group_.push_back(at - kv.begin());
  }
  F_ = c.ffn / n, f0_ = r * F_;
  V_ = c.vocab / n, v0_ = r * V_;
  const int stages = pp_.size * pp_.chunks;
  if (pp_.bounds.empty()) pp_.bounds = ckpt::StageBounds(c.layers, stages);
  if (static_cast<int>(pp_.bounds.size()) != stages + 1 || pp_.bounds.back() != c.layers || pp_.stage < 0 || pp_.stage >= pp_.size)
    throw ckpt::Error("internal: pipeline stage bounds do not fit the model");
  if ((c.tied_output && pp_.size > 1 && (pp_.first() || pp_.last())) != (pp_.embedding_comm != nullptr))
    throw ckpt::Error("internal: the tied embedding's communicator does not match the pipeline");
  // This rank's model chunks (stages p, p + pp, ...) and their parameters chunk after chunk, as
  // NxD's local_named_parameters walks its local_stage_modules: the spec's one rule for both
  // (ckpt/spec/partition.h RankLayerRanges, StageParameters).
  for (const auto& [first, end] : ckpt::RankLayerRanges(pp_.bounds, pp_.chunks, pp_.stage))
    chunk_layers_.push_back({static_cast<int>(first), static_cast<int>(end)});
  for (const ckpt::StageParam& sp : ckpt::StageParameters(logical_, pp_.bounds, pp_.stage, ckpt::TiedCopyNaming::kNxdt, pp_.chunks)) {
    if (sp.tied_copy()) tied_copy_ = sp.name;
    index_[sp.name] = layout_.size();
    layout_.push_back(*sp.rule);
    layout_.back().name = sp.name;
  }
  // Every parameter (and its gradient) is a view into one flat buffer, in module order.
  int64_t total = 0;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : layout_) {
    const bool expert = p.split == ckpt::SplitDim::kExperts;
    shapes.push_back(expert ? ckpt::LocalShapeOf(p.spec, ExpertCoords()) : ckpt::LocalShape(p, format_, tp.size, tp.rank));
    total += ckpt::ShapeNumel(shapes.back());
  }
  const size_t bytes = static_cast<size_t>(total) * sizeof(float);
  flat_params_ = ckpt::Storage::Allocate(bytes), flat_grads_ = ckpt::Storage::Allocate(bytes);
  int64_t at = 0;
  for (size_t i = 0; i < layout_.size(); ++i) {
    const auto strides = ckpt::Tensor::ContiguousStrides(shapes[i]);
    params_.emplace(layout_[i].name, ckpt::Tensor(ckpt::DType::kFloat32, shapes[i], strides, at, flat_params_));
    grads_.emplace(layout_[i].name, ckpt::Tensor(ckpt::DType::kFloat32, shapes[i], strides, at, flat_grads_));
    at += ckpt::ShapeNumel(shapes[i]);
  }
  const int64_t rot = c_.rotary_dim();
  for (int64_t i = 0; i < rot / 2; ++i)
    inv_freq_.push_back(static_cast<float>(1.0 / std::pow(c_.rope_theta, static_cast<double>(2 * i) / rot)));
  const ckpt::Module attention_in = ckpt::AttentionTensorsOf(format_) == ckpt::AttentionTensors::kFused ? ckpt::Module::kQkv : ckpt::Module::kKeyValue;
  for (int l : Layers())
    if (const std::string buffer = ckpt::RotaryBufferName(format_, l); !buffer.empty()) buffer_after_[ckpt::ParamName(format_, attention_in, l)] = buffer;
  if (!buffer_after_.empty()) {
    const std::vector<float> values = ckpt::RotaryInvFreq(format_);
    rotary_buffer_ = ckpt::Tensor::FromBytes(ckpt::DType::kFloat32, {static_cast<int64_t>(values.size())},
                                             {reinterpret_cast<const uint8_t*>(values.data()), values.size() * sizeof(float)});
  }
}

std::vector<int> Model::Layers() const {
  std::vector<int> out;
  for (const auto& [first, end] : chunk_layers_)
    for (int l = first; l < end; ++l) out.push_back(l);
  return out;
}

ckpt::Tensor& Model::param(const std::string& n) {
  return const_cast<ckpt::Tensor&>(static_cast<const Model*>(this)->param(n));
}

const ckpt::Tensor& Model::param(const std::string& n) const {
  auto it = params_.find(n);
  if (it == params_.end()) throw ckpt::Error("model has no parameter '" + n + "'");
  return it->second;
}

ckpt::Tensor& Model::grad(const std::string& n) {
  auto it = grads_.find(n);
  if (it == grads_.end()) throw ckpt::Error("model has no parameter '" + n + "'");
  return it->second;
}

void Model::InitWeights() {
  std::mt19937_64 rng(c_.seed);
  const float scaled = c_.scaled_init ? c_.init_std / std::sqrt(2.0f * c_.layers) : c_.init_std;
  std::vector<float> whole;
  // Every parameter is drawn in the model's order on every stage, so the random stream is the one
  // process's; a stage keeps what it holds (the last stage's tied output copy is the embedding).
  for (const auto& p : logical_) {
    if (p.name.ends_with(".bias")) continue;  // zeros
    const bool here = params_.count(p.name) > 0;
    if (p.norm) {  // norm weights
      if (here) std::fill(W(p.name), W(p.name) + param(p.name).numel(), 1.0f);
      continue;
    }
    // NeuronSwitchMLP gives its experts' down_proj the output layers' init (output_layer_init_method).
    const bool megatron_experts_out = c_.family != ckpt::ModelFamily::kHfLlama && p.name == Name(Module::kExpertsOut, p.layer);
    const bool output_proj = p.layer >= 0 && (p.name == Name(Module::kAttentionOut, p.layer) || p.name == Name(Module::kMlpOut, p.layer) ||
                                              megatron_experts_out);
    std::normal_distribution<float> dist(0.f, output_proj ? scaled : c_.init_std);
    whole.resize(ckpt::ShapeNumel(p.shape));
    for (float& x : whole) x = dist(rng);
    if (c_.bf16_params)
      for (float& x : whole) x = ckpt::RoundToBFloat16(x);
    // This rank's slice: runs of rows, or of columns within every row; an expert weight's boxes.
    const bool experts = p.split == ckpt::SplitDim::kExperts;
    const auto runs = experts ? std::vector<ckpt::Run>{} : ckpt::LocalRuns(p, format_, tp_.size, tp_.rank);
    auto slice_into = [&](const std::string& name) {
      float* w = W(name);
      if (experts) {
        CopyExpertBoxes(w, param(name).shape(), whole.data(), p);
      } else if (p.split == ckpt::SplitDim::kColumns) {
        const int64_t rows = p.shape[0], cols = p.shape[1], local_cols = param(name).numel() / rows;
        for (int64_t i = 0; i < rows; ++i)
          for (const ckpt::Run& run : runs)
            std::copy_n(&whole[i * cols + run.logical], run.count, w + i * local_cols + run.local);
      } else {
        const int64_t row = static_cast<int64_t>(whole.size()) / p.shape[0];
        for (const ckpt::Run& run : runs) std::copy_n(&whole[run.logical * row], run.count * row, w + run.local * row);
      }
    };
    if (here) slice_into(p.name);
    if (!tied_copy_.empty() && p.name == Name(Module::kEmbedding)) slice_into(tied_copy_);
  }
}

ckpt::DType Model::checkpoint_dtype() const { return c_.bf16_params ? ckpt::DType::kBFloat16 : ckpt::DType::kFloat32; }

void Model::ZeroGrad() { std::memset(flat_grads_->mutable_data(), 0, flat_grads_->nbytes()); }

void Model::ReduceReplicaGrads() {
  auto sum = [](Comm* comm, float* g, int64_t n) { comm->AllReduceSum(g, static_cast<size_t>(n)); };
  auto sum_all = [&](Comm* comm, ckpt::Tensor& g) { sum(comm, reinterpret_cast<float*>(g.mutable_data()), g.numel()); };
  // Replicated KV heads: each replica's gradient comes from its own queries, so the sum over the
  // holders is the one-process gradient (NxD sums over its KV groups, parallel_state.py arrange_kv_groups).
  if (tp_.kv_comm)
    for (int l : Layers()) {
      if (attention_ == ckpt::AttentionTensors::kFused) {  // HF-style weight_qkv: its K and V rows, after the queries
        ckpt::Tensor& g = grad(Name(Module::kQkv, l));
        const int64_t from = nh_ * c_.head_dim() * c_.hidden;
        sum(tp_.kv_comm, reinterpret_cast<float*>(g.mutable_data()) + from, g.numel() - from);
        continue;
      }
      const std::vector<Module> kv = attention_ == ckpt::AttentionTensors::kSeparate ? std::vector<Module>{Module::kKey, Module::kValue}
                                                                                      : std::vector<Module>{Module::kKeyValue};
      for (Module m : kv) {
        sum_all(tp_.kv_comm, grad(Name(m, l)));
        if (c_.bias) sum_all(tp_.kv_comm, grad(ckpt::BiasOf(Name(m, l))));
      }
    }
  if (tp_.comm)  // each rank's router gradient is its experts' slices' part (MoeMlpBackward)
    for (int l : Layers())
      if (ckpt::IsMoeLayer(format_, l)) sum_all(tp_.comm, grad(Name(Module::kRouter, l)));
  if (pp_.embedding_comm) sum_all(pp_.embedding_comm, grad(pp_.first() ? Name(Module::kEmbedding) : tied_copy_));
  if (pp_.size == 1 && !tied_copy_.empty()) {  // both on this stage: each takes the sum
    float* a = reinterpret_cast<float*>(grad(Name(Module::kEmbedding)).mutable_data());
    float* b = reinterpret_cast<float*>(grad(tied_copy_).mutable_data());
    for (int64_t i = 0, n = grad(tied_copy_).numel(); i < n; ++i) a[i] = b[i] = a[i] + b[i];
  }
  // Under sequence parallelism each rank's norms saw its own rows only (Megatron's
  // allreduce of sequence-parallel gradients).
  if (SequenceParallel())
    for (const auto& p : layout_)
      if (p.norm) sum_all(tp_.comm, grad(p.name));
}

void Model::SumOverModel(double* x, size_t n) const {
  if (tp_.comm) tp_.comm->AllReduceSum(x, n);
  if (pp_.comm) pp_.comm->AllReduceSum(x, n);
}

std::string Model::OutputWeight() const {
  if (!c_.tied_output) return Name(Module::kOutput);
  return tied_copy_;
}

int64_t Model::CountedRows(const std::string& name) const {
  const auto at = index_.find(name);
  if (at == index_.end()) throw ckpt::Error("model has no parameter '" + name + "'");
  const ckpt::ParamRule* p = &layout_[at->second];
  const int64_t rows = param(name).dim() ? param(name).shape()[0] : 1;
  if (name == tied_copy_) return 0;
  if (p->split == ckpt::SplitDim::kReplicated) return tp_.rank == 0 ? rows : 0;  // norms, row-parallel biases, positions
  if (!tp_.kv_comm) return rows;
  // Replicated KV heads count on their first holder only.
  if (p->fused == ckpt::FusedRows::kPerGroupKv || p->fused == ckpt::FusedRows::kKvHeads) return kv_first_holder_ ? rows : 0;
  if (p->fused == ckpt::FusedRows::kQkvHeads) return kv_first_holder_ ? rows : nh_ * c_.head_dim();
  return rows;
}

std::vector<int> KvHolders(const ModelConfig& c, int tp, int rank) {
  std::vector<int> out;
  if (c.family == ckpt::ModelFamily::kHfLlama) {
    const ckpt::ModelFormat f = c.format(tp);
    if (f.kv_size_multiplier == 1) return out;
    const auto mine = ckpt::KvHeadsOfRank(f, tp, rank);
    for (int r = 0; r < tp; ++r)
      if (ckpt::KvHeadsOfRank(f, tp, r) == mine) out.push_back(r);
    return out;
  }
  if (c.kv_heads >= tp) return out;
  const ckpt::KvReplicas kv = ckpt::KvReplicasOf(c.kv_heads, tp, rank);
  for (int r = kv.first; r < kv.first + kv.count; ++r) out.push_back(r);
  return out;
}

void Model::TpSum(float* x, int64_t n) {
  if (tp_.comm) tp_.comm->AllReduceSum(x, static_cast<size_t>(n));
}

int64_t Model::HiddenStateFloats(int64_t B, int64_t T) const {
  return B * T * c_.hidden / (SequenceParallel() ? tp_.size : 1) + (format_.moe() ? MoeAuxStatsFloats(c_.experts) : 0);
}

// Rank r's rows are positions [r*Ts, (r+1)*Ts) of every sequence: block r of
// the collectives is [B, Ts, H], and row (b, t) of the whole is b*T + t.
const float* Model::GatherRows(const float* local, std::vector<float>& whole) {
  if (!SequenceParallel()) return local;
  const int64_t H = c_.hidden, Ts = T_ / tp_.size, block = B_ * Ts * H;
  std::vector<float> blocks(block * tp_.size);
  tp_.comm->AllGather(local, blocks.data(), static_cast<size_t>(block));
  whole.resize(B_ * T_ * H);
  for (int64_t r = 0; r < tp_.size; ++r)
    for (int64_t b = 0; b < B_; ++b)
      std::copy_n(&blocks[r * block + b * Ts * H], Ts * H, &whole[(b * T_ + r * Ts) * H]);
  return whole.data();
}

void Model::ReduceRows(float* whole, float* local) {
  const int64_t H = c_.hidden;
  if (!SequenceParallel()) {
    TpSum(whole, B_ * T_ * H);
    if (local != whole) std::copy_n(whole, B_ * T_ * H, local);
    return;
  }
  const int64_t Ts = T_ / tp_.size, block = B_ * Ts * H;
  std::vector<float> blocks(block * tp_.size);
  for (int64_t r = 0; r < tp_.size; ++r)
    for (int64_t b = 0; b < B_; ++b)
      std::copy_n(&whole[(b * T_ + r * Ts) * H], Ts * H, &blocks[r * block + b * Ts * H]);
  tp_.comm->ReduceScatterSum(blocks.data(), local, static_cast<size_t>(block));
}

void Model::HiddenDropout(float* x, uint64_t stream) {
  const int64_t H = c_.hidden;
  if (!SequenceParallel()) return DropoutApply(x, B_ * T_ * H, c_.hidden_dropout, stream);
  // Row (b, t0 + i) of the whole is mask index ((b * T + t0 + i) * H + h).
  const int64_t Ts = T_ / tp_.size;
  DropoutApplyColumns(x, B_, Ts * H, tp_.rank * Ts * H, T_ * H, c_.hidden_dropout, stream);
}

// Megatron's fused rows are per head [q_h; k_h; v_h], its key_value per group
// [k_g; v_g]; the HF-style fused rows are [Q; K; V] of this rank's heads, its
// separate k and v projections land side by side in kvproj as [K | V].
int64_t Model::QCol(int64_t h) const {
  const int64_t hd = c_.head_dim();
  return attention_ == ckpt::AttentionTensors::kFused && c_.family == ckpt::ModelFamily::kMegatron ? h * 3 * hd : h * hd;
}
int64_t Model::KCol(int64_t g) const {
  const int64_t hd = c_.head_dim();
  if (c_.family == ckpt::ModelFamily::kHfLlama) return attention_ == ckpt::AttentionTensors::kFused ? (nh_ + g) * hd : g * hd;
  return attention_ == ckpt::AttentionTensors::kFused ? g * 3 * hd + hd : g * 2 * hd;
}
int64_t Model::VCol(int64_t g) const {
  const int64_t hd = c_.head_dim();
  if (c_.family == ckpt::ModelFamily::kHfLlama) return attention_ == ckpt::AttentionTensors::kFused ? (nh_ + G_ + g) * hd : (G_ + g) * hd;
  return attention_ == ckpt::AttentionTensors::kFused ? g * 3 * hd + 2 * hd : g * 2 * hd + hd;
}

ckpt::Value Model::StateDict() const {
  ckpt::Value d = ckpt::Value::NewDict();
  for (const auto& p : layout_) d.as_dict().Set(p.name, ckpt::Value(params_.at(p.name)));
  return d;
}

ckpt::Value Model::CheckpointDict() const {
  ckpt::Value d = ckpt::Value::NewDict();
  for (const auto& p : layout_) {
    d.as_dict().Set(p.name, ckpt::Value(params_.at(p.name)));
    ckpt::SetSpmdRanksAfter(format(), ep_.size, p.name, d.as_dict());  // NxD's int32 SPMDRank at ep > 1
    if (auto b = buffer_after_.find(p.name); b != buffer_after_.end()) d.as_dict().Set(b->second, ckpt::Value(rotary_buffer_));
  }
  return d;
}

ckpt::Value Model::GradDict() const {
  ckpt::Value d = ckpt::Value::NewDict();
  for (const auto& p : layout_) d.as_dict().Set(p.name, ckpt::Value(grads_.at(p.name)));
  return d;
}

void Model::LoadStateDict(const ckpt::Value& sd) {
  const ckpt::Dict& d = sd.as_dict();
  for (const auto& p : layout_) {
    const ckpt::Value* v = d.Find(p.name);
    // GPT's tied output copy as Megatron-LM names it (shardkit's tags before): word_embeddings.weight
    // on the last stage, nothing at pp = 1.
    if (!v && p.name == tied_copy_) v = d.Find(pp_.size > 1 ? ckpt::kMegatronLmTiedCopy : Name(Module::kEmbedding));
    if (!v) throw ckpt::Error("state dict has no '" + p.name + "'");
    const ckpt::Tensor& t = v->as_tensor();
    const std::vector<int64_t>& want = param(p.name).shape();
    if (t.shape() != want)
      throw ckpt::Error("state dict '" + p.name + "' is " + ckpt::ShapeString(t.shape()) + ", the wrong shape for this config (" +
                        ckpt::ShapeString(want) + (tp_.size > 1 ? " on tensor-parallel rank " + std::to_string(tp_.rank) : "") + ")");
    if (!ckpt::CanCast(t.dtype(), ckpt::DType::kFloat32))
      throw ckpt::Error("state dict '" + p.name + "' is " + std::string(ckpt::DTypeName(t.dtype())) +
                        "; parameters load from float32, float64 or bfloat16");
    ckpt::Tensor& dst = param(p.name);
    ckpt::CastInto(t, dst);
    if (c_.bf16_params) {
      float* w = W(p.name);
      for (int64_t i = 0, n = dst.numel(); i < n; ++i) w[i] = ckpt::RoundToBFloat16(w[i]);
    }
  }
}

void Model::NormForward(const std::string& weight, const float* x, float* out, std::vector<float>& mean,
                        std::vector<float>& rstd) {
  const int64_t N = Rows(), H = c_.hidden;
  rstd.resize(N);
  if (c_.layernorm) {
    mean.resize(N);
    LayerNormForward(out, mean.data(), rstd.data(), x, W(weight), W(ckpt::BiasOf(weight)), c_.eps, N, H);
  } else {
    RmsNormForward(out, rstd.data(), x, W(weight), c_.eps, N, H);
  }
}

void Model::NormBackward(const std::string& weight, const float* dout, const float* x, const std::vector<float>& mean,
                         const std::vector<float>& rstd, float* dx) {
  const int64_t N = Rows(), H = c_.hidden;
  if (c_.layernorm)
    LayerNormBackward(dx, Dw(weight), Dw(ckpt::BiasOf(weight)), dout, x, W(weight), mean.data(),
                      rstd.data(), N, H);
  else
    RmsNormBackward(dx, Dw(weight), dout, x, W(weight), rstd.data(), N, H);
}

void Model::Linear(const std::string& weight, const float* x, float* out, int64_t K, int64_t C) {
  LinearForward(out, x, W(weight), c_.bias ? W(ckpt::BiasOf(weight)) : nullptr, B_ * T_, K, C);
}

void Model::RowParallelLinear(const std::string& weight, const float* x, float* out, int64_t K, int64_t C) {
  const int64_t N = B_ * T_, R = Rows();
  // Each rank's K columns give a partial sum over all N rows; summed, this rank keeps its rows.
  std::vector<float> partial;
  float* whole = out;
  if (SequenceParallel()) partial.resize(N * C), whole = partial.data();
  LinearForward(whole, x, W(weight), nullptr, N, K, C);
  ReduceRows(whole, out);
  if (c_.bias) {  // the bias is whole: added once, after the sum
    const float* b = W(ckpt::BiasOf(weight));
    tbb::parallel_for(int64_t{0}, R, [&](int64_t n) {
      for (int64_t i = 0; i < C; ++i) out[n * C + i] += b[i];
    });
  }
}

void Model::LinearGrad(const std::string& weight, const float* dout, const float* x, float* dx, int64_t K, int64_t C) {
  LinearBackward(dx, Dw(weight), c_.bias ? Dw(ckpt::BiasOf(weight)) : nullptr, dout, x, W(weight),
                 B_ * T_, K, C);
}


// Attention over this rank's heads: project, split heads (with RoPE on q and
// k), causal softmax attention per (batch, head), heads concatenated into y.
void Model::AttentionForward(int l, LayerCache& lc) {
  const int64_t B = B_, T = T_, N = B * T, H = c_.hidden, hd = c_.head_dim(), nh = nh_, G = G_, Hl = nh_ * hd;
  const int64_t rot = c_.rotary_dim();
  const float* qsrc;
  const float* kvsrc;
  int64_t qstride, kvstride;
  if (attention_ != ckpt::AttentionTensors::kFused) {
    lc.proj.resize(N * Hl);
    lc.kvproj.resize(N * 2 * G * hd);
    Linear(Name(Module::kQuery, l), lc.ln1.data(), lc.proj.data(), H, Hl);
    if (attention_ == ckpt::AttentionTensors::kSeparate) {  // k and v side by side: [K | V] per row
      std::vector<float> k(N * G * hd), v(N * G * hd);
      Linear(Name(Module::kKey, l), lc.ln1.data(), k.data(), H, G * hd);
      Linear(Name(Module::kValue, l), lc.ln1.data(), v.data(), H, G * hd);
      for (int64_t n = 0; n < N; ++n) {
        std::copy_n(&k[n * G * hd], G * hd, &lc.kvproj[n * 2 * G * hd]);
        std::copy_n(&v[n * G * hd], G * hd, &lc.kvproj[n * 2 * G * hd + G * hd]);
      }
    } else {
      Linear(Name(Module::kKeyValue, l), lc.ln1.data(), lc.kvproj.data(), H, 2 * G * hd);
    }
    qsrc = lc.proj.data(), qstride = Hl, kvsrc = lc.kvproj.data(), kvstride = 2 * G * hd;
  } else {
    const int64_t width = Hl + 2 * G * hd;  // Megatron's MHA (G = nh) and the HF-style [Q; K; V]
    lc.proj.resize(N * width);
    Linear(Name(Module::kQkv, l), lc.ln1.data(), lc.proj.data(), H, width);
    qsrc = kvsrc = lc.proj.data(), qstride = kvstride = width;
  }
  lc.q.resize(B * nh * T * hd);
  lc.k.resize(B * G * T * hd);
  lc.v.resize(B * G * T * hd);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = b * T + t;
      for (int64_t h = 0; h < nh; ++h) {
        float* q = &lc.q[((b * nh + h) * T + t) * hd];
        std::memcpy(q, qsrc + n * qstride + QCol(h), hd * sizeof(float));
        RopeApply(q, t, inv_freq_.data(), rot, false);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* k = &lc.k[((b * G + g) * T + t) * hd];
        std::memcpy(k, kvsrc + n * kvstride + KCol(g), hd * sizeof(float));
        RopeApply(k, t, inv_freq_.data(), rot, false);
        std::memcpy(&lc.v[((b * G + g) * T + t) * hd], kvsrc + n * kvstride + VCol(g), hd * sizeof(float));
      }
    }
  AttentionCore(l, lc);
}

void Model::AttentionCore(int l, LayerCache& lc) {
  const int64_t B = B_, T = T_, N = B * T, hd = c_.head_dim(), nh = nh_, G = G_, Hl = nh_ * hd;
  lc.att.assign(B * nh * T * T, 0.f);
  lc.y.assign(N * Hl, 0.f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float p = c_.attention_dropout;
  const uint64_t stream = DropoutSite(l, 0);
  tbb::parallel_for(int64_t{0}, B * nh, [&](int64_t bh) {
    const int64_t b = bh / nh, h = bh % nh, g = LocalGroup(h);
    // The mask index of the global head, as one process numbers them.
    const int64_t global_bh = b * c_.heads + global_head_[h];
    const float* q = &lc.q[bh * T * hd];
    const float* k = &lc.k[(b * G + g) * T * hd];
    const float* v = &lc.v[(b * G + g) * T * hd];
    for (int64_t t = 0; t < T; ++t) {
      float* a = &lc.att[(bh * T + t) * T];
      float mx = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        float dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += q[t * hd + d] * k[s * hd + d];
        a[s] = dot * scale;
        mx = std::max(mx, a[s]);
      }
      float sum = 0;
      for (int64_t s = 0; s <= t; ++s) sum += a[s] = std::exp(a[s] - mx);
      for (int64_t s = 0; s <= t; ++s) a[s] /= sum;
      float* y = &lc.y[(b * T + t) * Hl + h * hd];
      for (int64_t s = 0; s <= t; ++s) {
        // att keeps the probabilities; the values see them after dropout.
        const float w = a[s] * DropoutFactor(stream, static_cast<uint64_t>((global_bh * T + t) * T + s), p);
        for (int64_t d = 0; d < hd; ++d) y[d] += w * v[s * hd + d];
      }
    }
  });
}

void Model::AttentionBackward(int l, LayerCache& lc, const float* dy, float* dln1) {
  const int64_t B = B_, T = T_, N = B * T, H = c_.hidden, hd = c_.head_dim(), nh = nh_, G = G_, Hl = nh_ * hd;
  const int64_t rot = c_.rotary_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> dq(lc.q.size(), 0.f), dk(lc.k.size(), 0.f), dv(lc.v.size(), 0.f);
  const float p = c_.attention_dropout;
  const uint64_t stream = DropoutSite(l, 0);
  // Per (batch, group): the group's heads all feed its dk and dv, so one task owns them.
  tbb::parallel_for(int64_t{0}, B * G, [&](int64_t bg) {
    const int64_t b = bg / G, g = bg % G;
    const float* k = &lc.k[bg * T * hd];
    const float* v = &lc.v[bg * T * hd];
    float* dkg = &dk[bg * T * hd];
    float* dvg = &dv[bg * T * hd];
    std::vector<float> datt(T);
    for (int64_t h = 0; h < nh; ++h) {
      if (LocalGroup(h) != g) continue;
      const int64_t bh = b * nh + h, global_bh = b * c_.heads + global_head_[h];
      const float* q = &lc.q[bh * T * hd];
      float* dqh = &dq[bh * T * hd];
      for (int64_t t = 0; t < T; ++t) {
        const float* a = &lc.att[(bh * T + t) * T];
        const float* dyt = dy + (b * T + t) * Hl + h * hd;
        float dsum = 0;
        for (int64_t s = 0; s <= t; ++s) {
          const float f = DropoutFactor(stream, static_cast<uint64_t>((global_bh * T + t) * T + s), p);
          float d = 0;
          for (int64_t e = 0; e < hd; ++e) {
            d += dyt[e] * v[s * hd + e];
            dvg[s * hd + e] += a[s] * f * dyt[e];
          }
          datt[s] = d * f;
          dsum += a[s] * datt[s];
        }
        for (int64_t s = 0; s <= t; ++s) {
          const float dscore = a[s] * (datt[s] - dsum) * scale;
          for (int64_t e = 0; e < hd; ++e) {
            dqh[t * hd + e] += dscore * k[s * hd + e];
            dkg[s * hd + e] += dscore * q[t * hd + e];
          }
        }
      }
    }
  });
  // Undo RoPE on the gradients and scatter them into the projection layout.
  const bool fused = attention_ == ckpt::AttentionTensors::kFused;
  const int64_t qstride = fused ? Hl + 2 * G * hd : Hl, kvstride = fused ? qstride : 2 * G * hd;
  std::vector<float> dproj(lc.proj.size(), 0.f), dkvproj(lc.kvproj.size(), 0.f);
  float* dq_dst = dproj.data();
  float* dkv_dst = fused ? dproj.data() : dkvproj.data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = b * T + t;
      for (int64_t h = 0; h < nh; ++h) {
        float* src = &dq[((b * nh + h) * T + t) * hd];
        RopeApply(src, t, inv_freq_.data(), rot, true);
        std::memcpy(dq_dst + n * qstride + QCol(h), src, hd * sizeof(float));
      }
      for (int64_t g = 0; g < G; ++g) {
        float* src = &dk[((b * G + g) * T + t) * hd];
        RopeApply(src, t, inv_freq_.data(), rot, true);
        std::memcpy(dkv_dst + n * kvstride + KCol(g), src, hd * sizeof(float));
        std::memcpy(dkv_dst + n * kvstride + VCol(g), &dv[((b * G + g) * T + t) * hd], hd * sizeof(float));
      }
    }
  if (!fused) {
    std::vector<float> tmp(N * H);
    LinearGrad(Name(Module::kQuery, l), dproj.data(), lc.ln1.data(), dln1, H, Hl);
    // A replicated KV group: each replica's part comes from its own heads' dk and dv, so the
    // sum over the ranks below is the one-process gradient.
    auto add_dx = [&](Module m, const float* dout, int64_t width) {
      LinearGrad(Name(m, l), dout, lc.ln1.data(), tmp.data(), H, width);
      for (int64_t i = 0; i < N * H; ++i) dln1[i] += tmp[i];
    };
    if (attention_ == ckpt::AttentionTensors::kSeparate) {  // [K | V] back into k's and v's gradients
      std::vector<float> dk_rows(N * G * hd), dv_rows(N * G * hd);
      for (int64_t n = 0; n < N; ++n) {
        std::copy_n(&dkvproj[n * 2 * G * hd], G * hd, &dk_rows[n * G * hd]);
        std::copy_n(&dkvproj[n * 2 * G * hd + G * hd], G * hd, &dv_rows[n * G * hd]);
      }
      add_dx(Module::kKey, dk_rows.data(), G * hd);
      add_dx(Module::kValue, dv_rows.data(), G * hd);
    } else {
      add_dx(Module::kKeyValue, dkvproj.data(), 2 * G * hd);
    }
  } else {
    LinearGrad(Name(Module::kQkv, l), dproj.data(), lc.ln1.data(), dln1, H, qstride);
  }
}

void Model::LayerForward(int l, LayerCache& lc, float* out) {
  const int64_t N = B_ * T_, R = Rows(), H = c_.hidden, F = F_, Hl = nh_ * c_.head_dim();
  // The norms run on this rank's rows; the column-parallel layers see every row.
  std::vector<float> ln;
  if (SequenceParallel()) {
    ln.resize(R * H);
    NormForward(Name(Module::kInputNorm, l), lc.x.data(), ln.data(), lc.mean1, lc.rstd1);
    GatherRows(ln.data(), lc.ln1);
  } else {
    lc.ln1.resize(N * H);
    NormForward(Name(Module::kInputNorm, l), lc.x.data(), lc.ln1.data(), lc.mean1, lc.rstd1);
  }
  AttentionForward(l, lc);
  std::vector<float> attn_out(R * H);
  RowParallelLinear(Name(Module::kAttentionOut, l), lc.y.data(), attn_out.data(), Hl, H);
  HiddenDropout(attn_out.data(), DropoutSite(l, 1));
  lc.x2.resize(R * H);
  for (int64_t i = 0; i < R * H; ++i) lc.x2[i] = lc.x[i] + attn_out[i];
  if (SequenceParallel()) {
    NormForward(Name(Module::kPostAttentionNorm, l), lc.x2.data(), ln.data(), lc.mean2, lc.rstd2);
    GatherRows(ln.data(), lc.ln2);
  } else {
    lc.ln2.resize(N * H);
    NormForward(Name(Module::kPostAttentionNorm, l), lc.x2.data(), lc.ln2.data(), lc.mean2, lc.rstd2);
  }
  std::vector<float> mlp_out(R * H);
  if (ckpt::IsMoeLayer(format_, l)) {
    MoeMlpForward(l, lc, mlp_out.data());
    HiddenDropout(mlp_out.data(), DropoutSite(l, 3));
    for (int64_t i = 0; i < R * H; ++i) out[i] = lc.x2[i] + mlp_out[i];
    return;
  }
  const int64_t fc_width = c_.gelu ? F : 2 * F;
  lc.fc.resize(N * fc_width), lc.act.resize(N * F);
  Linear(Name(Module::kMlpIn, l), lc.ln2.data(), lc.fc.data(), H, fc_width);
  if (c_.gelu) GeluForward(lc.act.data(), lc.fc.data(), N * F);
  else SwiGluForward(lc.act.data(), lc.fc.data(), N, F);
  // act holds what dense_4h_to_h sees; masks keyed on the global FFN column.
  DropoutApplyColumns(lc.act.data(), N, F, f0_, c_.ffn, c_.ffn_dropout, DropoutSite(l, 2));
  RowParallelLinear(Name(Module::kMlpOut, l), lc.act.data(), mlp_out.data(), F, H);
  HiddenDropout(mlp_out.data(), DropoutSite(l, 3));
  for (int64_t i = 0; i < R * H; ++i) out[i] = lc.x2[i] + mlp_out[i];
}

void Model::CopyExpertBoxes(float* local, const std::vector<int64_t>& local_shape, const float* whole, const ckpt::ParamRule& p) const {
  const int64_t S1 = p.shape[1], S2 = p.shape[2], L1 = local_shape[1], L2 = local_shape[2];
  for (const ckpt::Box& b : ckpt::BoxesOf(p.spec, ExpertCoords()))
    for (int64_t e = 0; e < b.size[0]; ++e)
      for (int64_t i = 0; i < b.size[1]; ++i)
        std::copy_n(whole + ((b.offset[0] + e) * S1 + b.offset[1] + i) * S2 + b.offset[2], b.size[2],
                    local + ((b.local[0] + e) * L1 + b.local[1] + i) * L2 + b.local[2]);
}

ckpt::AxisCoords Model::ExpertCoords() const {
  ckpt::AxisCoords at = ckpt::AxisCoords::Tp(tp_.size, tp_.rank);
  at[ckpt::Axis::kEp] = {ep_.size, ep_.rank};
  return at;
}

bool Model::IsExpertWeight(const std::string& name) const {
  const auto at = index_.find(name);
  return at != index_.end() && layout_[at->second].split == ckpt::SplitDim::kExperts;
}

// Both styles' MoE layers compute alike (NxDT's MixtralForCausalLM and NeuronSwitchMLP build NxD's
// RouterTopK and ExpertMLPs with the same arguments); the family table names and numbers them.
void Model::CheckMoe() const {
  CheckMoeSettings({1, c_.hidden, c_.ffn, c_.experts, c_.moe_top_k}, MoeOptionsOf());
}

MoeShape Model::MoeShapeOf() const { return {B_ * T_, c_.hidden, F_, c_.experts, c_.moe_top_k}; }

MoeOptions Model::MoeOptionsOf() const {
  MoeOptions o;
  o.capacity_factor = c_.capacity_factor, o.normalize_top_k_affinities = c_.normalize_top_k_affinities;
  return o;
}

// NxD's MoE (modules/moe/model.py MoE.forward) on the post-attention norm's output (every row).
// Under tensor parallelism each rank holds every expert's slice of the intermediate dimension
// (ckpt::ExpertSpec: gate_up_proj's [gate_r || up_r], down_proj's rows), and the replicated
// router routes alike on every rank: each rank's output is a partial sum over its slice, summed
// over the ranks as a row-parallel layer's (ExpertFusedRowParallelLinear's reduce).
void Model::MoeMlpForward(int l, LayerCache& lc, float* mlp_out) {
  const MoeWeights w{W(Name(Module::kRouter, l)), W(Name(Module::kExpertsIn, l)), W(Name(Module::kExpertsOut, l))};
  std::vector<float> whole(B_ * T_ * c_.hidden);
  if (ep_.size > 1) ExpertParallelForward(whole.data(), &lc.moe, &lc.moe_ep, lc.ln2.data(), w, MoeShapeOf(), MoeOptionsOf(), ep_);
  else MoeForward(whole.data(), &lc.moe, lc.ln2.data(), w, MoeShapeOf(), MoeOptionsOf());
  ReduceRows(whole.data(), mlp_out);
}

void Model::MoeMlpBackward(int l, LayerCache& lc, const Activations& a, const float* dmlp_out, float* dln2) {
  const MoeWeights w{W(Name(Module::kRouter, l)), W(Name(Module::kExpertsIn, l)), W(Name(Module::kExpertsOut, l))};
  const MoeGrads g{Dw(Name(Module::kRouter, l)), Dw(Name(Module::kExpertsIn, l)), Dw(Name(Module::kExpertsOut, l))};
  // Under tensor parallelism the router's and the input's gradients are partial sums over the
  // ranks' expert slices (linear in each rank's dot(dout, expert output)), summed by the callers
  // (reduce_dln, ReduceReplicaGrads); the auxiliary loss's part is added on one rank only.
  const bool aux_here = c_.router_aux_loss_coef != 0 && tp_.rank == 0;
  const std::vector<double> aux = aux_here ? MoeAuxAffinityGrad(a.moe_aux, c_.router_aux_loss_coef) : std::vector<double>{};
  if (ep_.size > 1) ExpertParallelBackward(dln2, g, dmlp_out, aux, lc.ln2.data(), w, lc.moe, lc.moe_ep, MoeShapeOf(), MoeOptionsOf(), ep_);
  else MoeBackward(dln2, g, dmlp_out, aux, lc.ln2.data(), w, lc.moe, MoeShapeOf(), MoeOptionsOf());
}

uint64_t Model::DropoutSite(int l, int site) const {
  return DropoutStream(dropout_key_, l < 0 ? ~uint64_t{0} : static_cast<uint64_t>(l) * 4 + static_cast<uint64_t>(site));
}

void Model::Drop(LayerCache& lc) {
  auto release = [](std::vector<float>& v) { std::vector<float>().swap(v); };
  if (c_.recompute == "selective") {
    release(lc.att);
  } else if (c_.recompute == "full") {
    for (auto* v : {&lc.ln1, &lc.mean1, &lc.rstd1, &lc.proj, &lc.kvproj, &lc.q, &lc.k, &lc.v, &lc.att, &lc.y, &lc.x2,
                    &lc.ln2, &lc.mean2, &lc.rstd2, &lc.fc, &lc.act})
      release(*v);
    lc.moe = {}, lc.moe_ep = {};
  }
}

size_t Model::Activations::bytes() const {
  size_t n = x_final.size() + lnf.size() + meanf.size() + rstdf.size() + logits.size() + probs.size();
  for (const auto& lc : layers)
    for (const auto* v : {&lc.x, &lc.ln1, &lc.mean1, &lc.rstd1, &lc.proj, &lc.kvproj, &lc.q, &lc.k, &lc.v, &lc.att, &lc.y,
                          &lc.x2, &lc.ln2, &lc.mean2, &lc.rstd2, &lc.fc, &lc.act})
      n += v->size();
  size_t bytes = n * sizeof(float);
  for (const auto& lc : layers) {
    const MoeActivations& m = lc.moe;
    bytes += (m.logits.size() + m.affinities.size() + m.combine.size()) * sizeof(float) + m.kept.size() +
             m.expert_index.size() * sizeof(int64_t);
    for (const MoeExpertBatch& b : m.experts)
      bytes += b.tokens.size() * sizeof(int64_t) + (b.fc.size() + b.act.size() + b.out.size()) * sizeof(float);
    bytes += lc.moe_ep.rows.size() * sizeof(float);
    for (const MoeExpertBatch& b : lc.moe_ep.local) bytes += (b.fc.size() + b.act.size() + b.out.size()) * sizeof(float);
  }
  return bytes;
}

float Model::Forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, uint64_t dropout_key) {
  if (pp_.size != 1) throw ckpt::Error("internal: Forward runs a whole model; pipeline stages run ForwardStage");
  return ForwardStage(last_, tokens, targets, nullptr, B, T, dropout_key, nullptr);
}

void Model::Backward() { BackwardStage(last_, nullptr, nullptr); }

std::unique_ptr<Model::Activations> Model::TakeActivations() {
  if (spare_.empty()) return std::make_unique<Activations>();
  auto a = std::move(spare_.back());
  spare_.pop_back();
  return a;
}

void Model::ReturnActivations(std::unique_ptr<Activations> a) { spare_.push_back(std::move(a)); }

float Model::ForwardStage(Activations& a, const int32_t* tokens, const int32_t* targets, const float* x_in, int64_t B, int64_t T,
                          uint64_t dropout_key, std::vector<float>* x_out, int chunk) {
  if (chunk < 0 || chunk >= pp_.chunks) throw ckpt::Error("internal: model chunk " + std::to_string(chunk) + " out of range");
  B_ = B, T_ = T, dropout_key_ = dropout_key;
  const auto [first_layer, end_layer] = chunk_layers_[chunk];
  if (SequenceParallel() && T % tp_.size)
    throw ckpt::Error("sequence parallelism splits the " + std::to_string(T) + " positions of a sequence over " +
                      std::to_string(tp_.size) + " tensor-parallel ranks: they must divide evenly");
  // Buffers of an earlier micro-batch are reused (assigned and resized, not reallocated).
  a.B = B, a.T = T, a.chunk = chunk, a.dropout_key = dropout_key;
  a.tokens.clear(), a.targets.clear();
  const int64_t N = B * T, R = Rows(), H = c_.hidden, V = c_.vocab;
  auto check_ids = [&](const int32_t* ids) {
    for (int64_t n = 0; n < N; ++n)
      if (ids[n] < 0 || ids[n] >= V)
        throw ckpt::Error("token id " + std::to_string(ids[n]) + " at position " + std::to_string(n) +
                          " is outside the vocabulary of " + std::to_string(V));
  };
  std::vector<float> x(R * H);
  if (FirstStage(chunk)) {
    check_ids(tokens);
    if (c_.learned_positions && T > c_.max_positions)
      throw ckpt::Error("sequence length " + std::to_string(T) + " is longer than max_position_embeddings (" +
                        std::to_string(c_.max_positions) + ")");
    a.tokens.assign(tokens, tokens + N);
    // Vocab-parallel embedding: each rank looks up the tokens in its rows, the sum is the lookup.
    std::vector<float> whole(N * H);
    EmbeddingForward(whole.data(), tokens, W(Name(Module::kEmbedding)), N, H, v0_, V_);
    ReduceRows(whole.data(), x.data());
    if (c_.learned_positions) {  // row i here is position t0 + i % Ts of its sequence
      const float* pos = W(Name(Module::kPositionEmbedding));
      const int64_t Ts = R / B, t0 = SequenceParallel() ? tp_.rank * Ts : 0;
      for (int64_t n = 0; n < R; ++n)
        for (int64_t i = 0; i < H; ++i) x[n * H + i] += pos[(t0 + n % Ts) * H + i];
    }
    HiddenDropout(x.data(), DropoutSite(-1, 0));
  } else {
    std::copy(x_in, x_in + R * H, x.begin());
  }
  a.layers.resize(end_layer - first_layer);
  a.moe_aux = {};
  // The earlier stages' MoE layers' routing, after the hidden state (HiddenStateFloats).
  if (!FirstStage(chunk) && format_.moe()) UnpackMoeAuxStats(&a.moe_aux, x_in + R * H, c_.experts, c_.moe_top_k);
  for (int l = first_layer; l < end_layer; ++l) {
    LayerCache& lc = a.layers[l - first_layer];
    lc.x = x;
    LayerForward(l, lc, x.data());
    if (ckpt::IsMoeLayer(format_, l)) AddMoeAuxStats(&a.moe_aux, lc.moe, MoeShapeOf());
    Drop(lc);
  }
  if (!LastStage(chunk)) {
    if (format_.moe()) x.resize(R * H + MoeAuxStatsFloats(c_.experts)), PackMoeAuxStats(x.data() + R * H, a.moe_aux, c_.experts);
    *x_out = std::move(x);
    return 0;
  }
  check_ids(targets);
  a.targets.assign(targets, targets + N);
  a.x_final = std::move(x);
  std::vector<float> lnf(R * H);
  NormForward(Name(Module::kFinalNorm), a.x_final.data(), lnf.data(), a.meanf, a.rstdf);
  if (SequenceParallel()) GatherRows(lnf.data(), a.lnf);
  else a.lnf = std::move(lnf);
  a.logits.resize(N * V_), a.probs.resize(N * V_);
  // The output layer has no bias; tied, it is the word embedding matrix. Its rows (this rank's
  // vocabulary) give this rank's logits, and cross-entropy joins them with three reductions.
  LinearForward(a.logits.data(), a.lnf.data(), W(OutputWeight()), nullptr, N, H, V_);
  std::vector<float> row_max(N);
  CrossEntropyRowMax(row_max.data(), a.logits.data(), N, V_);
  if (tp_.comm) tp_.comm->AllReduceMax(row_max.data(), static_cast<size_t>(N));
  std::vector<double> sums(2 * N);  // sum of exp(logit - max), then the target's logit
  CrossEntropySums(sums.data(), sums.data() + N, a.probs.data(), a.logits.data(), row_max.data(), targets, v0_, N, V_);
  if (tp_.comm) tp_.comm->AllReduceSum(sums.data(), sums.size());
  const float loss = CrossEntropyFinish(a.probs.data(), sums.data(), sums.data() + N, row_max.data(), N, V_);
  // NxDT's MixtralForCausalLM: loss += router_aux_loss_coef * load_balancing_loss_func(all router logits).
  if (c_.router_aux_loss_coef == 0 || a.moe_aux.rows == 0) return loss;
  return static_cast<float>(loss + c_.router_aux_loss_coef * MoeAuxLossOf(a.moe_aux));
}

void Model::BackwardStage(Activations& a, const float* dx_out, std::vector<float>* dx_in) {
  B_ = a.B, T_ = a.T, dropout_key_ = a.dropout_key;
  const auto [first_layer, end_layer] = chunk_layers_[a.chunk];
  const int64_t N = B_ * T_, R = Rows(), H = c_.hidden, F = F_, V = V_, Hl = nh_ * c_.head_dim();
  std::vector<float> dx(R * H), dln(N * H), dln_here(SequenceParallel() ? R * H : 0), whole;
  // The column-parallel layers' input gradients, over all rows, summed over the ranks into this rank's rows.
  auto reduce_dln = [&]() -> float* {
    float* here = SequenceParallel() ? dln_here.data() : dln.data();
    ReduceRows(dln.data(), here);
    return here;
  };
  if (LastStage(a.chunk)) {
    std::vector<float> dlogits(N * V);
    CrossEntropyBackward(dlogits.data(), a.probs.data(), a.targets.data(), v0_, N, V);
    LinearBackward(dln.data(), Dw(OutputWeight()), nullptr, dlogits.data(), a.lnf.data(), W(OutputWeight()), N, H, V);
    NormBackward(Name(Module::kFinalNorm), reduce_dln(), a.x_final.data(), a.meanf, a.rstdf, dx.data());
  } else {
    std::copy(dx_out, dx_out + R * H, dx.begin());
    // Every MoE layer's routing, from the last stage: the auxiliary loss's gradient needs the totals.
    if (format_.moe()) UnpackMoeAuxStats(&a.moe_aux, dx_out + R * H, c_.experts, c_.moe_top_k);
  }
  const int64_t fc_width = c_.gelu ? F : 2 * F;
  std::vector<float> dact(N * F), dfc(N * fc_width), dpart(R * H), dy(N * Hl), dropped;
  // The gradient at a block's output as it was before hidden dropout (dx itself without dropout),
  // over all rows (the row-parallel layer's output gradient).
  auto before_dropout = [&](int l, int site) -> const float* {
    const float* d = dx.data();
    if (c_.hidden_dropout > 0) {
      dropped = dx;
      HiddenDropout(dropped.data(), DropoutSite(l, site));
      d = dropped.data();
    }
    return GatherRows(d, whole);
  };
  for (int l = end_layer - 1; l >= first_layer; --l) {
    LayerCache& lc = a.layers[l - first_layer];
    if (lc.x2.empty()) {  // full recompute: rebuild the layer's activations from its input
      std::vector<float> unused(N * H);
      LayerForward(l, lc, unused.data());
    } else if (lc.att.empty()) {  // selective: rebuild the attention probabilities
      AttentionCore(l, lc);
    }
    // MLP block: dx is the gradient at the layer output (x2 + dropout(mlp_out)).
    if (ckpt::IsMoeLayer(format_, l)) {
      MoeMlpBackward(l, lc, a, before_dropout(l, 3), dln.data());
    } else {
      LinearGrad(Name(Module::kMlpOut, l), before_dropout(l, 3), lc.act.data(), dact.data(), F, H);
      DropoutApplyColumns(dact.data(), N, F, f0_, c_.ffn, c_.ffn_dropout, DropoutSite(l, 2));
      if (c_.gelu) GeluBackward(dfc.data(), dact.data(), lc.fc.data(), N * F);
      else SwiGluBackward(dfc.data(), dact.data(), lc.fc.data(), N, F);
      LinearGrad(Name(Module::kMlpIn, l), dfc.data(), lc.ln2.data(), dln.data(), H, fc_width);
    }
    NormBackward(Name(Module::kPostAttentionNorm, l), reduce_dln(), lc.x2.data(), lc.mean2, lc.rstd2, dpart.data());
    for (int64_t i = 0; i < R * H; ++i) dx[i] += dpart[i];  // now the gradient at x2
    // Attention block.
    LinearGrad(Name(Module::kAttentionOut, l), before_dropout(l, 1), lc.y.data(), dy.data(), Hl, H);
    AttentionBackward(l, lc, dy.data(), dln.data());
    NormBackward(Name(Module::kInputNorm, l), reduce_dln(), lc.x.data(), lc.mean1, lc.rstd1, dpart.data());
    for (int64_t i = 0; i < R * H; ++i) dx[i] += dpart[i];  // the gradient at the layer input
    Drop(lc);
  }
  if (FirstStage(a.chunk)) {
    HiddenDropout(dx.data(), DropoutSite(-1, 0));
    const float* d = GatherRows(dx.data(), whole);  // every row: each rank's vocabulary rows, all positions
    EmbeddingBackward(Dw(Name(Module::kEmbedding)), d, a.tokens.data(), N, H, v0_, V_);
    if (c_.learned_positions) {
      float* dpos = Dw(Name(Module::kPositionEmbedding));
      for (int64_t n = 0; n < N; ++n)  // serial: positions repeat across the batch
        for (int64_t i = 0; i < H; ++i) dpos[(n % T_) * H + i] += d[n * H + i];
    }
  } else {
    if (format_.moe()) dx.resize(R * H + MoeAuxStatsFloats(c_.experts)), PackMoeAuxStats(dx.data() + R * H, a.moe_aux, c_.experts);
    *dx_in = std::move(dx);
  }
}

}  // namespace train
