#include "ckpt/pt/pt_file.h"

#include <tbb/parallel_for.h>

#include <filesystem>
#include <unordered_map>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"
#include "ckpt/util/input_guard.h"
#include "ckpt/pt/pickle_reader.h"
#include "ckpt/pt/zip_reader.h"
#include "ckpt/pt/zip_writer.h"

namespace ckpt {
namespace {

// ('storage', torch.<T>Storage, key, location, numel[, view_metadata])
struct StorageId {
  DType dtype;
  std::string key;
  uint64_t nbytes;
  Value view_metadata;
};

StorageId ParseStorageId(const Value& pid) {
  if (!pid.is_seq() || pid.as_seq().kind != SeqKind::kTuple) throw Error("persistent id is a " + pid.kind_name() + ", not a tuple");
  const auto& a = pid.as_seq().items;
  if (a.size() < 5 || !a[0].is_str() || a[0].as_str() != "storage")
    throw Error("persistent id is not a ('storage', ...) tuple");
  if (!a[1].is_global()) throw Error("storage type is a " + a[1].kind_name());
  const Global& cls = a[1].as_global();
  const int64_t numel = a[4].as_int();
  if (numel < 0) throw Error("storage has negative size");
  StorageId id;
  if (cls.name == "UntypedStorage") {
    id.dtype = DType::kUInt8;
  } else if (auto dt = DTypeFromStorageClass(cls.name)) {
    id.dtype = *dt;
  } else {
    throw Error("unsupported storage type " + cls.full());
  }
  if (static_cast<uint64_t>(numel) > (UINT64_MAX >> 5)) throw Error("storage size overflows");
  id.nbytes = static_cast<uint64_t>(numel) * ElementSize(id.dtype);
  if (a[2].is_str()) id.key = a[2].as_str();
  else if (a[2].is_int()) id.key = std::to_string(a[2].as_int());
  else throw Error("storage key is a " + a[2].kind_name());
  if (a.size() > 5) id.view_metadata = a[5];
  return id;
}

Value LoadZip(std::shared_ptr<const MappedFile> file, const LoadOptions& opts) {
  ZipReader zip(file);
  if (opts.verify_crc)
    for (const auto& r : zip.records()) zip.VerifyCrc(r);
  const ZipRecord& pkl = zip.Get("data.pkl");
  // The pickle is small and every value comes from it: its CRC-32 is always
  // checked, as torch.load checks it (tensor records: with verify_crc, or as
  // they are copied).
  if (!opts.verify_crc) zip.VerifyCrc(pkl);
  auto pkl_bytes = zip.Read(pkl);
  std::unordered_map<std::string, std::shared_ptr<Storage>> loaded;
  PickleSource src;
  src.file = file->path();
  src.record = zip.prefix() + "/data.pkl";
  src.persistent_load = [&](const Value& pid) -> Value {
    StorageId id = ParseStorageId(pid);
    auto it = loaded.find(id.key);
    if (it == loaded.end()) {
      const ZipRecord& rec = zip.Get("data/" + id.key);
      if (rec.size < id.nbytes)
        throw Error(file->path() + ": record '" + zip.prefix() + "/data/" + id.key + "' holds " + std::to_string(rec.size) +
                    " bytes but its storage needs " + std::to_string(id.nbytes));
      it = loaded.emplace(id.key, zip.Read(rec)).first;
    }
    return Value(StorageRef{id.dtype, it->second});
  };
  return Unpickle({pkl_bytes->data(), pkl_bytes->nbytes()}, src);
}

// Legacy format: magic, protocol, sys_info, the object, storage keys, then
// for each key an 8-byte element count and the raw bytes.
Value LoadLegacy(std::shared_ptr<const MappedFile> file) {
  const auto all = file->bytes();
  size_t pos = 0;
  auto next = [&](const char* what, const PickleSource& src) {
    size_t used = 0;
    PickleSource s = src;
    s.record = what;
    Value v = Unpickle(all.subspan(pos), s, &used);
    pos += used;
    return v;
  };
  PickleSource plain{file->path(), "", nullptr};
  Value magic = next("magic number", plain);
  if (!magic.is_bigint() && !magic.is_int())
    throw Error(file->path() + ": neither a zip archive nor a legacy torch file");
  if (!DeepEqual(magic, Value(BigInt{std::string("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10)})))
    throw Error(file->path() + ": neither a zip archive nor a legacy torch file (bad magic number)");
  Value proto = next("protocol version", plain);
  if (!proto.is_int() || proto.as_int() != 1001)
    throw Error(file->path() + ": legacy torch file with unsupported protocol version");
  next("sys_info", plain);

  struct Pending {
    std::shared_ptr<Storage> storage;
    DType dtype;
  };
  std::unordered_map<std::string, Pending> roots;
  struct View {
    std::shared_ptr<Storage> storage;
    std::string root;
    uint64_t byte_offset;
  };
  std::vector<View> views;
  std::unordered_map<std::string, std::shared_ptr<Storage>> view_by_key;
  PickleSource src{file->path(), "", [&](const Value& pid) -> Value {
    StorageId id = ParseStorageId(pid);
    auto it = roots.find(id.key);
    if (it == roots.end()) it = roots.emplace(id.key, Pending{Storage::Deferred(id.nbytes), id.dtype}).first;
    if (id.view_metadata.is_seq()) {
      const auto& vm = id.view_metadata.as_seq().items;
      if (vm.size() != 3) throw Error("bad storage view metadata");
      const std::string vkey = vm[0].as_str();
      const int64_t off = vm[1].as_int(), size = vm[2].as_int();
      if (off < 0 || size < 0 || static_cast<uint64_t>(off + size) * ElementSize(id.dtype) > id.nbytes)
        throw Error("storage view " + vkey + " lies outside storage " + id.key);
      auto& s = view_by_key[vkey];
      if (!s) {
        s = Storage::Deferred(size * ElementSize(id.dtype));
        views.push_back({s, id.key, off * ElementSize(id.dtype)});
      }
      return Value(StorageRef{id.dtype, s});
    }
    return Value(StorageRef{id.dtype, it->second.storage});
  }};
  Value root = next("object", src);
  Value keys = next("storage keys", plain);
  if (!keys.is_seq()) throw Error(file->path() + ": legacy storage key list is a " + keys.kind_name());
  for (const Value& k : keys.as_seq().items) {
    const std::string key = k.as_str();
    if (all.size() - pos < 8) throw Error(file->path() + ": legacy storage '" + key + "' is truncated");
    uint64_t count = 0;
    for (int i = 7; i >= 0; --i) count = (count << 8) | all[pos + i];
    pos += 8;
    auto it = roots.find(key);
    if (it == roots.end()) throw Error(file->path() + ": legacy storage '" + key + "' is not referenced");
    const uint64_t elem = ElementSize(it->second.dtype);
    if (count > (all.size() - pos) / elem)
      throw Error(file->path() + ": legacy storage '" + key + "' is truncated (needs " + std::to_string(count * elem) + " bytes)");
    if (count * elem != it->second.storage->nbytes())
      throw Error(file->path() + ": legacy storage '" + key + "' holds " + std::to_string(count * elem) +
                  " bytes but is declared as " + std::to_string(it->second.storage->nbytes()));
    if (!it->second.storage->is_bound()) it->second.storage->Bind(file, all.data() + pos);
    pos += count * elem;
  }
  for (const View& v : views) {
    const auto& r = roots.at(v.root).storage;
    if (!r->is_bound()) throw Error(file->path() + ": legacy storage '" + v.root + "' has no data");
    v.storage->Bind(file, r->data() + v.byte_offset);
  }
  for (const auto& [key, p] : roots)
    if (!p.storage->is_bound()) throw Error(file->path() + ": legacy storage '" + key + "' has no data");
  return root;
}

}  // namespace

std::string ArchivePrefixFor(const std::string& path) {
  std::string base = std::filesystem::path(path).filename().string();
  const auto dot = base.rfind('.');
  if (dot != std::string::npos && dot > 0) base = base.substr(0, dot);
  return base.empty() ? "archive" : base;
}

Value LoadPtFromFile(std::shared_ptr<const MappedFile> file, const LoadOptions& opts) {
  if (file->size() == 0) throw Error(file->path() + ": file is empty");
  if (ZipReader::LooksLikeZip(file->bytes())) return LoadZip(file, opts);
  if (file->data()[0] == 0x80) return LoadLegacy(file);
  throw Error(file->path() + ": not a PyTorch file (neither a zip archive nor a legacy pickle)");
}

Value LoadPt(const std::string& path, const LoadOptions& opts, Env* env) {
  if (!opts.confine_to.empty()) RequireInside(opts.confine_to, path);
  return LoadPtFromFile(env->MapFile(path), opts);
}

uint32_t WritePt(WritableFile& out, const std::string& prefix, const Value& root, const SaveOptions& opts) {
  std::vector<PickledStorage> storages;
  const std::string pkl = Pickle(root, opts, &storages);
  // CRCs first (in parallel across storages): headers carry them, no
  // descriptors. Records copied from a mapped archive are summed just before
  // they are written instead, so a large input is read once, in order, and
  // their recorded CRC-32 is checked on the way.
  std::vector<uint32_t> crcs(storages.size());
  tbb::parallel_for(size_t{0}, storages.size(), [&](size_t i) {
    if (!storages[i].storage->origin() && !storages[i].storage->producer()) crcs[i] = Crc32({storages[i].storage->data(), storages[i].storage->nbytes()});
  });
  ZipWriter zip(out, prefix);
  auto bytes = [](const std::string& s) { return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()); };
  zip.AddRecord("data.pkl", bytes(pkl));
  zip.AddRecord("byteorder", bytes("little"));
  auto prefetch = [&](size_t i) {  // the next mapped record is read ahead while this one is copied
    if (i < storages.size() && storages[i].storage->origin())
      storages[i].storage->origin()->file->Prefetch(storages[i].storage->data(), storages[i].storage->nbytes());
  };
  prefetch(0);
  std::shared_ptr<Storage> chunk;  // for generated storages
  for (size_t i = 0; i < storages.size(); ++i) {
    prefetch(i + 1);
    const Storage& st = *storages[i].storage;
    if (const StorageProducer* produce = st.producer()) {
      if (!chunk) {
        const size_t nbytes = std::max<size_t>(4096, opts.stream_chunk / 4096 * 4096);
        chunk = opts.stream_buffers ? opts.stream_buffers->Acquire(nbytes) : Storage::Allocate(nbytes, false);
      }
      zip.AddStreamedRecord("data/" + storages[i].key, st.nbytes(), *produce, {chunk->mutable_data(), chunk->nbytes()});
      continue;
    }
    const StorageOrigin* origin = st.origin();
    if (origin) {
      crcs[i] = Crc32({st.data(), st.nbytes()});
      if (crcs[i] != origin->crc32)
        throw Error(origin->file->path() + ": record '" + origin->record + "' fails its CRC-32 check (stored " +
                    std::to_string(origin->crc32) + ", computed " + std::to_string(crcs[i]) + "): the file is corrupt");
    }
    zip.AddRecord("data/" + storages[i].key, {st.data(), st.nbytes()}, crcs[i]);
    if (origin && opts.drop_source_pages) origin->file->DropPages(st.data(), st.nbytes());
  }
  zip.AddRecord("version", bytes("3\n"));
  zip.Finish();
  return zip.file_crc();
}

void SavePt(const std::string& path, const Value& root, const SaveOptions& opts, Env* env) {
  WriteFileAtomically(env, path, [&](WritableFile& f) { WritePt(f, ArchivePrefixFor(path), root, opts); });
}

}  // namespace ckpt
