#include "tools/h5_state.h"

#include <sys/stat.h>

#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "ckpt/util/crc32.h"
#include "ckpt/pt/dtype_cast.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/util/hdf5_lock.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/pt/pickle_reader.h"
#include "ckpt/pt/pickle_writer.h"
#include "ckpt/pt/value_json.h"

namespace tools {
namespace {

using ckpt::DType;
using ckpt::Error;
using ckpt::StateField;

// An HDF5 handle closed when it goes out of scope.
class Hid {
 public:
  Hid(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  ~Hid() {
    if (id_ >= 0) close_(id_);
  }
  operator hid_t() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

void Check(herr_t status, const std::string& what) {
  if (status < 0) throw Error(what);
}

Hid StringType() {
  Hid t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, H5T_VARIABLE);
  H5Tset_cset(t, H5T_CSET_UTF8);
  return t;
}

void SetString(hid_t obj, const char* name, const std::string& value, const std::string& where) {
  const Hid type = StringType();
  const Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  const Hid attr(H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  const char* p = value.c_str();
  Check(attr.ok() ? H5Awrite(attr, type, &p) : -1, where + ": cannot write attribute " + name);
}

template <typename T>
void SetNumber(hid_t obj, const char* name, T value, hid_t file_type, hid_t mem_type, const std::string& where) {
  const Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  const Hid attr(H5Acreate2(obj, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  Check(attr.ok() ? H5Awrite(attr, mem_type, &value) : -1, where + ": cannot write attribute " + name);
}
void SetInt(hid_t obj, const char* name, int64_t v, const std::string& where) {
  SetNumber(obj, name, v, H5T_STD_I64LE, H5T_NATIVE_INT64, where);
}
void SetDouble(hid_t obj, const char* name, double v, const std::string& where) {
  SetNumber(obj, name, v, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, where);
}

std::string GetString(hid_t obj, const char* name, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) throw Error(where + ": has no attribute '" + name + "'");
  const Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  const Hid ftype(H5Aget_type(attr), H5Tclose);
  if (H5Tget_class(ftype) != H5T_STRING || H5Tis_variable_str(ftype) <= 0)
    throw Error(where + ": attribute '" + name + "' is not a string");
  const Hid type = StringType();
  char* p = nullptr;
  Check(H5Aread(attr, type, &p), where + ": cannot read attribute '" + name + "'");
  std::string out = p ? p : "";
  H5free_memory(p);
  return out;
}

template <typename T>
T GetNumber(hid_t obj, const char* name, hid_t mem_type, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) throw Error(where + ": has no attribute '" + name + "'");
  const Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  const Hid space(H5Aget_space(attr), H5Sclose);
  const Hid ftype(H5Aget_type(attr), H5Tclose);
  const H5T_class_t cls = H5Tget_class(ftype);
  if (H5Sget_simple_extent_npoints(space) != 1 || (cls != H5T_INTEGER && cls != H5T_FLOAT))
    throw Error(where + ": attribute '" + name + "' is not a number");
  T v{};
  Check(H5Aread(attr, mem_type, &v), where + ": cannot read attribute '" + name + "'");
  return v;
}
int64_t GetInt(hid_t obj, const char* name, const std::string& where) { return GetNumber<int64_t>(obj, name, H5T_NATIVE_INT64, where); }
double GetDouble(hid_t obj, const char* name, const std::string& where) { return GetNumber<double>(obj, name, H5T_NATIVE_DOUBLE, where); }

// An opaque byte string (a pickle) as a 1-D uint8 attribute.
void SetBytes(hid_t obj, const char* name, const std::string& bytes, const std::string& where) {
  const hsize_t n[1] = {std::max<hsize_t>(bytes.size(), 1)};
  const Hid space(H5Screate_simple(1, n, nullptr), H5Sclose);
  const Hid attr(H5Acreate2(obj, name, H5T_STD_U8LE, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  std::string data = bytes.empty() ? std::string(1, '\0') : bytes;
  Check(attr.ok() ? H5Awrite(attr, H5T_NATIVE_UINT8, data.data()) : -1, where + ": cannot write attribute " + name);
}

std::string GetBytes(hid_t obj, const char* name, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) throw Error(where + ": has no attribute '" + name + "'");
  const Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  const Hid space(H5Aget_space(attr), H5Sclose);
  const Hid ftype(H5Aget_type(attr), H5Tclose);
  if (H5Tget_class(ftype) != H5T_INTEGER || H5Tget_size(ftype) != 1 || H5Sget_simple_extent_ndims(space) != 1)
    throw Error(where + ": attribute '" + name + "' is not a byte string");
  std::string out(static_cast<size_t>(H5Sget_simple_extent_npoints(space)), '\0');
  Check(H5Aread(attr, H5T_NATIVE_UINT8, out.data()), where + ": cannot read attribute '" + name + "'");
  return out;
}

nlohmann::json ParseJson(const std::string& text, const std::string& where) {
  nlohmann::json j = ckpt::ParseJsonBounded(text, where);
  if (j.is_discarded()) throw Error(where + ": is not valid JSON");
  return j;
}

// HDF5 opens the file itself, not through Env: a FIFO would block it forever.
bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void RequireRegularFile(const std::string& path) {
  if (!IsRegularFile(path))
    throw Error(path + ": is not a regular file (a FIFO, socket, device or folder), or cannot be read; refusing to read it");
}

// An export holds its data in itself. External links, external raw storage
// and virtual datasets all make HDF5 open other files, which an import
// refuses: nothing outside the file the user named is read.
herr_t RefuseExternalLink(hid_t, const char* name, const H5L_info_t* info, void* out) {
  if (info->type == H5L_TYPE_HARD || info->type == H5L_TYPE_SOFT) return 0;
  *static_cast<std::string*>(out) = name;
  return 1;  // stop: found one
}

void RequireNoLinksOut(hid_t file, const std::string& path) {
  std::string link;
  if (H5Lvisit(file, H5_INDEX_NAME, H5_ITER_NATIVE, RefuseExternalLink, &link) < 0)
    throw Error(path + ": cannot walk the file's links");
  if (!link.empty())
    throw Error(path + ": /" + link + " is an external link to another file; an export holds its data in itself, and "
                "nothing outside the file you named is opened");
}

void RequireDataInFile(hid_t ds, const std::string& where) {
  const Hid dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!dcpl.ok()) throw Error(where + ": cannot read its storage properties");
  if (H5Pget_layout(dcpl) == H5D_VIRTUAL)
    throw Error(where + ": is a virtual dataset (its data lives in other files), which an import does not follow");
  if (H5Pget_external_count(dcpl) != 0)
    throw Error(where + ": keeps its data in external files, which an import does not follow");
}

// The HDF5 type a tensor of `d` is stored as (16-bit floats as their bits).
hid_t FileType(DType d, const std::string& where) {
  switch (d) {
    case DType::kFloat32: return H5T_IEEE_F32LE;
    case DType::kFloat64: return H5T_IEEE_F64LE;
    case DType::kBFloat16:
    case DType::kFloat16: return H5T_STD_U16LE;
    default: throw Error(where + ": a " + std::string(ckpt::DTypeName(d)) + " tensor, which the HDF5 export does not hold");
  }
}
hid_t MemType(DType d) {
  switch (d) {
    case DType::kFloat32: return H5T_NATIVE_FLOAT;
    case DType::kFloat64: return H5T_NATIVE_DOUBLE;
    default: return H5T_NATIVE_UINT16;
  }
}

// 16-bit floats as float32 (exact), and back (exact for values that came from them).
void Widen(DType from, const uint8_t* in, size_t n, float* out) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(in);
  if (from == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) out[i] = ckpt::BFloat16ToFloat(p[i]);
  } else {
    ckpt::Tensor src = ckpt::Tensor::Zeros(DType::kFloat16, {static_cast<int64_t>(n)});
    std::memcpy(src.mutable_data(), in, n * 2);
    const ckpt::Tensor f = ckpt::CastTensor(src, DType::kFloat32);
    std::memcpy(out, f.data(), n * 4);
  }
}
void Narrow(DType to, const float* in, size_t n, uint8_t* out) {
  uint16_t* p = reinterpret_cast<uint16_t*>(out);
  if (to == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) p[i] = ckpt::FloatToBFloat16(in[i]);
  } else {
    ckpt::Tensor src = ckpt::Tensor::Zeros(DType::kFloat32, {static_cast<int64_t>(n)});
    std::memcpy(src.mutable_data(), in, n * 4);
    const ckpt::Tensor h = ckpt::CastTensor(src, DType::kFloat16);
    std::memcpy(out, h.data(), n * 2);
  }
}

std::string DatasetPath(const std::string& name, StateField f) {
  return f == StateField::kParam ? "/model/" + name : "/optim/" + name + "/" + ckpt::FieldName(f);
}

// Logical elements [begin, begin + n) of a [rows, width] dataset as at most
// three rectangles (a partial first row, whole rows, a partial last row):
// fn(row, col, rows, cols, elements before it). Each is read or written with
// a memory space of its own shape, which HDF5 copies chunk by chunk; a 1-D
// memory space against a 2-D selection makes it map element by element.
template <typename F>
void ForEachRect(int64_t width, uint64_t begin, uint64_t n, const F& fn) {
  const uint64_t w = static_cast<uint64_t>(width), end = begin + n;
  uint64_t done = 0;
  auto rect = [&](uint64_t row, uint64_t col, uint64_t rows, uint64_t cols) {
    if (!rows || !cols) return;
    fn(row, col, rows, cols, done);
    done += rows * cols;
  };
  const uint64_t r0 = begin / w, c0 = begin % w, r1 = end / w, c1 = end % w;
  if (r0 == r1) return rect(r0, c0, 1, c1 - c0);
  uint64_t full_from = r0;
  if (c0) rect(r0, c0, 1, w - c0), full_from = r0 + 1;
  rect(full_from, 0, r1 - full_from, w);
  rect(r1, 0, 1, c1);
}

// One rectangle of a dataset (rank 1: `cols` is 1 and rows are elements)
// with its matching memory space.
struct Rect {
  Hid file, mem;
};
Rect Select(hid_t dataset, int rank, uint64_t row, uint64_t col, uint64_t rows, uint64_t cols) {
  const hsize_t start[2] = {row, col}, count[2] = {rows, cols};
  Hid file(H5Dget_space(dataset), H5Sclose);
  H5Sselect_hyperslab(file, H5S_SELECT_SET, start, nullptr, count, nullptr);
  return Rect{std::move(file), Hid(H5Screate_simple(rank, count, nullptr), H5Sclose)};
}

}  // namespace

