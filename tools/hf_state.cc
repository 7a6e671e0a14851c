#include "tools/hf_state.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "ckpt/util/error.h"
#include "ckpt/util/input_guard.h"
#include "ckpt/pt/value_json.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/shard/stream_budget.h"

namespace tools {

nlohmann::json ReadJson(ckpt::Env* env, const std::string& path) {
  const auto m = env->MapFile(path);
  nlohmann::json j = ckpt::ParseJsonBounded(reinterpret_cast<const char*>(m->data()), reinterpret_cast<const char*>(m->data()) + m->size(), path);
  if (j.is_discarded() || !j.is_object()) throw ckpt::Error(path + ": is not a JSON object");
  return j;
}

namespace {

using ckpt::DType;
using ckpt::Error;


std::optional<DType> SafetensorsType(const std::string& s) {
  if (s == "F32") return DType::kFloat32;
  if (s == "BF16") return DType::kBFloat16;
  if (s == "F16") return DType::kFloat16;
  if (s == "F64") return DType::kFloat64;
  return std::nullopt;
}

// The weights files a folder's index (or the single file) names, and the
// index's weight_map (empty for a single file): which file holds each tensor.
struct WeightFiles {
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;
  std::string index;  // the index's path, for messages
};

WeightFiles FindWeightFiles(ckpt::Env* env, const std::string& dir, const std::string& single, const std::string& index) {
  WeightFiles w;
  if (env->Exists(dir + "/" + single)) {
    w.files = {single};
    return w;
  }
  if (!env->Exists(dir + "/" + index)) return w;
  w.index = dir + "/" + index;
  ckpt::RequireInside(dir, w.index);
  const nlohmann::json j = ReadJson(env, w.index);
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) throw Error(w.index + ": has no 'weight_map' object");
  // Each shard is looked for once, when first named, and the first missing one
  // ends the search: an index naming 100,000 missing shards took 53 s.
  std::set<std::string> named;
  for (const auto& [k, v] : j["weight_map"].items()) {
    if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().find('/') != std::string::npos ||
        v.get<std::string>() == "." || v.get<std::string>() == "..")
      throw Error(w.index + ": weight_map['" + k + "'] is not a file name in the folder");
    const std::string& file = v.get_ref<const std::string&>();
    w.weight_map[k] = file;
    if (!named.insert(file).second) continue;
    if (!env->Exists(dir + "/" + file)) throw Error(dir + "/" + file + ": missing (named by " + w.index + " for tensor '" + k + "')");
    w.files.push_back(file);
  }
  return w;
}

}  // namespace

std::map<std::string, SafetensorsEntry> ParseSafetensors(std::span<const uint8_t> file, const std::string& path) {
  const uint8_t* p = file.data();
  if (file.size() < 8) throw Error(path + ": too short for a safetensors header");
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= static_cast<uint64_t>(p[b]) << (8 * b);
  if (n > file.size() - 8) throw Error(path + ": header length " + std::to_string(n) + " runs past the file");
  const nlohmann::json h = ckpt::ParseJsonBounded(reinterpret_cast<const char*>(p + 8), reinterpret_cast<const char*>(p + 8 + n), path);
  if (h.is_discarded() || !h.is_object()) throw Error(path + ": the header is not a JSON object");
  const uint64_t body = 8 + n, avail = file.size() - body;
  std::map<std::string, SafetensorsEntry> out;
  for (const auto& [k, e] : h.items()) {
    if (k == "__metadata__") continue;
    const std::string at = path + ": tensor '" + k + "'";
    if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() || !e.contains("shape") || !e["shape"].is_array() ||
        e["shape"].size() > 8 || !e.contains("data_offsets") || !e["data_offsets"].is_array() || e["data_offsets"].size() != 2 ||
        !e["data_offsets"][0].is_number_unsigned() || !e["data_offsets"][1].is_number_unsigned())
      throw Error(at + ": malformed header entry");
    const auto dt = SafetensorsType(e["dtype"].get<std::string>());
    if (!dt) throw Error(at + ": dtype " + e["dtype"].get<std::string>() + " is not a float type this import takes");
    SafetensorsEntry entry{*dt, {}, 0, 0};
    uint64_t numel = 1;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 40)) throw Error(at + ": malformed shape");
      entry.shape.push_back(d.get<int64_t>());
      const uint64_t dim = d.get<uint64_t>();  // a product past the file is too big, however big: no overflow
      numel = dim == 0 ? 0 : (numel > (avail + 1) / dim ? avail + 1 : numel * dim);
    }
    const uint64_t b = e["data_offsets"][0].get<uint64_t>(), t = e["data_offsets"][1].get<uint64_t>();
    if (b > t || t > avail || numel > avail || t - b != numel * ckpt::ElementSize(entry.dtype))
      throw Error(at + ": data_offsets do not fit its shape and dtype or the file");
    entry.begin = body + b, entry.end = body + t;
    out.emplace(k, std::move(entry));
  }
  // Each tensor owns its bytes: overlapping entries would import one tensor's data as another's.
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> by_offset;
  for (const auto& [k, e] : out)
    if (e.end > e.begin) by_offset.push_back({&k, &e});
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i].second->begin < by_offset[i - 1].second->end)
      throw Error(path + ": tensors '" + *by_offset[i - 1].first + "' and '" + *by_offset[i].first + "' overlap in the file (data_offsets)");
  return out;
}


