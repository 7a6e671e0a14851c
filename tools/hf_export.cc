#include "tools/hf_export.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <nlohmann/json.hpp>

#include "ckpt/spec/lora.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/pt/dtype_cast.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/storage.h"
#include "ckpt/pt/tensor.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/training_state.h"

namespace tools {
namespace {

using ckpt::DType;
using ckpt::Error;

using HfTensor = ckpt::HfTensorSpec;
using RowBlock = ckpt::HfRowBlock;

// Float32 values of `bytes` of dtype d (float32 or bfloat16), and back;
// other dtypes are refused naming `what`.
std::vector<float> ToFloats(DType d, std::span<const uint8_t> bytes, const std::string& what) {
  std::vector<float> v(bytes.size() / ckpt::ElementSize(d));
  if (d == DType::kFloat32) {
    std::memcpy(v.data(), bytes.data(), bytes.size());
  } else if (d == DType::kBFloat16) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = ckpt::BFloat16ToFloat(static_cast<uint16_t>(bytes[2 * i] | bytes[2 * i + 1] << 8));
  } else {
    throw Error("hf export: " + what + " is " + std::string(ckpt::DTypeName(d)) + "; a LoRA merge reads float32 and bfloat16 only");
  }
  return v;
}

void FromFloats(DType d, const std::vector<float>& v, std::span<uint8_t> out) {
  if (d == DType::kFloat32) return (void)std::memcpy(out.data(), v.data(), out.size());
  for (size_t i = 0; i < v.size(); ++i) {  // bfloat16 (ToFloats refused the rest)
    const uint16_t b = ckpt::FloatToBFloat16(v[i]);
    out[2 * i] = static_cast<uint8_t>(b), out[2 * i + 1] = static_cast<uint8_t>(b >> 8);
  }
}

// The merged rows of one targeted base tensor (ckpt::LoraMergeOf): elements
// are read from the base and merged in float32, W + (B A) * scale with the
// rank-long dot products summed in order k = 0..rank-1 (layer.py
// get_delta_weight), then rounded once to the base's dtype. Holds lora_A
// ([rank, in], float32) and, per call, the rows of lora_B it needs.
class LoraMerge {
 public:
  LoraMerge(const ckpt::LogicalState& src, ckpt::LoraMergeSource m, int64_t width, DType dtype)
      : src_(src), m_(std::move(m)), dtype_(dtype), width_(width), rank_(src.layout().format.lora.rank),
        scale_(static_cast<float>(ckpt::LoraScale(src.layout().format.lora))) {}

  // Logical elements [e, e + out.size()/es) of the merged tensor, in the base's dtype.
  void Read(uint64_t e, std::span<uint8_t> out) {
    const DType d = src_.dtype(m_.base, ckpt::StateField::kParam);
    if (d != dtype_) throw Error("hf export: " + m_.base + " is " + std::string(ckpt::DTypeName(d)) + ", the model's other weights " +
                                 std::string(ckpt::DTypeName(dtype_)));
    const size_t es = ckpt::ElementSize(d);
    std::vector<uint8_t> raw(out.size());
    {
      ckpt::Touched touched(out.size());
      src_.Read(m_.base, ckpt::StateField::kParam, e, raw, &touched);
    }
    std::vector<float> w = ToFloats(d, raw, m_.base);
    const std::vector<float>& a = A();
    const uint64_t n = out.size() / es, width = static_cast<uint64_t>(width_), rank = static_cast<uint64_t>(rank_);
    const uint64_t row0 = e / width, rows = n == 0 ? 0 : (e + n - 1) / width - row0 + 1;
    const std::vector<float> b = ReadFloats(m_.b, row0 * rank, rows * rank);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t r = (e + i) / width - row0, c = (e + i) % width;
      float dot = 0;
      for (uint64_t k = 0; k < rank; ++k) dot += b[r * rank + k] * a[k * width + c];
      w[i] += dot * scale_;
    }
    FromFloats(d, w, out);
  }

