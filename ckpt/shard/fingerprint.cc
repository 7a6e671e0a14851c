#include "ckpt/shard/fingerprint.h"

#include <iterator>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

constexpr StateField kFields[] = {StateField::kParam, StateField::kExpAvg, StateField::kExpAvgSq, StateField::kMaster};

std::string KeyOf(const std::string& name, StateField f) { return name + "\t" + FieldName(f); }

std::string Describe(const std::string& key) {
  const size_t tab = key.find('\t');
  return key.substr(0, tab) + " " + key.substr(tab + 1);
}

}  // namespace

std::vector<LogicalTensor> LogicalTensors(const LogicalState& tag) {
  std::vector<LogicalTensor> out;
  for (const ParamRule& p : tag.params()) {
    std::vector<int64_t> shape = p.shape;
    if (p.vocab) shape[0] = tag.layout().format.vocab_size;  // rows past it are padding, which layouts pad differently
    for (StateField f : kFields)
      if (tag.Has(p.name, f)) out.push_back({p.name, f, tag.dtype(p.name, f), static_cast<uint64_t>(ShapeNumel(shape))});
  }
  return out;
}

void FingerprintCollector::AddPiece(Pieces& pieces, const std::string& key, uint64_t begin, uint64_t end, uint32_t crc) {
  auto next = pieces.upper_bound(begin);
  auto prev = next == pieces.begin() ? pieces.end() : std::prev(next);
  if ((prev != pieces.end() && prev->second.end > begin) || (next != pieces.end() && next->first < end)) {
    if (error_.empty())
      error_ = Describe(key) + ": bytes " + std::to_string(begin) + ".." + std::to_string(end) + " were written twice";
    return;
  }
  if (prev != pieces.end() && prev->second.end == begin) {
    crc = Crc32Combine(prev->second.crc, crc, end - begin);
    begin = prev->first;
    pieces.erase(prev);
  }
  if (next != pieces.end() && next->first == end) {
    crc = Crc32Combine(crc, next->second.crc, next->second.end - next->first);
    end = next->second.end;
    pieces.erase(next);
  }
  pieces[begin] = {end, crc};
}

void FingerprintCollector::Add(const std::string& name, StateField field, uint64_t byte_begin, std::span<const uint8_t> bytes) {
  if (bytes.empty()) return;
  const uint32_t crc = Crc32(bytes);  // outside the lock
  const std::string key = KeyOf(name, field);
  std::lock_guard<std::mutex> lock(mu_);
  AddPiece(pieces_[key], key, byte_begin, byte_begin + bytes.size(), crc);
}

nlohmann::json FingerprintCollector::ToJson() const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, pieces] : pieces_) {
    const size_t tab = key.find('\t');
    nlohmann::json& list = j[key.substr(0, tab)][key.substr(tab + 1)];
    list = nlohmann::json::array();
    for (const auto& [begin, p] : pieces) list.push_back({begin, p.end, CrcHex(p.crc)});
  }
  if (!error_.empty()) j = {{"error", error_}};
  return j;
}

void FingerprintCollector::MergeJson(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw Error(where + ": fingerprint pieces are not an object");
  std::lock_guard<std::mutex> lock(mu_);
  if (j.contains("error") && j["error"].is_string()) {
    if (error_.empty()) error_ = j["error"].get<std::string>();
    return;
  }
  for (const auto& [name, fields] : j.items()) {
    if (!fields.is_object()) throw Error(where + ": fingerprint pieces of '" + name + "' are not an object");
    for (const auto& [field, list] : fields.items()) {
      const std::string key = name + "\t" + field;
      if (!list.is_array()) throw Error(where + ": fingerprint pieces of " + Describe(key) + " are not a list");
      for (const auto& p : list) {
        const bool ok = p.is_array() && p.size() == 3 && p[0].is_number_unsigned() && p[1].is_number_unsigned() && p[2].is_string() &&
                        p[0].get<uint64_t>() < p[1].get<uint64_t>();
        if (!ok) throw Error(where + ": malformed fingerprint piece " + p.dump() + " of " + Describe(key));
        const FileDigest d = DigestFromJson({{"size", 0}, {"crc32", p[2]}}, where + ": " + Describe(key));
        AddPiece(pieces_[key], key, p[0].get<uint64_t>(), p[1].get<uint64_t>(), d.crc32);
      }
    }
  }
}