std::unique_ptr<HfState> HfState::Open(ckpt::Env* env, const std::string& src, const HfImportOptions& o) {
  static std::atomic<uint64_t> serials{0};
  std::unique_ptr<HfState> s(new HfState());
  s->dir_ = src;
  s->serial_ = ++serials;
  s->reads_ = std::make_unique<ckpt::OpenFileCache>(env);
  const bool one_file = env->Exists(src) && !env->IsDirectory(src);
  // One weights file is read with the config.json given for it; a folder's files all lie inside it.
  const std::string dir = one_file ? std::filesystem::path(src).parent_path().string() : src;
  const std::string cpath = o.model_config.empty() ? dir + "/config.json" : o.model_config;
  if (one_file && o.model_config.empty()) throw Error(src + ": a single weights file needs --model_config (its config.json)");
  if (!env->IsDirectory(dir) || !env->Exists(cpath)) throw Error(src + ": is not a Hugging Face model folder (no config.json)");
  if (o.model_config.empty()) ckpt::RequireInside(dir, cpath);
  const nlohmann::json c = ReadJson(env, cpath);
  ckpt::ModelFormat& f = s->layout_.format;
  f = FormatOfHfConfig(c, cpath);
  f.make_vocab_size_divisible_by = o.make_vocab_size_divisible_by;
  if (o.family == ckpt::ModelFamily::kHfLlama) {
    if (f.gelu) throw Error(cpath + ": --model_source hf takes a LlamaForCausalLM (NxDT's HF-style models are Llama)");
    f.family = o.family, f.fuse_qkv = o.fuse_qkv, f.qkv_linear = o.qkv_linear;
    f.make_vocab_size_divisible_by = 1;  // NxD's ParallelEmbedding does not pad
  }

  // The weights: safetensors when present, else torch's .bin. With an index, each tensor
  // comes from the file its weight_map names, as transformers loads it; a name
  // two files hold, or one the index does not place, is refused rather than
  // letting the last file read win.
  WeightFiles w;
  bool safetensors;
  if (one_file) {
    w.files = {std::filesystem::path(src).filename().string()};
    safetensors = src.ends_with(".safetensors");
  } else {
    w = FindWeightFiles(env, dir, "model.safetensors", "model.safetensors.index.json");
    safetensors = !w.files.empty();
    if (!safetensors) w = FindWeightFiles(env, dir, "pytorch_model.bin", "pytorch_model.bin.index.json");
  }
  if (w.files.empty()) throw Error(dir + ": holds no model.safetensors, pytorch_model.bin or their index");
  std::map<std::string, std::string> held_by;
  auto take = [&](const std::string& name, const std::string& file, Source src) {
    if (const auto it = held_by.find(name); it != held_by.end())
      throw Error(dir + ": tensor '" + name + "' is in both " + it->second + " and " + file + "; refusing to pick one");
    if (!w.index.empty()) {
      const auto mapped = w.weight_map.find(name);
      if (mapped == w.weight_map.end()) throw Error(dir + "/" + file + ": tensor '" + name + "' is not in " + w.index + "'s weight_map");
      if (mapped->second != file)
        throw Error(dir + "/" + file + ": holds tensor '" + name + "', which " + w.index + " places in " + mapped->second);
    }
    held_by[name] = file;
    s->sources_[name] = std::move(src);
  };
  for (const std::string& name : w.files) {
    const std::string path = dir + "/" + name;
    if (!env->Exists(path)) throw Error(path + ": missing (named by the folder's index)");
    ckpt::RequireInside(dir, path);
    if (safetensors) {
      auto m = env->MapFile(path);
      for (auto& [k, e] : ParseSafetensors({m->data(), m->size()}, path))
        take(k, name, Source{m->data() + e.begin, m.get(), std::move(e.shape), e.dtype, true, e.begin});
      s->files_.push_back(std::move(m));
    } else {
      ckpt::Value sd = ckpt::LoadPt(path, {}, env);
      if (!sd.is_dict()) throw Error(path + ": is not a state dict");
      for (const auto& [k, v] : sd.as_dict().items) {
        if (!k.is_str() || !v.is_tensor()) continue;
        const ckpt::Tensor& t = v.as_tensor();
        if (!t.is_contiguous()) throw Error(path + ": tensor '" + k.as_str() + "' is not contiguous");
        take(k.as_str(), name, Source{t.data(), t.storage() && t.storage()->origin() ? t.storage()->origin()->file : nullptr, t.shape(), t.dtype()});
      }
      s->loaded_.push_back(std::move(sd));
    }
  }
  for (const auto& [k, file] : w.weight_map)
    if (!held_by.count(k)) throw Error(dir + "/" + file + ": has no tensor '" + k + "', which " + w.index + " places there");

  // Every tensor the mapping names, of its shape and one float type.
  const auto emb = s->sources_.find(f.gelu ? "transformer.wte.weight" : "model.embed_tokens.weight");
  if (emb == s->sources_.end()) throw Error(dir + ": has no embedding tensor");
  s->dtype_ = emb->second.dtype;
  if (s->dtype_ != DType::kFloat32 && s->dtype_ != DType::kBFloat16 && s->dtype_ != DType::kFloat16 && s->dtype_ != DType::kFloat64)
    throw Error(dir + ": the embedding is " + std::string(ckpt::DTypeName(s->dtype_)) + ", not a float type");
  s->specs_ = HfTensorsFor(f, s->dtype_);
  for (const HfTensorSpec& spec : s->specs_) {
    const auto it = s->sources_.find(spec.name);
    if (it == s->sources_.end()) throw Error(dir + ": tensor '" + spec.name + "' missing (" + std::string(ckpt::HfArchitecture(f)) + " with this config has it)");
    if (it->second.shape != spec.shape || it->second.dtype != s->dtype_)
      throw Error(dir + ": tensor '" + spec.name + "' is " + std::string(ckpt::DTypeName(it->second.dtype)) + " " +
                  ckpt::ShapeString(it->second.shape) + ", expected " + std::string(ckpt::DTypeName(s->dtype_)) + " " +
                  ckpt::ShapeString(spec.shape));
    int64_t from = 0;
    for (const HfRowBlock& b : spec.blocks) {
      s->pieces_[b.name].push_back({b.row, b.rows, from, &spec, b.step});
      from += b.rows;
    }
  }
  for (auto& [name, ps] : s->pieces_) std::sort(ps.begin(), ps.end(), [](const Piece& a, const Piece& b) { return a.row < b.row; });

  ckpt::TagDescription& L = s->layout_;
  L.grid = {1, 1, 1, false};
  L.stage_bounds = ckpt::StageBounds(f.layers, 1, {});
  L.format_from_manifest = true;
  s->params_ = ckpt::LogicalParameters(f, 1);
  for (const auto& p : s->params_)
    if (!s->pieces_.count(p.name)) throw Error(dir + ": nothing maps to " + p.name);  // a mapping bug, never input
  return s;
}