 private:
  std::vector<float> ReadFloats(const std::string& name, uint64_t begin, uint64_t count) const {
    const DType d = src_.dtype(name, ckpt::StateField::kParam);
    std::vector<uint8_t> raw(count * ckpt::ElementSize(d));
    ckpt::Touched touched(raw.size());
    src_.Read(name, ckpt::StateField::kParam, begin, raw, &touched);
    return ToFloats(d, raw, name);
  }
  const std::vector<float>& A() {
    std::call_once(a_once_, [&] { a_ = ReadFloats(m_.a, 0, static_cast<uint64_t>(rank_ * width_)); });
    return a_;
  }

  const ckpt::LogicalState& src_;
  ckpt::LoraMergeSource m_;
  DType dtype_;  // the HF tensor's
  int64_t width_, rank_;
  float scale_;
  std::once_flag a_once_;
  std::vector<float> a_;
};

// Lets transposed tensors hold their whole matrices one at a time, in file
// order: turn k waits until turn k - 1 is done. In order, not first come:
// pieces are claimed in file order, so the matrix whose turn it is has all
// its pieces claimed and finishes, where a later one taking the turn first
// could wait for pieces the full ring keeps unclaimed.
class WholeTurns {
 public:
  void Wait(int turn) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return turn_ == turn; });
  }
  void Done() {
    {
      std::lock_guard lock(mu_);
      ++turn_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int turn_ = 0;
};

// Produces an HfTensor's bytes, a chunk at a time, from any number of
// threads. A transposed one reads its whole logical matrix at the first chunk
// asked for and frees it once every byte was produced; with `turns`, it
// holds that matrix in its turn `turn` (WholeTurns), so the producers sharing
// them hold one such matrix at a time. A LoRA target's blocks are merged (LoraMerge).
class Producer {
 public:
  Producer(const ckpt::LogicalState& src, HfTensor t, ckpt::FingerprintCollector* fp, WholeTurns* turns = nullptr, int turn = 0)
      : src_(src), t_(std::move(t)), fp_(fp), turns_(turns), turn_(turn) {
    for (const RowBlock& b : t_.blocks) {
      auto m = ckpt::LoraMergeOf(src.layout().format, b.name);
      merges_.push_back(m ? std::make_unique<LoraMerge>(src, std::move(*m), t_.width, t_.dtype) : nullptr);
    }
  }

  void operator()(uint64_t offset, std::span<uint8_t> out) {
    const size_t es = ckpt::ElementSize(t_.dtype);
    if (!t_.transpose) {
      Gather(offset / es, out);
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t rows = static_cast<int64_t>(t_.numel()) / t_.width;  // of the concatenated matrix
      if (whole_.empty()) Hold();
      // out element e of the [width, rows] transpose is whole_[(e % rows) * width + e / rows].
      const uint64_t e0 = offset / es, n = out.size() / es;
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t e = e0 + i, r = e % static_cast<uint64_t>(rows), c = e / static_cast<uint64_t>(rows);
        std::memcpy(out.data() + i * es, whole_.data() + (r * static_cast<uint64_t>(t_.width) + c) * es, es);
      }
      if ((produced_ += out.size()) >= t_.bytes()) Release();
    }
  }

 private:
  // The whole matrix of a transposed tensor, read in its turn.
  void Hold() {
    if (turns_) turns_->Wait(turn_);
    try {
      whole_.resize(t_.bytes());
      Gather(0, whole_);
    } catch (...) {
      Release();
      throw;
    }
  }
  void Release() {
    std::vector<uint8_t>().swap(whole_);
    produced_ = 0;
    if (turns_) turns_->Done();
  }

  // Elements [e, e + out.size()/es) of the concatenated blocks. A block of
  // step > 1 is read a row at a time (its rows are apart in the logical tensor).
  void Gather(uint64_t e, std::span<uint8_t> out) const {
    const size_t es = ckpt::ElementSize(t_.dtype);
    const uint64_t width = static_cast<uint64_t>(t_.width);
    uint64_t n = out.size() / es, o = 0, start = 0;
    for (size_t i = 0; i < t_.blocks.size(); ++i) {
      const RowBlock& b = t_.blocks[i];
      const uint64_t len = static_cast<uint64_t>(b.rows) * width;
      while (n > 0 && e >= start && e < start + len) {
        const uint64_t from = e - start, row = from / width, col = from % width;
        const uint64_t take = b.step == 1 ? std::min(n, len - from) : std::min(n, width - col);
        const uint64_t at = (static_cast<uint64_t>(b.row) + row * static_cast<uint64_t>(b.step)) * width + col;
        const std::span<uint8_t> part{out.data() + o * es, take * es};
        if (merges_[i]) {  // a LoRA target (whole rows, step 1): W + scale * B A
          merges_[i]->Read(at, part);
        } else {
          ckpt::Touched touched(out.size());  // source pages: at most a chunk's worth
          src_.Read(b.name, ckpt::StateField::kParam, at, part, &touched);
          if (fp_) fp_->Add(b.name, ckpt::StateField::kParam, at * es, part);
        }
        e += take, n -= take, o += take;
      }
      start += len;
    }
    if (n) throw Error("hf export: " + t_.name + ": elements past its blocks");  // a mapping bug, never input
  }

  const ckpt::LogicalState& src_;
  HfTensor t_;
  std::vector<std::unique_ptr<LoraMerge>> merges_;  // per block, null when it is read as it is
  ckpt::FingerprintCollector* fp_;                   // HfExportOptions::fingerprints
  WholeTurns* turns_;                                // null: no turns to take
  int turn_;
  std::mutex mu_;
  std::vector<uint8_t> whole_;
  uint64_t produced_ = 0;  // of whole_'s transpose
};