ExportSummary WriteH5State(const ckpt::LogicalState& src, const std::string& tag_name, const std::string& path,
                           const ExportOptions& o) {
  std::lock_guard<std::mutex> lock(ckpt::Hdf5Lock());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  const ckpt::TagDescription& L = src.layout();
  const ckpt::ModelFormat& format = L.format;
  const bool optimizer = L.has_optimizer && !o.weights_only;

  const Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_LATEST);  // attributes past 64 KiB (dense storage)
  const Hid file(H5Fcreate(path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl), H5Fclose);
  if (!file.ok()) throw Error(path + ": cannot create the HDF5 file");
  const Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl, 1);

  // Root attributes.
  SetString(file, "format", kH5Format, path);
  SetInt(file, "version", kH5Version, path);
  SetString(file, "model", format.ToJson().dump(), path);
  nlohmann::ordered_json sl = {{"tp", L.grid.tp},           {"pp", L.grid.pp},
                               {"dp", L.grid.dp},           {"zero1", L.grid.zero1},
                               {"stage_bounds", L.stage_bounds}, {"has_optimizer", optimizer},
                               {"grouping", ckpt::GroupingRuleName(L.grouping)},  {"master_weights", optimizer && L.master_weights}};
  if (L.virtual_stages > 1) sl["virtual_stages"] = L.virtual_stages;  // stage_bounds cover pp * virtual_stages stages
  SetString(file, "source_layout", sl.dump(), path);
  SetString(file, "source", src.path(), path);
  SetString(file, "tag_name", tag_name, path);
  SetInt(file, "step", src.step(), path);
  SetDouble(file, "consumed_samples", src.consumed_samples(), path);
  SetInt(file, "model_dict_ordered", src.model_dict_ordered(), path);
  const ckpt::JsonOptions exact{.tensor_bytes = true};
  nlohmann::ordered_json buffers = nlohmann::ordered_json::array();
  for (const auto& b : src.buffers())
    buffers.push_back({{"name", b.name}, {"after", b.after}, {"layer", b.layer}, {"value", ckpt::ValueToJson(b.value, exact)}});
  SetString(file, "buffers", buffers.dump(), path);
  for (const char* f : {ckpt::kSchedulerFile, ckpt::kUserContentFile})
    if (auto v = src.TagFile(f); v && !o.weights_only) SetString(file, f, ckpt::ValueToJson(*v, exact).dump(), path);
  std::vector<std::string> names;
  for (const auto& p : src.params()) names.push_back(p.name);
  const ckpt::Grouping grouping = ckpt::FamilyGrouping(L.format, names, L.grouping);
  if (optimizer) {
    // As a pickle, which keeps what the groups share (torch's groups share
    // their defaults' objects, and the file shows it): an import writes it
    // back byte for byte.
    std::vector<ckpt::PickledStorage> storages;
    const std::string groups_pickle = ckpt::Pickle(src.ParamGroups(), {}, &storages);
    if (!storages.empty()) throw Error(src.path() + ": param_groups hold tensors, which the export does not carry");
    SetBytes(file, "param_groups", groups_pickle, path);
    // For readers: each group's hyperparameters (the first optimizer file's)
    // and its members by name.
    nlohmann::ordered_json readable = nlohmann::ordered_json::array();
    const auto& groups = src.ParamGroups().as_seq().items;
    for (int g = 0; g < grouping.groups; ++g) {
      nlohmann::ordered_json entry = nlohmann::ordered_json::object();
      if (static_cast<size_t>(g) < groups.size() && groups[g].is_dict())
        for (const auto& [k, v] : groups[g].as_dict().items)
          if (k.is_str() && k.as_str() != "params") {
            if (v.is_float()) entry[k.as_str()] = v.as_float();
            else if (v.is_int()) entry[k.as_str()] = v.as_int();
            else if (v.is_bool()) entry[k.as_str()] = v.as_bool();
            else if (v.is_seq()) {
              nlohmann::ordered_json a = nlohmann::ordered_json::array();
              for (const auto& x : v.as_seq().items) a.push_back(x.is_float() ? nlohmann::ordered_json(x.as_float()) : nlohmann::ordered_json(x.is_int() ? x.as_int() : 0));
              entry[k.as_str()] = a;
            }
          }
      entry["params"] = nlohmann::ordered_json::array();
      for (const auto& slot : grouping.order)
        if (slot.group == g) entry["params"].push_back(slot.name);
      readable.push_back(entry);
    }
    SetString(file, "param_groups_readable", readable.dump(), path);
  }

  // Tensors, a block at a time.
  std::vector<ckpt::LogicalTensor> tensors;
  for (const auto& t : ckpt::LogicalTensors(src))
    if (t.field == StateField::kParam || optimizer) tensors.push_back(t);
  uint64_t total = 0, done = 0;
  for (const auto& t : tensors) total += t.numel * ckpt::ElementSize(t.dtype);
  std::map<std::string, const ckpt::ParamRule*> rule_of;
  for (const auto& p : src.params()) rule_of[p.name] = &p;
  const int64_t padded_rows = format.PaddedVocab(L.grid.tp);
  std::vector<uint8_t> block(o.block);
  std::vector<float> wide;
  ExportSummary sum;
  for (const auto& t : tensors) {
    const ckpt::ParamRule& rule = *rule_of.at(t.name);
    const std::string where = path + ": " + DatasetPath(t.name, t.field);
    const size_t es = ckpt::ElementSize(t.dtype);
    const bool widen = o.float32 && (t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16);
    const DType stored = widen ? DType::kFloat32 : t.dtype;
    const size_t ses = ckpt::ElementSize(stored);
    if (rule.shape.empty() || rule.shape.size() > 3)
      throw Error(where + ": a " + std::to_string(rule.shape.size()) + "-dimensional parameter, which the export does not hold");
    // A Mixtral expert weight (3-D, issue #38) is stored as a 2-D dataset: its leading dimensions flattened into rows.
    const int rank = std::min<int>(static_cast<int>(rule.shape.size()), 2);
    const int64_t width = rank == 2 ? rule.shape.back() : 1;
    // Writes logical rows [row_lo, row_hi) (of `rule`'s padded shape) to dataset `dpath`.
    auto write_rows = [&](const std::string& dpath, int64_t row_lo, int64_t row_hi, uint32_t* crc) -> void {
      const int64_t rows = row_hi - row_lo;
      const hsize_t dims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(width)};
      const Hid space(H5Screate_simple(rank, dims, nullptr), H5Sclose);
      const Hid dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      const int64_t row_bytes = width * static_cast<int64_t>(ses);
      const hsize_t chunk[2] = {static_cast<hsize_t>(std::clamp<int64_t>((int64_t{1} << 20) / row_bytes, 1, rows)),
                                static_cast<hsize_t>(width)};
      if (rank == 1) {
        const hsize_t c1[1] = {static_cast<hsize_t>(std::clamp<int64_t>((int64_t{1} << 20) / static_cast<int64_t>(ses), 1, rows))};
        H5Pset_chunk(dcpl, 1, c1);
      } else {
        H5Pset_chunk(dcpl, 2, chunk);
      }
      if (o.gzip) H5Pset_shuffle(dcpl), H5Pset_deflate(dcpl, 4);
      const Hid ds(H5Dcreate2(file, dpath.c_str(), FileType(stored, where), space, lcpl, dcpl, H5P_DEFAULT), H5Dclose);
      if (!ds.ok()) throw Error(path + ": cannot create dataset " + dpath);
      SetString(ds, "dtype", std::string(ckpt::DTypeName(stored)), where);
      if (widen) SetString(ds, "source_dtype", std::string(ckpt::DTypeName(t.dtype)), where);
      const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(o.block / (width * std::max(es, ses))));
      if (widen) wide.resize(static_cast<size_t>(per * width));
      if (block.size() < static_cast<size_t>(per * width) * es) block.resize(static_cast<size_t>(per * width) * es);  // one row past the block
      for (int64_t r = 0; r < rows; r += per) {
        const int64_t nr = std::min(per, rows - r);
        const uint64_t n = static_cast<uint64_t>(nr * width);
        ckpt::Touched touched;
        src.Read(t.name, t.field, static_cast<uint64_t>((row_lo + r) * width), {block.data(), n * es}, &touched);
        if (crc) *crc = ckpt::Crc32Combine(*crc, ckpt::Crc32({block.data(), n * es}), n * es);
        const void* data = block.data();
        if (widen) {
          Widen(t.dtype, block.data(), n, wide.data());
          data = wide.data();
        }
        const Rect rect = Select(ds, rank, static_cast<uint64_t>(r), 0, static_cast<uint64_t>(nr), rank == 2 ? static_cast<uint64_t>(width) : 1);
        Check(H5Dwrite(ds, MemType(stored), rect.mem, rect.file, H5P_DEFAULT, data), where + ": write failed");
        done += n * es;
        if (o.progress) o.progress(done, total, t.name);
      }
    };
    uint32_t crc = 0;
    const int64_t logical_rows = static_cast<int64_t>(t.numel / static_cast<uint64_t>(width));
    write_rows(DatasetPath(t.name, t.field), 0, logical_rows, &crc);
    {
      const Hid ds(H5Dopen2(file, DatasetPath(t.name, t.field).c_str(), H5P_DEFAULT), H5Dclose);
      SetString(ds, "crc32", ckpt::CrcHex(crc), where);
      SetInt(ds, "numel", static_cast<int64_t>(t.numel), where);
    }
    if (rule.vocab && padded_rows > logical_rows) {
      total += static_cast<uint64_t>((padded_rows - logical_rows) * width) * es;
      write_rows("/vocab_padding" + DatasetPath(t.name, t.field), logical_rows, padded_rows, nullptr);
    }
    // A source that records fingerprints must still hold what it recorded.
    if (const auto& rec = src.recorded_fingerprints())
      if (const auto n = rec->find(t.name); n != rec->end())
        if (const auto f = n->second.find(ckpt::FieldName(t.field)); f != n->second.end() && f->second.crc32 != crc)
          throw Error(src.path() + ": " + t.name + " " + ckpt::FieldName(t.field) + " reads with fingerprint " + ckpt::CrcHex(crc) +
                      ", but its manifest records " + ckpt::CrcHex(f->second.crc32) + ": its data changed since it was written");
    ++sum.tensors;
    sum.bytes += t.numel * es;
  }
  if (optimizer)
    for (const auto& slot : grouping.order) {
      const Hid g(H5Gopen2(file, ("/optim/" + slot.name).c_str(), H5P_DEFAULT), H5Gclose);
      if (!g.ok()) continue;
      SetString(g, "step", ckpt::ValueToJson(src.Step(slot.name), exact).dump(), path);
      SetInt(g, "group", slot.group, path);
    }
  Check(H5Fflush(file, H5F_SCOPE_GLOBAL), path + ": flush failed");
  return sum;
}