bool HfState::Has(const std::string& name, ckpt::StateField f) const {
  return f == ckpt::StateField::kParam && pieces_.count(name) > 0;
}

const ckpt::Value& HfState::Step(const std::string& name) const {
  throw Error(dir_ + ": a Hugging Face folder holds no optimizer state (asked for " + name + "'s step)");
}

namespace {

// dst[r * stride + c] = tile[c * pitch + r] for r < n, c < cols: a tile of source rows (each
// `pitch` elements, of which the first n are wanted) written as columns, in 32 x 32 blocks so both
// sides stay in cache.
template <typename T>
void TransposeTile(const uint8_t* tile, uint64_t pitch, uint64_t cols, uint64_t n, uint8_t* dst, uint64_t stride) {
  constexpr uint64_t kBlock = 32;
  const T* t = reinterpret_cast<const T*>(tile);
  for (uint64_t r0 = 0; r0 < n; r0 += kBlock)
    for (uint64_t c0 = 0; c0 < cols; c0 += kBlock)
      for (uint64_t r = r0; r < std::min(n, r0 + kBlock); ++r)
        for (uint64_t c = c0; c < std::min(cols, c0 + kBlock); ++c) std::memcpy(dst + (r * stride + c) * sizeof(T), t + c * pitch + r, sizeof(T));
}

// A pread of a cached page, with OpenFileCache's lookup, costs about as much as copying this many
// bytes more (measured on the 2-core VM: the 1B import's down_proj, 11 KiB rows cut in 352-byte
// pieces, took 12.2 s of CPU at 8 KiB, 7.3 s with its rows read whole at 16 KiB): a row piece comes
// from a band of whole rows, and a transpose reads whole source rows, when the rest of the row
// costs less than the calls saved.
constexpr uint64_t kPreadCostBytes = uint64_t{16} << 10;
// A thread keeps two bands (a Mixtral's w1 and w3 alternate row by row in gate_up_proj), together
// at most this, or the chunk's share of the budget for source bytes when that is less. 16 MiB a
// band holds an 8x7B expert's columns of one tp 8 rank whole (4096 x 1792 bf16, 14 MiB), whose
// transpose then reads whole source rows, 1 MiB a pread.
constexpr int kBands = 2;
constexpr uint64_t kMaxBandBytes = uint64_t{32} << 20;

// Rows [r0, r1), columns [c0, c1) of one spec's matrix, row-major; `owner` 0 while it holds nothing.
struct Band {
  uint64_t owner = 0;
  const HfTensorSpec* spec = nullptr;
  uint64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
  std::vector<uint8_t> bytes;  // grows to the largest band this thread read, at most kMaxBandBytes / kBands
  bool Holds(uint64_t who, const HfTensorSpec* s, uint64_t r, uint64_t n, uint64_t a, uint64_t b) const {
    return owner == who && spec == s && r0 <= r && r + n <= r1 && c0 <= a && b <= c1;
  }
};
struct ThreadBands {
  Band band[kBands];
  int next = 0;  // the one refilled next: the least recently used
};
thread_local ThreadBands thread_bands;

uint64_t BandBytes(const ckpt::Touched* touched) {
  return std::min(kMaxBandBytes, touched ? touched->limit() : ckpt::kMinStreamChunk);
}

}  // namespace