const char* SafetensorsDtype(DType d) {
  switch (d) {
    case DType::kFloat32: return "F32";
    case DType::kFloat64: return "F64";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
    default: throw Error(std::string("hf export: no safetensors dtype for ") + std::string(ckpt::DTypeName(d)));
  }
}

std::string ShardName(const std::string& stem, const std::string& ext, int k, int n) {
  if (n == 1) return stem + "." + ext;
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.", k + 1, n);
  return stem + buf + ext;
}

void WriteText(ckpt::Env* env, const std::string& path, const std::string& text) {
  ckpt::WriteFileAtomically(env, path, [&](ckpt::WritableFile& f) {
    f.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  });
}

// --- Mixtral (MoE) (issue #38) ---
// LlamaForCausalLM's config.json made MixtralForCausalLM's (transformers'
// configuration_mixtral.py MixtralConfig): its experts and top_k, no sliding
// window (NxDT's Mixtral attends to every earlier position; MixtralConfig's
// default is not null in every transformers release, so it is written).
void AddMixtralConfig(const ckpt::ModelFormat& f, nlohmann::ordered_json& config) {
  config["architectures"] = {"MixtralForCausalLM"};
  config["model_type"] = "mixtral";
  config["num_local_experts"] = f.experts;
  config["num_experts_per_tok"] = f.moe_top_k;
  config["sliding_window"] = nullptr;
  config.erase("attention_bias");  // not a MixtralConfig key
}