bool IsH5State(const std::string& path) {
  std::lock_guard<std::mutex> lock(ckpt::Hdf5Lock());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  if (!IsRegularFile(path) || H5Fis_hdf5(path.c_str()) <= 0) return false;
  const Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) return false;
  try {
    return GetString(file, "format", path) == kH5Format;
  } catch (const Error&) {
    return false;
  }
}

std::unique_ptr<H5State> H5State::Open(const std::string& path) {
  std::unique_ptr<H5State> s(new H5State());  // before the lock: on a throw its destructor takes it
  std::lock_guard<std::mutex> lock(ckpt::Hdf5Lock());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  s->path_ = path;
  RequireRegularFile(path);
  if (H5Fis_hdf5(path.c_str()) <= 0) throw Error(path + ": is not an HDF5 file (or cannot be read)");
  s->file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (s->file_ < 0) throw Error(path + ": cannot open the HDF5 file");
  const hid_t file = s->file_;
  RequireNoLinksOut(file, path);
  if (H5Aexists(file, "format") <= 0 || GetString(file, "format", path) != kH5Format)
    throw Error(path + ": is not a shardkit full-state export (no format attribute '" + kH5Format + "')");
  if (const int64_t v = GetInt(file, "version", path); v != kH5Version)
    throw Error(path + ": format version " + std::to_string(v) + ", this build reads " + std::to_string(kH5Version));
  ckpt::TagDescription& L = s->layout_;
  L.format = ckpt::ModelFormat::FromJson(ParseJson(GetString(file, "model", path), path + ": attribute 'model'"), path + ": attribute 'model'");
  L.format_from_manifest = true;
  try {
    const nlohmann::json sl = ParseJson(GetString(file, "source_layout", path), path + ": attribute 'source_layout'");
    L.grid = {sl.at("tp").get<int>(), sl.at("pp").get<int>(), sl.at("dp").get<int>(), sl.at("zero1").get<bool>()};
    L.stage_bounds = sl.at("stage_bounds").get<std::vector<int64_t>>();
    L.virtual_stages = sl.value("virtual_stages", 1);
    if (sl.contains("virtual_stages") && (L.virtual_stages < 1 || L.stage_bounds.empty() || (L.stage_bounds.size() - 1) % static_cast<size_t>(L.virtual_stages) != 0))
      throw Error(path + ": attribute 'source_layout': 'virtual_stages' " + std::to_string(L.virtual_stages) + " does not divide its " +
                  std::to_string(L.stage_bounds.size() - (L.stage_bounds.empty() ? 0 : 1)) + " stages (the virtual pipeline)");
    L.has_optimizer = sl.at("has_optimizer").get<bool>();
    if (sl.contains("grouping")) {
      if (!ckpt::ParseGroupingRule(sl.at("grouping").get<std::string>(), &L.grouping))
        throw Error(path + ": attribute 'source_layout' names an unknown optimizer grouping '" + sl.at("grouping").get<std::string>() + "'");
    } else {
      // Files written before the grouping followed NeMo record `one_group`: norm weights decay.
      const bool norms_decay = sl.at("one_group").get<bool>();
      if (L.format.family == ckpt::ModelFamily::kHfLlama)
        L.grouping = norms_decay ? ckpt::GroupingRule::kNxdt : ckpt::GroupingRule::kNxdtLayerNormDecay;
      else
        L.grouping = norms_decay ? ckpt::GroupingRule::kNxdtLayerNormDecay : ckpt::GroupingRule::kNameSplit;
    }
    L.master_weights = sl.at("master_weights").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": attribute 'source_layout' is malformed: " + ckpt::JsonErrorText(e));
  }
  if (L.grid.tp < 1 || L.grid.pp < 1 || L.grid.dp < 1 || L.grid.tp > ckpt::kMaxRanks)
    throw Error(path + ": attribute 'source_layout' holds degrees below 1 or too large");
  if (const std::string why = L.format.CheckTensorParallel(L.grid.tp); !why.empty())
    throw Error(path + ": attribute 'source_layout': tp " + std::to_string(L.grid.tp) + ": " + why);
  s->tag_name_ = GetString(file, "tag_name", path);
  s->step_ = GetInt(file, "step", path);
  s->consumed_ = GetDouble(file, "consumed_samples", path);
  s->ordered_ = GetInt(file, "model_dict_ordered", path) != 0;
  // What becomes a pickle in the output must be data, never a call.
  auto exact = [&](const std::string& text, const std::string& where) {
    ckpt::Value v;
    try {
      v = ckpt::ValueFromJson(ParseJson(text, where));
    } catch (const Error& e) {
      throw Error(where + ": " + e.what());
    }
    ckpt::RequirePlainData(v, where);
    return v;
  };
  try {
    for (const auto& b : ParseJson(GetString(file, "buffers", path), path + ": attribute 'buffers'"))
      s->buffers_.push_back({b.at("name").get<std::string>(), b.at("after").get<std::string>(), b.at("layer").get<int>(),
                             exact(b.at("value").dump(), path + ": attribute 'buffers'")});
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": attribute 'buffers' is malformed: " + ckpt::JsonErrorText(e));
  }
  for (const char* f : {ckpt::kSchedulerFile, ckpt::kUserContentFile})
    if (H5Aexists(file, f) > 0) s->tag_files_[f] = exact(GetString(file, f, path), path + ": attribute '" + f + "'");
  if (L.has_optimizer) {
    const std::string bytes = GetBytes(file, "param_groups", path);
    s->param_groups_ = ckpt::Unpickle({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()},
                                      {path, "attribute 'param_groups'", [&](const ckpt::Value&) -> ckpt::Value {
                                         throw Error(path + ": attribute 'param_groups' refers to a tensor");
                                       }});
  }
  if (L.has_optimizer && !s->param_groups_.is_seq()) throw Error(path + ": attribute 'param_groups' is not a list");
  if (L.has_optimizer) ckpt::RequirePlainData(s->param_groups_, path + ": attribute 'param_groups'");

  // Every tensor the model format has, each of the shape the rules give it.
  s->params_ = ckpt::LogicalParameters(L.format, L.grid.tp);
  const int64_t padded = L.format.PaddedVocab(L.grid.tp);
  std::vector<StateField> fields{StateField::kParam};
  if (L.has_optimizer) fields.insert(fields.end(), {StateField::kExpAvg, StateField::kExpAvgSq});
  if (L.has_optimizer && L.master_weights) fields.push_back(StateField::kMaster);
  s->fingerprints_.emplace();
  for (const auto& p : s->params_) {
    for (StateField f : fields) {
      const std::string dpath = DatasetPath(p.name, f), where = path + ": " + dpath;
      if (H5Oexists_by_name(file, dpath.c_str(), H5P_DEFAULT) <= 0)  // negative when a group on the way is missing
        throw Error(where + ": missing (the model format " + L.format.Describe() + " has this tensor)");
      Tensor t;
      const Hid ds(H5Dopen2(file, dpath.c_str(), H5P_DEFAULT), H5Dclose);
      if (!ds.ok()) throw Error(where + ": is not a dataset");
      RequireDataInFile(ds, where);
      t.dataset = dpath;
      const std::string stored = GetString(ds, "dtype", where);
      const auto sd = ckpt::DTypeFromName(stored);
      if (!sd) throw Error(where + ": unknown dtype '" + stored + "'");
      t.stored = *sd;
      t.dtype = H5Aexists(ds, "source_dtype") > 0 ? ckpt::DTypeFromName(GetString(ds, "source_dtype", where)).value_or(DType::kBool)
                                                          : t.stored;
      if (t.dtype == DType::kBool || (t.dtype != t.stored && t.stored != DType::kFloat32)) throw Error(where + ": unknown source_dtype");
      const Hid ftype(H5Dget_type(ds), H5Tclose);
      if (H5Tequal(ftype, FileType(t.stored, where)) <= 0)
        throw Error(where + ": its HDF5 type does not hold " + stored + " (dtype attribute and data disagree)");
      // A 3-D (Mixtral expert) weight is a 2-D dataset of its leading dimensions' rows (WriteH5State).
      const int want_rank = std::min<int>(static_cast<int>(p.shape.size()), 2);
      t.width = p.shape.size() > 1 ? p.shape.back() : 1;
      t.rows = p.vocab ? L.format.vocab_size : ckpt::ShapeNumel(p.shape) / t.width;
      const Hid space(H5Dget_space(ds), H5Sclose);
      const int rank = H5Sget_simple_extent_ndims(space);
      hsize_t dims[2] = {0, 0};
      if (rank == want_rank) H5Sget_simple_extent_dims(space, dims, nullptr);
      if (rank != want_rank || static_cast<int64_t>(dims[0]) != t.rows ||
          (rank == 2 && static_cast<int64_t>(dims[1]) != t.width))
        throw Error(where + ": its shape does not fit the model format (" + std::to_string(t.rows) +
                    (rank == 2 ? " x " + std::to_string(t.width) : std::string()) + " expected)");
      const uint64_t numel = static_cast<uint64_t>(t.rows * t.width);
      if (GetInt(ds, "numel", where) != static_cast<int64_t>(numel)) throw Error(where + ": attribute 'numel' disagrees with its shape");
      const std::string crc = GetString(ds, "crc32", where);
      const ckpt::FileDigest d = ckpt::DigestFromJson({{"size", 0}, {"crc32", crc}}, where);
      (*s->fingerprints_)[p.name][ckpt::FieldName(f)] = {std::string(ckpt::DTypeName(t.dtype)), numel, d.crc32};
      const std::string ppath = "/vocab_padding" + dpath;
      if (p.vocab && padded > t.rows && H5Lexists(file, "/vocab_padding", H5P_DEFAULT) > 0 &&
          H5Oexists_by_name(file, ppath.c_str(), H5P_DEFAULT) > 0) {
        const Hid pds(H5Dopen2(file, ppath.c_str(), H5P_DEFAULT), H5Dclose);
        if (!pds.ok()) throw Error(path + ": " + ppath + ": is not a dataset");
        RequireDataInFile(pds, path + ": " + ppath);
        const Hid pt(H5Dget_type(pds), H5Tclose);
        if (H5Tequal(pt, ftype) <= 0) throw Error(path + ": " + ppath + ": its HDF5 type differs from " + dpath + "'s");
        t.padding = ppath;
        const Hid ps(H5Dget_space(pds), H5Sclose);
        hsize_t pd[2] = {0, 0};
        if (H5Sget_simple_extent_ndims(ps) != rank) throw Error(path + ": " + ppath + ": its shape does not fit " + dpath);
        H5Sget_simple_extent_dims(ps, pd, nullptr);
        t.padding_rows = static_cast<int64_t>(pd[0]);
        if (t.rows + t.padding_rows != padded || (rank == 2 && static_cast<int64_t>(pd[1]) != t.width))
          throw Error(path + ": " + ppath + ": holds " + std::to_string(t.padding_rows) + " rows, the source padded to " + std::to_string(padded));
      }
      s->tensors_[{p.name, f}] = t;
    }
    if (L.has_optimizer) {
      const std::string g = "/optim/" + p.name;
      const Hid grp(H5Gopen2(file, g.c_str(), H5P_DEFAULT), H5Gclose);
      if (!grp.ok()) throw Error(path + ": " + g + ": missing");
      const std::string where = path + ": " + g + " attribute 'step'";
      s->steps_[p.name] = exact(GetString(grp, "step", path + ": " + g), where);
      double step = 0;
      try {
        step = ckpt::AsScalar(s->steps_[p.name]);
      } catch (const Error&) {
        throw Error(where + ": is " + s->steps_[p.name].kind_name() + ", not AdamW's step count (a number)");
      }
      if (!(step >= 0 && step <= 1e15) || step != static_cast<double>(static_cast<int64_t>(step)))
        throw Error(where + ": " + std::to_string(step) + " is not a step count (a whole number from 0)");
    }
  }
  return s;
}