void HfState::ReadTransposedBlock(const HfTensorSpec& spec, uint64_t r0, uint64_t n, uint64_t c0, uint64_t c1, uint8_t* dst, uint64_t stride) const {
  // The matrix is the transpose of the source [width, rows]: its rows [r0, r0 + n) at columns [c0, c1)
  // are source rows c0..c1, elements [r0, r0 + n) of each, read a tile at a time (at most kTileBytes).
  constexpr uint64_t kTileBytes = 1 << 20;
  const Source& src = sources_.at(spec.name);
  const size_t es = ckpt::ElementSize(dtype_);
  const uint64_t rows = spec.numel() / static_cast<uint64_t>(spec.width);
  // Whole source rows, contiguous (one read a tile), when the rest of each row costs less than its own pread.
  const bool whole = (rows - n) * es <= kPreadCostBytes;
  const uint64_t pitch = whole ? rows : n, skip = whole ? r0 : 0, per_tile = std::max<uint64_t>(1, kTileBytes / (pitch * es));
  std::vector<uint8_t> tile(std::min(per_tile, c1 - c0) * pitch * es);
  for (uint64_t c = c0; c < c1; c += per_tile) {
    const uint64_t cols = std::min(per_tile, c1 - c);
    for (uint64_t i = 0; i < (whole ? 1 : cols); ++i) {
      const uint64_t at = ((c + i) * rows + (whole ? 0 : r0)) * es;
      const std::span<uint8_t> to(tile.data() + i * n * es, (whole ? cols * rows : n) * es);
      if (src.read_at) reads_->ReadAt(src.file->path(), src.offset + at, to);
      else std::memcpy(to.data(), src.data + at, to.size());
    }
    uint8_t* d = dst + (c - c0) * es;
    const uint8_t* t = tile.data() + skip * es;
    switch (es) {
      case 2: TransposeTile<uint16_t>(t, pitch, cols, n, d, stride); break;
      case 4: TransposeTile<uint32_t>(t, pitch, cols, n, d, stride); break;
      default: TransposeTile<uint64_t>(t, pitch, cols, n, d, stride); break;
    }
  }
}