// Why the routing NxDT's job config (user_content.pt hyper_parameters.cfg.moe)
// records is not MixtralSparseMoeBlock's ("" when it is, or when no config is
// recorded): HF's softmax over the router logits, top-k, the chosen weights
// renormalised. NxDT's Megatron style may route by Sinkhorn (routing_algorithm,
// transformer.py NeuronSwitchMLP) and leaves the top-k weights unnormalised
// at top_k 1 (megatron_gpt_model.py: normalize_top_k_affinities defaults to
// top_k > 1); the HF style always builds RouterTopK (softmax).
std::string MixtralRoutingProblem(const ckpt::LogicalState& src) {
  const std::optional<ckpt::Value> uc = src.TagFile(ckpt::kUserContentFile);
  const ckpt::Value* cfg = uc ? ckpt::RecordedJobConfig(*uc) : nullptr;
  const ckpt::Value* moe = cfg ? ckpt::ConfigEntry(*cfg, "moe") : nullptr;
  if (!moe || !(moe->is_dict() || moe->is_object())) return "";
  const ckpt::ModelFormat& f = src.layout().format;
  const std::string where = src.path() + "/" + ckpt::kUserContentFile + " (hyper_parameters.cfg.moe.";
  if (f.family == ckpt::ModelFamily::kMegatron)
    if (const ckpt::Value* algo = ckpt::ConfigEntry(*moe, "routing_algorithm"); algo && algo->is_str() && algo->as_str() != "top_k")
      return where + "routing_algorithm) routes by '" + algo->as_str() + "', which MixtralForCausalLM's softmax top-k router does not compute";
  const ckpt::Value* norm = ckpt::ConfigEntry(*moe, "normalize_top_k_affinities");
  const bool normalized = norm && norm->is_bool() ? norm->as_bool() : f.family == ckpt::ModelFamily::kHfLlama || f.moe_top_k > 1;
  if (!normalized)
    return where + "normalize_top_k_affinities) leaves the chosen experts' weights unnormalised, which MixtralForCausalLM always normalises";
  return "";
}

// A piece of a safetensors file's data: tensors[tensor]'s bytes [offset, offset + size).
struct Piece {
  size_t tensor;
  uint64_t offset;
  size_t size;
};

// The pieces of `which`'s tensors in file order, the first at file offset
// `at`: at most `size` bytes each, and (when `size` is more than a page) each
// ending on a page boundary of the file (the header leaves the first
// mid-page), so that from page-aligned memory the writer sends them with
// O_DIRECT (ckpt/util/env_posix.cc), not through the page cache, whose copy
// was a sixth of an export's CPU.
std::vector<Piece> PiecesOf(const std::vector<HfTensor>& tensors, const std::vector<size_t>& which, size_t size, uint64_t at) {
  constexpr size_t kPage = 4096;
  std::vector<Piece> pieces;
  for (size_t i : which)
    for (uint64_t off = 0, bytes = tensors[i].bytes(); off < bytes;) {
      const size_t room = size > kPage ? size - static_cast<size_t>(at % kPage) : size;
      const size_t m = static_cast<size_t>(std::min<uint64_t>(room, bytes - off));
      pieces.push_back({i, off, m});
      off += m, at += m;
    }
  return pieces;
}

// Fills `pieces` on `threads` threads into a ring of threads + 1 page-aligned
// buffers of `size` bytes and calls write() with each, in order, on this
// thread: piece p is filled once piece p - (threads + 1) was written, so the
// source is read (and re-laid) while the disk writes, and memory holds the
// ring. The first exception (fill's or write's) stops both and is rethrown.
void FillAndWrite(const std::vector<Piece>& pieces, size_t size, int threads, const std::function<void(const Piece&, std::span<uint8_t>)>& fill,
                  const std::function<void(std::span<const uint8_t>)>& write) {
  const size_t ring = static_cast<size_t>(std::max(threads, 1)) + 1, n = pieces.size();
  std::vector<std::shared_ptr<ckpt::Storage>> buffers;
  for (size_t b = 0; b < std::min(ring, n); ++b) buffers.push_back(ckpt::Storage::Allocate(size, /*zero=*/false));  // on pages
  std::mutex mu;
  std::condition_variable cv;
  size_t next = 0, written = 0;                  // the next piece to fill; pieces written
  std::vector<size_t> holds(ring, SIZE_MAX);     // per buffer: the piece filled in it
  std::exception_ptr failed;
  bool stop = false;
  auto work = [&] {
    for (;;) {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return stop || next == n || next < written + ring; });
      if (stop || next == n) return;
      const size_t p = next++;
      lock.unlock();
      try {
        fill(pieces[p], {buffers[p % ring]->mutable_data(), pieces[p].size});
      } catch (...) {
        lock.lock();
        if (!failed) failed = std::current_exception();
        stop = true;
        cv.notify_all();
        return;
      }
      lock.lock();
      holds[p % ring] = p;
      cv.notify_all();
    }
  };
  std::vector<std::thread> workers;
  auto join = [&] {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv.notify_all();
    for (std::thread& t : workers) t.join();
  };
  try {
    for (int t = 0; t < std::max(threads, 1) && static_cast<size_t>(t) < n; ++t) workers.emplace_back(work);
    for (size_t p = 0; p < n; ++p) {
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return failed || holds[p % ring] == p; });
        if (failed) break;
      }
      write({buffers[p % ring]->data(), pieces[p].size});
      std::lock_guard lock(mu);
      ++written;
      cv.notify_all();
    }
  } catch (...) {
    join();
    throw;
  }
  join();
  if (failed) std::rethrow_exception(failed);
}