H5State::~H5State() {
  std::lock_guard<std::mutex> lock(ckpt::Hdf5Lock());
  for (auto& [p, id] : open_) H5Dclose(id);
  if (file_ >= 0) H5Fclose(file_);
}

ckpt::DType H5State::dtype(const std::string& name, StateField f) const { return tensors_.at({name, f}).dtype; }

const ckpt::Value& H5State::Step(const std::string& name) const {
  const auto it = steps_.find(name);
  if (it == steps_.end()) throw Error(path_ + ": holds no optimizer step of " + name);
  return it->second;
}

std::optional<ckpt::Value> H5State::TagFile(const std::string& name) const {
  const auto it = tag_files_.find(name);
  if (it == tag_files_.end()) return std::nullopt;
  return it->second;
}

int64_t H5State::Dataset(const std::string& dpath) const {
  for (size_t i = 0; i < open_.size(); ++i)
    if (open_[i].first == dpath) {
      std::rotate(open_.begin() + static_cast<std::ptrdiff_t>(i), open_.begin() + static_cast<std::ptrdiff_t>(i) + 1, open_.end());
      return open_.back().second;
    }
  if (open_.size() == kOpenDatasets) {
    H5Dclose(open_.front().second);
    open_.erase(open_.begin());
  }
  const Hid dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
  H5Pset_chunk_cache(dapl, 521, kChunkCache, 1.0);
  const hid_t id = H5Dopen2(file_, dpath.c_str(), dapl);
  if (id < 0) throw Error(path_ + ": " + dpath + ": cannot open");
  open_.emplace_back(dpath, id);
  return id;
}