bool HfState::ReadThroughBand(const HfTensorSpec& spec, uint64_t r, uint64_t n, uint64_t c0, uint64_t c1, uint8_t* dst, uint64_t stride,
                              uint64_t band_bytes) const {
  const Source& src = sources_.at(spec.name);
  const uint64_t es = ckpt::ElementSize(dtype_), width = static_cast<uint64_t>(spec.width), rows = spec.numel() / width;
  // An untransposed band is whole rows (one pread, mapped sources need none); a transposed one the request's columns.
  if (!spec.transpose && !src.read_at) return false;
  const uint64_t b0 = spec.transpose ? c0 : 0, b1 = spec.transpose ? c1 : width;
  const uint64_t capacity = band_bytes / kBands / ((b1 - b0) * es);
  if (capacity < 4 * n) return false;  // a band must serve several such reads to pay
  ThreadBands& bands = thread_bands;
  int at = 0;
  while (at < kBands && !bands.band[at].Holds(serial_, &spec, r, n, c0, c1)) ++at;
  if (at == kBands) {
    at = bands.next;
    Band& b = bands.band[at];
    b.owner = 0;  // a read that throws leaves it empty
    const uint64_t band_rows = std::min(capacity, rows - r);
    if (b.bytes.size() < band_rows * (b1 - b0) * es) b.bytes.resize(band_rows * (b1 - b0) * es);
    if (spec.transpose) ReadTransposedBlock(spec, r, band_rows, b0, b1, b.bytes.data(), b1 - b0);
    else reads_->ReadAt(src.file->path(), src.offset + r * width * es, {b.bytes.data(), band_rows * width * es});
    b.spec = &spec, b.r0 = r, b.r1 = r + band_rows, b.c0 = b0, b.c1 = b1, b.owner = serial_;
  }
  bands.next = (at + 1) % kBands;
  const Band& b = bands.band[at];
  for (uint64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * stride * es, b.bytes.data() + ((r - b.r0 + i) * (b.c1 - b.c0) + (c0 - b.c0)) * es, (c1 - c0) * es);
  return true;
}

