#include "ckpt/shard/extent_index.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <numeric>
#include <stdexcept>

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

namespace {

// A rank by its ExtentIndex::HolderId: "tp rank 1", or "ep rank 1, tp rank 0" past ep rank 0.
std::string RankString(int id, int tp) {
  return id < tp ? "tp rank " + std::to_string(id) : "ep rank " + std::to_string(id / tp) + ", tp rank " + std::to_string(id % tp);
}
std::string HoldersString(int holder, int rank, int tp) {
  if (holder < tp && rank < tp) return "tp ranks " + std::to_string(holder) + " and " + std::to_string(rank);
  return RankString(holder, tp) + " and " + RankString(rank, tp);
}

using Entry = ExtentIndex::Entry;

std::vector<int64_t> EndOf(const SourceBox& b) {
  std::vector<int64_t> end(b.offset.size());
  for (size_t d = 0; d < end.size(); ++d) end[d] = b.offset[d] + b.size[d];
  return end;
}

bool Contains(const SourceBox& b, const std::vector<int64_t>& p) {
  for (size_t d = 0; d < p.size(); ++d)
    if (p[d] < b.offset[d] || p[d] >= b.offset[d] + b.size[d]) return false;
  return true;
}

// The slab of dim-0 index `row`, or -1.
int64_t SlabOf(const Entry& e, int64_t row) {
  const auto it = std::upper_bound(e.cuts.begin(), e.cuts.end(), row);
  const int64_t i = (it - e.cuts.begin()) - 1;
  return i >= 0 && i < static_cast<int64_t>(e.in_slab.size()) ? i : -1;
}

// The box holding point `p`, or null.
const SourceBox* Find(const Entry& e, const std::vector<int64_t>& p) {
  if (e.shape.empty()) return e.boxes.empty() ? nullptr : &e.boxes[0];
  const int64_t slab = SlabOf(e, p[0]);
  if (slab < 0) return nullptr;
  for (uint32_t i : e.in_slab[slab])
    if (Contains(e.boxes[i], p)) return &e.boxes[i];
  return nullptr;
}

// Elements from `p`, held by no box, before the next box along the innermost dimension (or the row's end).
int64_t GapFrom(const Entry& e, const std::vector<int64_t>& p) {
  if (e.shape.empty()) return 1;
  const size_t last = p.size() - 1;
  int64_t gap = e.shape[last] - p[last];
  const int64_t slab = SlabOf(e, p[0]);
  if (slab < 0) return gap;
  for (uint32_t i : e.in_slab[slab]) {
    const SourceBox& b = e.boxes[i];
    bool row = true;
    for (size_t d = 0; d < last && row; ++d) row = p[d] >= b.offset[d] && p[d] < b.offset[d] + b.size[d];
    if (row && b.offset[last] > p[last]) gap = std::min(gap, b.offset[last] - p[last]);
  }
  return gap;
}

// A copy of `n` elements, `stride` apart in the source, to `out`.
struct Piece {
  const MappedFile* file;
  const uint8_t* src;
  uint64_t n;
  int64_t stride;
  uint8_t* out;
};

// The pieces copying `n` elements of box `b` from `p` on, in the box's order, to `out`:
// as long runs as its storage lies contiguous (a transposed tensor's: an element at a time, strided).
void AddPieces(const SourceBox& b, const std::vector<int64_t>& from, uint64_t n, size_t es, uint8_t* out, std::vector<Piece>& pieces) {
  const size_t nd = from.size();
  thread_local std::vector<int64_t> p, storage;  // reused: a read of a row's piece allocates nothing
  p = from;
  // Storage that is row-major within the box reads as a box whose inner dimensions are whole.
  storage = b.size;
  for (size_t d = 1; d < nd; ++d)
    if (b.strides[d - 1] != b.strides[d] * b.size[d] || b.strides[nd - 1] != 1) storage[d] = b.size[d] + 1;
  while (n > 0) {
    int64_t at = 0;
    for (size_t d = 0; d < nd; ++d) at += (p[d] - b.offset[d]) * b.strides[d];
    const bool dense = nd == 0 || b.strides[nd - 1] == 1;
    const uint64_t run = nd == 0 ? 1 : dense ? RunInBox(b.offset, b.size, storage, p) : b.offset[nd - 1] + b.size[nd - 1] - p[nd - 1];
    const uint64_t take = std::min<uint64_t>(n, run);
    pieces.push_back({b.file, b.data + at * static_cast<int64_t>(es), take, dense ? 1 : b.strides[nd - 1], out});
    out += take * es, n -= take;
    if (n) AdvanceInBox(b.offset, b.size, p, static_cast<int64_t>(take));
  }
}

// Read-ahead for every piece of the range before copying any: pieces in many small files (xser
// has a file per tensor) are then read by the disk at once, not one fault after another.
// A source's pieces for successive rows lie one after another in its file, so they are asked
// for together (not a system call per row). Pieces further apart than a page stay separate.
struct Ahead {  // bytes [lo, hi) of `file`
  const MappedFile* file;
  const uint8_t *lo, *hi;
};

std::vector<Ahead> RunsAhead(const std::vector<Piece>& pieces, size_t es) {
  std::vector<Ahead> ahead;
  for (const Piece& p : pieces) {
    if (!p.file) continue;
    const uint8_t* to = p.src + ((p.n - 1) * p.stride + 1) * es;
    auto a = std::find_if(ahead.rbegin(), ahead.rend(), [&](const Ahead& x) { return x.file == p.file; });
    if (a != ahead.rend() && p.src >= a->hi && p.src - a->hi <= 4096) a->hi = to;
    else ahead.push_back({p.file, p.src, to});
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

void CopyPieces(std::span<const Piece> pieces, size_t es, Touched* touched) {
  for (const Piece& p : pieces) {
    if (p.stride == 1) {
      std::memcpy(p.out, p.src, p.n * es);
    } else {
      for (uint64_t i = 0; i < p.n; ++i) std::memcpy(p.out + i * es, p.src + i * p.stride * es, es);
    }
    if (touched && p.n) touched->Add(p.file, p.src, ((p.n - 1) * p.stride + 1) * es);
  }
}

// The pieces of mapped files are read with pread (ckpt/util/open_file_cache.h),
// not copied out of the mapping: its page faults and its release after each
// chunk (madvise, a TLB flush on every core) were a third of the 1B HF-style
// tag's reshard samples. A piece of 64 KiB or more is read straight into its
// place. Shorter ones (a column split is read a row at a time, a short piece
// from each of several files per Read) come from a thread's windows of 128 KiB
// of the files it read last, kept across Reads of the same index: a system
// call per piece cost more than the mapping did. The pieces are taken a file
// at a time (their order within a file kept): a row of a tensor split by
// columns over 32 files (Trn1 tp 32's o_proj) is 32 pieces in 32 files, and
// taken row after row they cycled through more files than a thread keeps
// windows for, so every piece cost a window's pread (2.6 million for the 1B
// HF-style tag's export, 38 s of CPU against 10). Others (memory, a
// transposed tensor's strided elements) are copied.
struct Window {
  std::weak_ptr<OpenFileCache> owner;  // the index's reads_: its control block names the index, even once freed
  const MappedFile* file = nullptr;
  uint64_t lo = 0;
  std::vector<uint8_t> bytes;
};

void ReadPieces(const std::vector<Piece>& pieces, size_t es, const std::shared_ptr<OpenFileCache>& reads, Touched* touched) {
  constexpr uint64_t kDirect = 64 << 10, kWindow = 128 << 10;
  thread_local std::array<Window, 8> windows;
  thread_local size_t next = 0;  // the window replaced next
  thread_local std::vector<uint32_t> order;
  order.resize(pieces.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return std::less<>()(pieces[a].file, pieces[b].file); });
  for (const uint32_t i : order) {
    const Piece& p = pieces[i];
    const uint64_t n = p.n * es;
    if (!p.file || !p.file->mapped() || p.stride != 1 || n == 0) {
      CopyPieces({&p, 1}, es, touched);
      continue;
    }
    const uint64_t at = static_cast<uint64_t>(p.src - p.file->data());
    if (n >= kDirect) {
      reads->ReadAt(p.file->path(), at, {p.out, n});
      continue;
    }
    auto w = std::find_if(windows.begin(), windows.end(), [&](const Window& x) {
      return x.file == p.file && !x.owner.owner_before(reads) && !reads.owner_before(x.owner) && at >= x.lo && at + n <= x.lo + x.bytes.size();
    });
    if (w == windows.end()) {
      w = windows.begin() + next;
      next = (next + 1) % windows.size();
      w->owner = reads, w->file = p.file, w->lo = at;
      w->bytes.resize(std::min<uint64_t>(kWindow, p.file->size() - at));
      reads->ReadAt(p.file->path(), at, w->bytes);
    }
    std::memcpy(p.out, w->bytes.data() + (at - w->lo), n);
  }
}

// Copies `pieces`, reading mapped files through `reads` when given.
void Copy(const std::vector<Piece>& pieces, size_t es, const std::shared_ptr<OpenFileCache>& reads, Touched* touched) {
  if (reads) ReadPieces(pieces, es, reads, touched);
  else CopyPieces(pieces, es, touched);
}

// The pieces reading flat elements [begin, begin + n) of `e` into `out`; what no box holds is zeroed now.
void PlanRead(const Entry& e, uint64_t begin, uint64_t n, uint8_t* out, std::vector<Piece>& pieces) {
  const size_t es = ElementSize(e.dtype);
  const uint64_t numel = static_cast<uint64_t>(ShapeNumel(e.shape));
  thread_local std::vector<int64_t> p;
  for (uint64_t at = begin, end = begin + n; at < end;) {
    uint8_t* o = out + (at - begin) * es;
    if (at >= numel) {
      std::memset(o, 0, (end - at) * es);
      break;
    }
    PointOf(static_cast<int64_t>(at), e.shape, p);
    const SourceBox* b = Find(e, p);
    const uint64_t take = std::min<uint64_t>(end - at, b ? RunInBox(b->offset, b->size, e.shape, p) : GapFrom(e, p));
    if (b) AddPieces(*b, p, take, es, o, pieces);
    else std::memset(o, 0, take * es);
    at += take;
  }
}

// The first flat element from `at` on that a box holds (`held`) or that none holds (!held), or numel.
uint64_t NextHeld(const Entry& e, uint64_t at, bool held) {
  const uint64_t numel = static_cast<uint64_t>(ShapeNumel(e.shape));
  std::vector<int64_t> p;
  while (at < numel) {
    PointOf(static_cast<int64_t>(at), e.shape, p);
    const SourceBox* b = Find(e, p);
    if ((b != nullptr) == held) return at;
    at += b ? RunInBox(b->offset, b->size, e.shape, p) : GapFrom(e, p);
  }
  return numel;
}

// The slabs of dim 0 every box's edges cut, and the boxes meeting each.
void BuildLookup(Entry& e) {
  e.cuts.clear(), e.in_slab.clear();
  if (e.shape.empty()) return;
  e.cuts = {0, e.shape[0]};
  for (const SourceBox& b : e.boxes) e.cuts.push_back(b.offset[0]), e.cuts.push_back(b.offset[0] + b.size[0]);
  std::sort(e.cuts.begin(), e.cuts.end());
  e.cuts.erase(std::unique(e.cuts.begin(), e.cuts.end()), e.cuts.end());
  e.in_slab.resize(e.cuts.size() - 1);
  for (uint32_t i = 0; i < e.boxes.size(); ++i) {
    const SourceBox& b = e.boxes[i];
    const auto first = std::lower_bound(e.cuts.begin(), e.cuts.end(), b.offset[0]) - e.cuts.begin();
    for (auto s = first; s + 1 < static_cast<int64_t>(e.cuts.size()) && e.cuts[s] < b.offset[0] + b.size[0]; ++s) e.in_slab[s].push_back(i);
  }
}

// The first element two boxes of one slab both hold, or -1: boxes that overlap share a slab.
int64_t FirstOverlap(const Entry& e) {
  for (const auto& slab : e.in_slab)
    for (size_t i = 0; i < slab.size(); ++i)
      for (size_t j = i + 1; j < slab.size(); ++j) {
        const SourceBox &a = e.boxes[slab[i]], &b = e.boxes[slab[j]];
        std::vector<int64_t> corner(e.shape.size());
        bool meet = true;
        for (size_t d = 0; d < corner.size() && meet; ++d) {
          corner[d] = std::max(a.offset[d], b.offset[d]);
          meet = corner[d] < std::min(a.offset[d] + a.size[d], b.offset[d] + b.size[d]);
        }
        if (meet) return FlatIndex(corner, e.shape);
      }
  return -1;
}

}  // namespace

void ExtentIndex::AddBoxes(const ParamRule& rule, const AxisCoords& at, StateField field, const Tensor& x, const MappedFile* file,
                           int64_t row_lo, int64_t row_hi, Holders& owner, DType dtype, const std::string& where) {
  auto& idx = index_[{rule.name, field}];
  if (!idx.typed) idx.dtype = dtype, idx.typed = true, idx.shape = rule.shape;
  if (dtype != idx.dtype) throw Error(where + " is " + std::string(DTypeName(dtype)) + " but other ranks hold " + std::string(DTypeName(idx.dtype)));
  const int rank = HolderId(at);
  const size_t es = ElementSize(dtype);
  for (const Box& box : LocalBoxes(rule, at)) {
    // Replicas (norms on every tp rank, KV heads NxD repeats) are read from
    // their first holder; the other copies are compared with it (CompareReplicas).
    const int holder = owner.try_emplace({rule.name, field, box.offset}, rank).first->second;
    SourceBox b{box.offset, box.size, x.strides(), x.data(), file};
    if (!box.offset.empty()) {  // the rows of the box this shard holds
      const int64_t lo = std::max(row_lo, box.local[0]), hi = std::min(row_hi, box.local[0] + box.size[0]);
      if (lo >= hi) continue;
      b.offset[0] += lo - box.local[0], b.size[0] = hi - lo;
      int64_t first = (lo - row_lo) * b.strides[0];
      for (size_t d = 1; d < box.local.size(); ++d) first += box.local[d] * b.strides[d];
      b.data += first * static_cast<int64_t>(es);
    }
    if (holder == rank) idx.boxes.push_back(std::move(b));
    else replicas_.push_back({rule.name, field, std::move(b), holder, rank, at[Axis::kTp].size});
  }
}

void ExtentIndex::CheckCovered(const std::string& dir, const std::vector<ParamRule>& params) {
  for (auto& [key, idx] : index_) {
    const std::string& name = key.name;  // a structured binding cannot be captured before C++20's P1091 (clang 16)
    auto rule = std::find_if(params.begin(), params.end(), [&](const ParamRule& p) { return p.name == name; });
    if (rule == params.end()) throw Error("no parameter " + key.name);
    if (idx.shape != rule->shape) throw Error(dir + ": " + key.name + " is indexed as " + ShapeString(idx.shape) + ", not " + ShapeString(rule->shape));
    BuildLookup(idx);
    const std::string what = dir + ": " + key.name + " (" + FieldName(key.field) + "): ";
    if (const int64_t twice = FirstOverlap(idx); twice >= 0)
      throw Error(what + "the rank files hold logical element " + std::to_string(twice) + " twice");
    const uint64_t numel = static_cast<uint64_t>(ShapeNumel(idx.shape));
    uint64_t held = 0;
    for (const SourceBox& b : idx.boxes) held += static_cast<uint64_t>(ShapeNumel(b.size));
    if (held == numel) continue;  // disjoint boxes of the tensor's volume cover it
    const uint64_t gap = NextHeld(idx, 0, false), next = NextHeld(idx, gap, true);
    if (next == numel) throw Error(what + "the rank files hold " + std::to_string(gap) + " of its " + std::to_string(numel) + " elements");
    throw Error(what + "the rank files do not cover elements " + std::to_string(gap) + ".." + std::to_string(next) + " of it");
  }
}

// Every replica equals its first holder's copy, byte for byte: NxD keeps
// replicated tensors equal (tp all-reduces their gradients; KV groups sum
// theirs, parallel_state.py arrange_kv_groups), so a difference is damage or
// a layout read under the wrong rule, and reading one copy would hide it.
void ExtentIndex::CompareReplicas(const std::string& dir, const ModelFormat& f) const {
  std::vector<uint8_t> want, got;
  std::vector<Piece> pieces;
  for (const Replica& r : replicas_) {
    const Entry& e = index_.at({r.name, r.field});
    const size_t es = ElementSize(e.dtype);
    const uint64_t volume = static_cast<uint64_t>(ShapeNumel(r.box.size));
    std::vector<int64_t> p = r.box.offset;
    for (uint64_t done = 0; done < volume;) {
      const uint64_t take = std::min<uint64_t>(RunInBox(r.box.offset, r.box.size, e.shape, p), (uint64_t{1} << 20) / es);
      want.resize(take * es), got.resize(take * es);
      Touched touched;
      Read(r.name, r.field, static_cast<uint64_t>(FlatIndex(p, e.shape)), want, &touched);
      pieces.clear();
      AddPieces(r.box, p, take, es, got.data(), pieces);
      Copy(pieces, es, reads_, &touched);
      if (want != got) {
        const std::string rule = f.kv_size_multiplier > 1 ? std::string(" under kv_size_multiplier ") + std::to_string(f.kv_size_multiplier) +
                                                                " (" + BackendName(f.hw_backend) + ")"
                                                          : "";
        std::vector<int64_t> last = EndOf(r.box);
        for (auto& x : last) --x;
        throw Error(dir + ": '" + r.name + "' (" + FieldName(r.field) + "): " + HoldersString(r.holder, r.rank, r.tp) + " hold different copies of logical elements " + std::to_string(FlatIndex(r.box.offset, e.shape)) +
                    ".." + std::to_string(FlatIndex(last, e.shape)) + ", which both replicate" + rule +
                    " (NxD keeps replicas equal); --trust_first_replica reads " + RankString(r.holder, r.tp) + "'s");
      }
      done += take;
      AdvanceInBox(r.box.offset, r.box.size, p, static_cast<int64_t>(take));
    }
  }
}

bool ExtentIndex::FindDType(const std::string& name, StateField f, DType* dtype) const {
  auto it = index_.find({name, f});
  if (it == index_.end()) return false;
  *dtype = it->second.dtype;
  return true;
}

size_t ExtentIndex::BoxCount(const std::string& name, StateField f) const {
  auto it = index_.find({name, f});
  return it == index_.end() ? 0 : it->second.boxes.size();
}

void ExtentIndex::Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const {
  const Entry& idx = index_.at({name, f});
  if (!idx.shape.empty() && idx.cuts.empty()) throw std::logic_error("ExtentIndex::Read before CheckCovered built the lookup of " + name);
  const size_t es = ElementSize(idx.dtype);
  thread_local std::vector<Piece> pieces;
  pieces.clear();
  PlanRead(idx, begin, out.size() / es, out.data(), pieces);
  PrefetchRuns(RunsAhead(pieces, es), out.size());
  Copy(pieces, es, reads_, touched);
}

}  // namespace ckpt