// safetensors: u64 header length, the JSON header (8-byte aligned), then
// tensors[i] for i in `which`, produced on o.threads threads while written.
void WriteSafetensors(const ckpt::LogicalState& src, const std::vector<HfTensor>& tensors, const std::vector<size_t>& which,
                      const std::string& path, const HfExportOptions& o, ckpt::Env* env) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t at = 0;
  for (size_t i : which) {
    const HfTensor& t = tensors[i];
    header[t.name] = {{"dtype", SafetensorsDtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes()}}};
    at += t.bytes();
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const size_t size = static_cast<size_t>(std::min<uint64_t>(o.chunk, std::max<uint64_t>(at, 1)));
  const std::vector<Piece> pieces = PiecesOf(tensors, which, size, 8 + text.size());
  WholeTurns turns;  // one transposed matrix held at a time, whatever the threads
  std::map<size_t, std::unique_ptr<Producer>> producers;
  int transposed = 0;
  for (size_t i : which) producers[i] = std::make_unique<Producer>(src, tensors[i], o.fingerprints, &turns, tensors[i].transpose ? transposed++ : 0);
  ckpt::WriteFileAtomically(env, path, [&](ckpt::WritableFile& file) {
    uint8_t len[8];
    for (int b = 0; b < 8; ++b) len[b] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * b));
    file.Append({len, 8});
    file.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
    FillAndWrite(
        pieces, size, o.threads, [&](const Piece& p, std::span<uint8_t> out) { (*producers.at(p.tensor))(p.offset, out); },
        [&](std::span<const uint8_t> bytes) { file.Append(bytes); });
  });
}

// The tag's lora_dropout: its lora_config, carried as a model-file buffer (ckpt/spec/lora.h).
double LoraDropout(const ckpt::LogicalState& src) {
  for (const ckpt::StateBuffer& b : src.buffers())
    if (b.name == ckpt::kLoraConfigKey) return ckpt::LoraDropoutOfConfig(b.value, src.path());
  throw Error(src.path() + ": holds LoRA adapters but no '" + ckpt::kLoraConfigKey + "' to take lora_dropout from");
}

}  // namespace