void HfState::Read(const std::string& name, ckpt::StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched* touched) const {
  if (f != ckpt::StateField::kParam) throw Error(dir_ + ": a Hugging Face folder holds no optimizer state");
  const size_t es = ckpt::ElementSize(dtype_);
  const auto& ps = pieces_.at(name);
  const uint64_t width = static_cast<uint64_t>(ps.front().spec->width), end = begin + out.size() / es;
  std::memset(out.data(), 0, out.size());  // rows no piece holds: vocab padding
  const uint64_t band_bytes = BandBytes(touched);
  for (const Piece& p : ps) {
    if (p.spec->transpose) {
      ReadTransposed(p, begin, out, band_bytes);
      continue;
    }
    if (p.step != 1) throw Error(dir_ + ": tensor '" + p.spec->name + "' maps to every " + std::to_string(p.step) + "th row untransposed, which no model family has");
    const uint64_t lo = std::max(begin, static_cast<uint64_t>(p.row) * width),
                   hi = std::min(end, static_cast<uint64_t>(p.row + p.rows) * width);
    if (lo >= hi) continue;
    const uint64_t at = (static_cast<uint64_t>(p.from) * width + (lo - static_cast<uint64_t>(p.row) * width)) * es;
    const std::span<uint8_t> to = out.subspan((lo - begin) * es, (hi - lo) * es);
    const Source& src = sources_.at(p.spec->name);
    // A row piece (a column split) from a band of whole rows, when the rest of the row costs less than a pread.
    const uint64_t c0 = (lo - static_cast<uint64_t>(p.row) * width) % width;
    if (src.read_at && c0 + (hi - lo) <= width && (width - (hi - lo)) * es <= kPreadCostBytes &&
        ReadThroughBand(*p.spec, at / es / width, 1, c0, c0 + (hi - lo), to.data(), width, band_bytes))
      continue;
    if (src.read_at) {
      reads_->ReadAt(src.file->path(), src.offset + at, to);
      continue;
    }
    std::memcpy(to.data(), src.data + at, to.size());
    // The mapped input's pages are released once the chunk is written, so memory holds chunks, not the model.
    if (touched && src.file) touched->Add(src.file, src.data + at, to.size());
  }
}

void HfState::ReadTransposed(const Piece& p, uint64_t begin, std::span<uint8_t> out, uint64_t band_bytes) const {
  const size_t es = ckpt::ElementSize(dtype_);
  const uint64_t width = static_cast<uint64_t>(p.spec->width), end = begin + out.size() / es, step = static_cast<uint64_t>(p.step),
                 row = static_cast<uint64_t>(p.row), from = static_cast<uint64_t>(p.from);
  // The piece's rows k with row + k * step inside [begin, end) (by whole rows; the ends are clipped below).
  const uint64_t first_row = begin / width, last_row = (end + width - 1) / width;
  uint64_t k = first_row <= row ? 0 : (first_row - row + step - 1) / step;
  const uint64_t k_end = std::min<uint64_t>(p.rows, last_row <= row ? 0 : (last_row - row + step - 1) / step);
  while (k < k_end) {
    const uint64_t at = (row + k * step) * width, lo = std::max(begin, at), hi = std::min(end, at + width);
    uint64_t n = 1;  // a run of whole rows is one block; a clipped row (the range's ends) is one alone
    if (lo == at && hi == at + width)
      while (k + n < k_end && (row + (k + n) * step) * width + width <= end) ++n;
    uint8_t* dst = out.data() + (lo - begin) * es;
    if (!ReadThroughBand(*p.spec, from + k, n, lo - at, hi - at, dst, step * width, band_bytes))
      ReadTransposedBlock(*p.spec, from + k, n, lo - at, hi - at, dst, step * width);
    k += n;
  }
}

}  // namespace tools

namespace tools {

bool IsHfFolder(ckpt::Env* env, const std::string& path) {
  if (!env->IsDirectory(path) || !env->Exists(path + "/config.json")) return false;
  for (const char* weights : {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"})
    if (env->Exists(path + "/" + weights)) return true;
  return false;
}

ckpt::SourceKind HfSourceKind() {
  ckpt::SourceKind k;
  k.name = "hf";
  k.description = "a Hugging Face model folder (config.json and safetensors or pytorch_model.bin weights)";
  k.detect = IsHfFolder;
  k.open = [](ckpt::Env* env, const std::string& path, const ckpt::SourceOptions& o) {
    HfImportOptions hf;
    hf.make_vocab_size_divisible_by = o.hints.make_vocab_size_divisible_by.value_or(hf.make_vocab_size_divisible_by);
    hf.family = o.family;
    hf.fuse_qkv = o.hints.fuse_qkv.value_or(hf.fuse_qkv);
    hf.qkv_linear = o.hints.qkv_linear.value_or(hf.qkv_linear);
    hf.model_config = o.model_config;
    ckpt::OpenedSource s;
    s.state = HfState::Open(env, path, hf);
    if (!env->IsDirectory(path)) s.bytes = env->FileSize(path);
    else
      for (const auto& name : env->ListDir(path))
        if (!env->IsDirectory(path + "/" + name)) s.bytes += env->FileSize(path + "/" + name);
    return s;
  };
  return k;
}

}  // namespace tools
