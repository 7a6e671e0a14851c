#include "ckpt/shard/extent_index.h"

#include <algorithm>
#include <cstring>

#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/util/env.h"
#include "ckpt/util/error.h"

namespace ckpt {

const Tensor& IndexableTensor(const Value& v, const std::string& where) {
  if (!v.is_tensor()) throw Error(where + " is a " + v.kind_name() + ", not a tensor");
  // NxD's converter saves o_proj transposed (a clone of a transpose keeps its strides): 1-D and 2-D views of any strides are read.
  if (!v.as_tensor().is_contiguous() && v.as_tensor().dim() > 2)
    throw Error(where + " is a strided view of " + std::to_string(v.as_tensor().dim()) + " dimensions; only 1-D and 2-D ones are read");
  return v.as_tensor();
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

void TensorExtent::CopyOut(uint64_t from, uint64_t n, size_t es, uint8_t* out, Touched* touched) const {
  const uint8_t* src = data + from * stride * es;
  if (stride == 1) {
    std::memcpy(out, src, n * es);
  } else {
    for (uint64_t i = 0; i < n; ++i) std::memcpy(out + i * es, src + i * stride * es, es);
  }
  if (touched && n) touched->Add(file, src, ((n - 1) * stride + 1) * es);
}

void ExtentIndex::AddRuns(const ParamRule& rule, const ModelFormat& format, int tp, StateField field, int t, const Tensor& x,
                          const MappedFile* file, int64_t row_lo, int64_t row_hi, int64_t rows, Holders& owner, DType dtype,
                          const std::string& where) {
  auto& idx = index_[{rule.name, field}];
  if (!idx.typed) idx.dtype = dtype, idx.typed = true;
  if (dtype != idx.dtype) throw Error(where + " is " + std::string(DTypeName(dtype)) + " but other ranks hold " + std::string(DTypeName(idx.dtype)));
  row_hi = std::min(row_hi, rows);
  if (row_hi <= row_lo) return;
  const auto local = LocalShape(rule, format, tp, t);
  const int64_t inner = ShapeNumel(local) / local[0];
  const size_t es = ElementSize(dtype);
  const uint8_t* data = x.data();
  const bool dense = x.is_contiguous();
  const int64_t s0 = x.dim() > 0 ? x.strides()[0] : 1, s1 = x.dim() > 1 ? x.strides()[1] : 1;  // strided x only
  for (const Run& run : LocalRuns(rule, format, tp, t)) {
    // Replicas (norms on every tp rank, KV heads NxD repeats) are read from
    // their first holder; the other copies are compared with it (CompareReplicas).
    const int holder = owner.try_emplace({rule.name, field, run.logical}, t).first->second;
    auto add = [&](const TensorExtent& e) {
      if (holder == t) idx.extents.push_back(e);
      else replicas_.push_back({rule.name, field, e, holder, t});
    };
    // Local row r's elements [c, c + n) hold logical elements from `logical`.
    auto add_row = [&](int64_t r, int64_t c, int64_t n, int64_t logical) {
      const int64_t at = dense ? (r - row_lo) * inner + c : (r - row_lo) * s0 + c * s1;
      add({static_cast<uint64_t>(logical), static_cast<uint64_t>(logical + n), data + at * es, file, dense ? 1 : s1});
    };
    if (rule.split == SplitDim::kColumns) {  // each local row holds `run.count` columns from local column run.local
      const int64_t width = rule.shape[1];
      for (int64_t r = row_lo; r < row_hi; ++r) add_row(r, run.local, run.count, r * width + run.logical);
      continue;
    }
    const int64_t lo = std::max(row_lo, run.local), hi = std::min(row_hi, run.local + run.count);
    if (lo >= hi) continue;
    const int64_t g = run.logical + (lo - run.local);
    if (dense) {
      add({static_cast<uint64_t>(g * inner), static_cast<uint64_t>((g + hi - lo) * inner), data + (lo - row_lo) * inner * es, file, 1});
      continue;
    }
    for (int64_t r = lo; r < hi; ++r) add_row(r, 0, inner, (g + r - lo) * inner);
  }
}

void ExtentIndex::CheckCovered(const std::string& dir, const std::vector<ParamRule>& params) {
  auto rule = [&](const std::string& name) -> const ParamRule& {
    for (const auto& p : params)
      if (p.name == name) return p;
    throw Error("no parameter " + name);
  };
  for (auto& [key, idx] : index_) {
    std::sort(idx.extents.begin(), idx.extents.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    uint64_t at = 0;
    for (const auto& e : idx.extents) {
      if (e.begin != at) throw Error(dir + ": " + key.name + " (" + FieldName(key.field) + "): the rank files do not cover elements " +
                                     std::to_string(at) + ".." + std::to_string(e.begin) + " of it");
      at = e.end;
    }
    const uint64_t numel = static_cast<uint64_t>(ShapeNumel(rule(key.name).shape));
    if (at != numel)
      throw Error(dir + ": " + key.name + " (" + FieldName(key.field) + "): the rank files hold " + std::to_string(at) + " of its " +
                  std::to_string(numel) + " elements");
  }
}

// Every replica equals its first holder's copy, byte for byte: NxD keeps
// replicated tensors equal (tp all-reduces their gradients; KV groups sum
// theirs, parallel_state.py arrange_kv_groups), so a difference is damage or
// a layout read under the wrong rule, and reading one copy would hide it.
void ExtentIndex::CompareReplicas(const std::string& dir, const ModelFormat& f) const {
  std::vector<uint8_t> want, got;
  for (const Replica& r : replicas_) {
    const size_t es = ElementSize(index_.at({r.name, r.field}).dtype);
    const uint64_t n = r.extent.end - r.extent.begin;
    for (uint64_t at = 0; at < n;) {
      const uint64_t take = std::min<uint64_t>(n - at, (uint64_t{1} << 20) / es);
      want.resize(take * es);
      Touched touched;
      Read(r.name, r.field, r.extent.begin + at, want, &touched);
      got.resize(take * es);
      r.extent.CopyOut(at, take, es, got.data(), &touched);
      if (want != got) {
        const std::string rule = f.kv_size_multiplier > 1 ? std::string(" under kv_size_multiplier ") + std::to_string(f.kv_size_multiplier) +
                                                                " (" + BackendName(f.hw_backend) + ")"
                                                          : "";
        throw Error(dir + ": '" + r.name + "' (" + FieldName(r.field) + "): tp ranks " + std::to_string(r.holder) + " and " +
                    std::to_string(r.rank) + " hold different copies of logical elements " + std::to_string(r.extent.begin) + ".." +
                    std::to_string(r.extent.end - 1) + ", which both replicate" + rule +
                    " (NxD keeps replicas equal); --trust_first_replica reads tp rank " + std::to_string(r.holder) + "'s");
      }
      at += take;
    }
  }
}

bool ExtentIndex::FindDType(const std::string& name, StateField f, DType* dtype) const {
  auto it = index_.find({name, f});
  if (it == index_.end()) return false;
  *dtype = it->second.dtype;
  return true;
}

namespace {

struct Ahead {  // bytes [lo, hi) of `file`
  const MappedFile* file;
  const uint8_t *lo, *hi;
};

// Read-ahead for every run of the range before copying any: runs in many small files (xser
// has a file per tensor) are then read by the disk at once, not one fault after another.
// A range across a split dimension touches one run per row and source; a
// source's runs for successive rows lie one after another in its file, so
// they are asked for together (not a system call per row). Runs further
// apart than a page stay separate: the gap is not read.
template <typename It>
std::vector<Ahead> RunsAhead(It it, It last, uint64_t begin, uint64_t end, size_t es) {
  std::vector<Ahead> ahead;
  for (auto p = it; p != last && p->begin < end; ++p) {
    const uint64_t lo = std::max(begin, p->begin), hi = std::min(end, p->end);
    if (!p->file || lo >= hi) continue;
    const uint8_t* from = p->data + (lo - p->begin) * p->stride * es;
    const uint8_t* to = from + ((hi - lo - 1) * p->stride + 1) * es;
    auto a = std::find_if(ahead.rbegin(), ahead.rend(), [&](const Ahead& x) { return x.file == p->file; });
    if (a != ahead.rend() && from >= a->hi && from - a->hi <= 4096) a->hi = to;
    else ahead.push_back({p->file, from, to});
  }
  return ahead;
}

// Small reads (a row's pieces of a column split, read row by row) ask for
// a window of 2 MiB ahead in their file once, and the rows after it come
// from that window: a system call per row would cost more than it saves.
void PrefetchRuns(const std::vector<Ahead>& ahead, uint64_t bytes) {
  constexpr uint64_t kSmall = 256 << 10, kWindow = 2 << 20;
  thread_local std::vector<Ahead> windows;  // this thread's recent windows (a hint: a stale one costs a fault)
  for (const Ahead& a : ahead) {
    if (bytes >= kSmall) {
      a.file->Prefetch(a.lo, static_cast<size_t>(a.hi - a.lo));
      continue;
    }
    auto w = std::find_if(windows.begin(), windows.end(), [&](const Ahead& x) { return x.file == a.file && a.lo >= x.lo && a.hi <= x.hi; });
    if (w != windows.end()) continue;
    const uint8_t* hi = std::min(a.file->data() + a.file->size(), std::max(a.hi, a.lo + kWindow));
    a.file->Prefetch(a.lo, static_cast<size_t>(hi - a.lo));
    if (windows.size() >= 8) windows.erase(windows.begin());
    windows.push_back({a.file, a.lo, hi});
  }
}

}  // namespace

void ExtentIndex::Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const {
  const Entry& idx = index_.at({name, f});
  const size_t es = ElementSize(idx.dtype);
  const uint64_t end = begin + out.size() / es;
  auto it = std::upper_bound(idx.extents.begin(), idx.extents.end(), begin, [](uint64_t b, const TensorExtent& e) { return b < e.end; });
  PrefetchRuns(RunsAhead(it, idx.extents.end(), begin, end, es), (end - begin) * es);
  uint64_t at = begin;
  for (; at < end && it != idx.extents.end(); ++it) {
    const uint64_t lo = std::max(at, it->begin), hi = std::min(end, it->end);
    if (lo >= hi) break;
    if (lo > at) std::memset(out.data() + (at - begin) * es, 0, (lo - at) * es);
    it->CopyOut(lo - it->begin, hi - lo, es, out.data() + (lo - begin) * es, touched);
    at = hi;
  }
  if (at < end) std::memset(out.data() + (at - begin) * es, 0, (end - at) * es);
}

}  // namespace ckpt