void H5State::ReadRows(const Tensor& t, const std::string& dpath, uint64_t begin, uint64_t n, uint8_t* out) const {
  const hid_t dataset = Dataset(dpath);
  const Hid space(H5Dget_space(dataset), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space);
  const bool narrow = t.stored != t.dtype;
  std::vector<float> wide(narrow ? n : 0);
  const size_t ses = ckpt::ElementSize(t.stored);
  uint8_t* dst = narrow ? reinterpret_cast<uint8_t*>(wide.data()) : out;
  ForEachRect(rank == 2 ? t.width : 1, begin, n, [&](uint64_t row, uint64_t col, uint64_t rows, uint64_t cols, uint64_t before) {
    const Rect r = Select(dataset, rank, row, col, rows, cols);
    Check(H5Dread(dataset, MemType(t.stored), r.mem, r.file, H5P_DEFAULT, dst + before * ses), path_ + ": " + dpath + ": reading failed");
  });
  if (narrow) Narrow(t.dtype, wide.data(), n, out);
}

void H5State::Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched*) const {
  const Tensor& t = tensors_.at({name, f});
  const size_t es = ckpt::ElementSize(t.dtype);
  const uint64_t n = out.size() / es, main = static_cast<uint64_t>(t.rows * t.width),
                 pad = static_cast<uint64_t>(t.padding_rows * t.width);
  std::lock_guard<std::mutex> lock(ckpt::Hdf5Lock());
  uint64_t at = begin, o = 0;
  if (at < main) {
    const uint64_t k = std::min(n, main - at);
    ReadRows(t, t.dataset, at, k, out.data());
    at += k, o += k;
  }
  if (o < n && at < main + pad) {
    const uint64_t k = std::min(n - o, main + pad - at);
    ReadRows(t, t.padding, at - main, k, out.data() + o * es);
    at += k, o += k;
  }
  if (o < n) std::memset(out.data() + o * es, 0, (n - o) * es);
}

}  // namespace tools

namespace tools {

bool StartsAsHdf5(ckpt::Env* env, const std::string& path) {
  static constexpr uint8_t kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};  // the HDF5 spec's format signature
  if (!env->Exists(path) || env->IsDirectory(path) || env->FileSize(path) < sizeof kSignature) return false;
  const auto m = env->MapFile(path);
  return std::memcmp(m->data(), kSignature, sizeof kSignature) == 0;
}

ckpt::SourceKind H5SourceKind() {
  ckpt::SourceKind k;
  k.name = "h5";
  k.description = "a ckpt-export HDF5 file (the whole state, layout-free)";
  k.detect = StartsAsHdf5;
  k.open = [](ckpt::Env* env, const std::string& path, const ckpt::SourceOptions&) {
    auto h5 = H5State::Open(path);
    ckpt::OpenedSource s;
    s.tag_name = h5->tag_name();
    s.bytes = env->FileSize(path);
    s.state = std::move(h5);
    return s;
  };
  return k;
}

}  // namespace tools