HfExportSummary WriteHfFolder(const ckpt::LogicalState& src, const std::string& dir, const HfExportOptions& o, ckpt::Env* env) {
  const ckpt::ModelFormat& f = src.layout().format;
  if (const std::string why = ckpt::HfUnsupported(f); !why.empty()) throw Error(src.path() + ": " + why);
  if (const std::string why = ckpt::LoraHfUnsupported(f); !why.empty()) throw Error(src.path() + ": " + why);
  if (const std::string why = f.moe() ? MixtralRoutingProblem(src) : ""; !why.empty()) throw Error(why);
  const bool gpt2 = f.gelu;
  std::vector<HfTensor> tensors =
      ckpt::HfTensorsFor(f, src.dtype(src.params().front().name, ckpt::StateField::kParam));  // the embedding's, first in every family
  HfExportSummary sum;
  sum.architecture = ckpt::HfArchitecture(f);

  // Shards: tensors in order, a new file when the next would pass the limit (a full state is one file).
  std::vector<std::vector<size_t>> shards(1);
  uint64_t in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!o.full_state && in_shard > 0 && in_shard + tensors[i].bytes() > o.max_shard_size) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(i);
    in_shard += tensors[i].bytes();
    sum.bytes += tensors[i].bytes();
  }
  const int n = static_cast<int>(shards.size());
  sum.shards = n, sum.tensors = tensors.size();
  nlohmann::ordered_json bin_map = nlohmann::ordered_json::object(), st_map = nlohmann::ordered_json::object();
  for (int k = 0; k < n; ++k) {
    const std::string bin = ShardName("pytorch_model", "bin", k, n), st = ShardName("model", "safetensors", k, n);
    // torch's zip format, tensors produced as they are written.
    ckpt::Value sd = ckpt::Value::NewDict(/*ordered=*/true);
    for (size_t i : shards[k]) {
      const HfTensor& t = tensors[i];
      auto producer = std::make_shared<Producer>(src, t, o.fingerprints);
      auto storage = ckpt::Storage::Generated(t.bytes(), [producer](uint64_t off, std::span<uint8_t> out) { (*producer)(off, out); });
      std::vector<int64_t> strides(t.shape.size(), 1);
      for (int d = static_cast<int>(t.shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * t.shape[d + 1];
      sd.as_dict().Set(t.name, ckpt::Value(ckpt::Tensor(t.dtype, t.shape, strides, 0, storage)));
      bin_map[t.name] = bin, st_map[t.name] = st;
    }
    if (o.full_state) {
      ckpt::SavePt(dir + "/checkpoint.pt", sd, {.weights_only = true, .stream_chunk = o.chunk}, env);
      break;
    }
    if (o.bin) ckpt::SavePt(dir + "/" + bin, sd, {.weights_only = true, .stream_chunk = o.chunk}, env);
    WriteSafetensors(src, tensors, shards[k], dir + "/" + st, o, env);
  }
  if (n > 1 && !o.full_state) {
    if (o.bin)
      WriteText(env, dir + "/pytorch_model.bin.index.json",
                nlohmann::ordered_json{{"metadata", {{"total_size", sum.bytes}}}, {"weight_map", bin_map}}.dump(2) + "\n");
    WriteText(env, dir + "/model.safetensors.index.json",
              nlohmann::ordered_json{{"metadata", {{"total_size", sum.bytes}}}, {"weight_map", st_map}}.dump(2) + "\n");
  }

  const std::string torch_dtype(ckpt::DTypeName(tensors.front().dtype));
  nlohmann::ordered_json config;
  if (gpt2) {
    config = {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", f.vocab_size},
              {"n_positions", f.max_positions}, {"n_ctx", f.max_positions}, {"n_embd", f.hidden}, {"n_layer", f.layers},
              {"n_head", f.heads}, {"n_inner", f.ffn}, {"activation_function", "gelu"},  // the training core's GeLU is erf's
              {"layer_norm_epsilon", f.norm_eps}, {"scale_attn_weights", true}, {"tie_word_embeddings", f.tied_output},
              {"torch_dtype", torch_dtype}};
  } else {
    config = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", f.vocab_size},
              {"hidden_size", f.hidden}, {"intermediate_size", f.ffn}, {"num_hidden_layers", f.layers},
              {"num_attention_heads", f.heads}, {"num_key_value_heads", f.kv_heads}, {"hidden_act", "silu"},
              {"rms_norm_eps", f.norm_eps}, {"rope_theta", f.rope_theta}, {"attention_bias", false},
              {"tie_word_embeddings", f.tied_output}, {"torch_dtype", torch_dtype}};
  }
  if (f.moe()) AddMixtralConfig(f, config);
  // The longest sequence the model was trained for, when the tag records it (else transformers' default).
  if (!gpt2 && f.max_positions > 0) config["max_position_embeddings"] = f.max_positions;
  // Where it came from; also how --overwrite knows the folder is an export.
  config["shardkit_export"] = {{"source", src.path()}, {"step", src.step()}, {"model", f.ToJson()}};
  WriteText(env, dir + "/config.json", config.dump(2) + "\n");
  return sum;
}