TensorFingerprints FingerprintCollector::Finish(const std::vector<LogicalTensor>& tensors) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.empty()) throw Error("fingerprints: " + error_);
  TensorFingerprints out;
  size_t matched = 0;
  for (const LogicalTensor& t : tensors) {
    const std::string key = KeyOf(t.name, t.field);
    const uint64_t bytes = t.numel * ElementSize(t.dtype);
    const auto it = pieces_.find(key);
    uint32_t crc = 0;
    if (it != pieces_.end()) {
      ++matched;
      const Pieces& p = it->second;
      if (p.size() != 1 || p.begin()->first != 0 || p.begin()->second.end != bytes) {
        std::string held;
        for (const auto& [b, x] : p) held += (held.empty() ? "" : ", ") + std::to_string(b) + ".." + std::to_string(x.end);
        throw Error("fingerprints: " + Describe(key) + ": the pieces written cover bytes " + held + ", not exactly 0.." +
                    std::to_string(bytes));
      }
      crc = p.begin()->second.crc;
    } else if (bytes != 0) {
      throw Error("fingerprints: " + Describe(key) + ": no piece of it was written");
    }
    out[t.name][FieldName(t.field)] = {std::string(DTypeName(t.dtype)), t.numel, crc};
  }
  if (matched != pieces_.size())
    for (const auto& [key, p] : pieces_) {
      const size_t tab = key.find('\t');
      const auto f = out.find(key.substr(0, tab));
      if (f == out.end() || !f->second.count(key.substr(tab + 1)))
        throw Error("fingerprints: pieces of " + Describe(key) + ", which is not a tensor of this checkpoint");
    }
  return out;
}

TensorFingerprints ComputeFingerprints(const LogicalState& tag, size_t chunk, std::optional<StateField> only) {
  TensorFingerprints out;
  std::vector<uint8_t> buf(chunk);
  for (const LogicalTensor& t : LogicalTensors(tag)) {
    if (only && t.field != *only) continue;
    const size_t es = ElementSize(t.dtype), per = chunk / es;
    uint32_t crc = 0;
    for (uint64_t at = 0; at < t.numel;) {
      const uint64_t n = std::min<uint64_t>(per, t.numel - at);
      Touched touched;
      tag.Read(t.name, t.field, at, {buf.data(), n * es}, &touched);
      crc = Crc32Combine(crc, Crc32({buf.data(), n * es}), n * es);
      at += n;
    }
    out[t.name][FieldName(t.field)] = {std::string(DTypeName(t.dtype)), t.numel, crc};
  }
  return out;
}

std::vector<FingerprintMismatch> RecordedMismatches(const TensorFingerprints& recorded, const TensorFingerprints& computed) {
  std::vector<FingerprintMismatch> out;
  for (const auto& [name, fields] : computed) {
    const auto n = recorded.find(name);
    if (n == recorded.end()) continue;
    for (const auto& [field, got] : fields)
      if (const auto f = n->second.find(field); f != n->second.end() && !(f->second == got)) out.push_back({name, field, f->second, got});
  }
  return out;
}

void CheckRecordedFingerprints(const LogicalState& tag, size_t chunk, std::optional<StateField> only) {
  if (tag.recorded_fingerprints()) CheckRecordedFingerprints(tag, ComputeFingerprints(tag, chunk, only));
}

void CheckRecordedFingerprints(const LogicalState& tag, const TensorFingerprints& computed) {
  if (!tag.recorded_fingerprints()) return;
  const auto bad = RecordedMismatches(*tag.recorded_fingerprints(), computed);
  if (!bad.empty())
    throw Error(tag.path() + ": " + bad[0].tensor + " " + bad[0].field + " reads with fingerprint " + CrcHex(bad[0].computed.crc32) +
                ", but its manifest records " + CrcHex(bad[0].recorded.crc32) + ": its data changed since it was written");
}

}  // namespace ckpt