HfExportSummary WritePeftFolder(const ckpt::LogicalState& src, const std::string& dir, const HfExportOptions& o, ckpt::Env* env) {
  const ckpt::ModelFormat& f = src.layout().format;
  if (!f.lora.on() || f.lora.saved == ckpt::LoraSaved::kMerged)
    throw Error(src.path() + ": --format peft writes the adapters of a tag holding them (with or without the base), and this tag " +
                (f.lora.on() ? "has them merged" : "has no LoRA adapters"));
  if (const std::string why = ckpt::HfUnsupported(f); !why.empty()) throw Error(src.path() + ": " + why);
  // Each targeted HF weight's adapter pair (peft's LoraLayer names): lora_A whole (q, k and v
  // share NxD's one; gate and up too), lora_B the rows its base weight takes from the logical one.
  std::vector<HfTensor> adapters;
  std::vector<std::string> targets;
  HfExportSummary sum{"peft LoRA adapter", 1, 0, 0};
  for (const HfTensor& t : ckpt::HfTensorsFor(f, DType::kFloat32)) {
    const auto m = ckpt::LoraAdaptersOf(f, t.blocks.front().name);
    if (!m) continue;
    const std::string stem = "base_model.model." + t.name.substr(0, t.name.size() - std::string(".weight").size());
    const int64_t r = f.lora.rank;
    HfTensor a{stem + ".lora_A.weight", {r, t.width}, src.dtype(m->a, ckpt::StateField::kParam), {{m->a, 0, r}}, t.width, false};
    HfTensor b{stem + ".lora_B.weight", {t.shape[0], r}, src.dtype(m->b, ckpt::StateField::kParam), {}, r, false};
    for (const RowBlock& blk : t.blocks) b.blocks.push_back({ckpt::LoraAdaptersOf(f, blk.name)->b, blk.row, blk.rows});
    adapters.push_back(std::move(a)), adapters.push_back(std::move(b));
    const std::string module = t.name.substr(0, t.name.rfind('.'));
    const std::string leaf = module.substr(module.rfind('.') + 1);
    if (std::find(targets.begin(), targets.end(), leaf) == targets.end()) targets.push_back(leaf);
  }
  std::vector<size_t> all(adapters.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i, sum.bytes += adapters[i].bytes();
  sum.tensors = adapters.size();
  WriteSafetensors(src, adapters, all, dir + "/adapter_model.safetensors", o, env);
  // peft's LoraConfig fields (what PeftModel.from_pretrained reads), lora_dropout the tag's lora_config's.
  // The folder depends on the adapters alone: the same whether the tag also held the base (its model
  // is recorded as the adapters' and no source path is written), so the two saves export alike.
  ckpt::ModelFormat held = f;
  held.lora.saved = ckpt::LoraSaved::kAdapterOnly;
  const nlohmann::ordered_json config = {
      {"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"}, {"base_model_name_or_path", nullptr}, {"r", f.lora.rank},
      {"lora_alpha", f.lora.alpha}, {"use_rslora", f.lora.use_rslora}, {"target_modules", targets}, {"lora_dropout", LoraDropout(src)},
      {"bias", "none"}, {"fan_in_fan_out", false}, {"modules_to_save", nullptr}, {"inference_mode", true},
      {"shardkit_export", {{"step", src.step()}, {"model", held.ToJson()}}}};
  WriteText(env, dir + "/adapter_config.json", config.dump(2) + "\n");
  return sum;
}

}  // namespace tools
