#include "ckpt/pt/zip_reader.h"

#include <zip.h>

#include <cstdlib>
#include <cstring>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

uint64_t Le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Maps each entry's full name to the byte offset of its data, from the
// central directory and local headers. libzip has already checked the
// archive's consistency; this walk is bounds-checked all the same.
std::map<std::string, uint64_t> DataOffsets(std::span<const uint8_t> f, const std::string& path) {
  auto fail = [&](const std::string& what) -> Error { return Error(path + ": zip: " + what); };
  const uint64_t n = f.size();
  if (n < 22) throw fail("file too short for an end-of-central-directory record (truncated?)");
  uint64_t eocd = UINT64_MAX;
  for (uint64_t i = n - 22 + 1; i-- > 0 && n - i <= 22 + 65535;)
    if (Le(&f[i], 4) == 0x06054b50) {
      eocd = i;
      break;
    }
  if (eocd == UINT64_MAX) throw fail("no end-of-central-directory record (truncated?)");
  uint64_t count = Le(&f[eocd + 10], 2), cd_size = Le(&f[eocd + 12], 4), cd_off = Le(&f[eocd + 16], 4);
  if (eocd >= 20 && Le(&f[eocd - 20], 4) == 0x07064b50) {
    const uint64_t z64 = Le(&f[eocd - 20 + 8], 8);
    if (z64 > n - 56 || Le(&f[z64], 4) != 0x06064b50) throw fail("bad ZIP64 end record");
    count = Le(&f[z64 + 32], 8);
    cd_size = Le(&f[z64 + 40], 8);
    cd_off = Le(&f[z64 + 48], 8);
  }
  if (cd_off > n || cd_size > n - cd_off) throw fail("central directory lies outside the file");
  std::map<std::string, uint64_t> out;
  uint64_t p = cd_off;
  for (uint64_t e = 0; e < count; ++e) {
    if (p + 46 > cd_off + cd_size || Le(&f[p], 4) != 0x02014b50) throw fail("bad central directory entry");
    const uint64_t name_len = Le(&f[p + 28], 2), extra_len = Le(&f[p + 30], 2), comment_len = Le(&f[p + 32], 2);
    if (p + 46 + name_len + extra_len + comment_len > cd_off + cd_size) throw fail("bad central directory entry");
    uint64_t usize = Le(&f[p + 24], 4), csize = Le(&f[p + 20], 4), local = Le(&f[p + 42], 4);
    std::string name(reinterpret_cast<const char*>(&f[p + 46]), name_len);
    // ZIP64 extra: the overflowed fields, in order.
    for (uint64_t x = p + 46 + name_len; x + 4 <= p + 46 + name_len + extra_len;) {
      const uint64_t id = Le(&f[x], 2), len = Le(&f[x + 2], 2);
      if (x + 4 + len > p + 46 + name_len + extra_len) break;
      if (id == 1) {
        uint64_t q = x + 4, end = x + 4 + len;
        if (usize == 0xffffffff && q + 8 <= end) usize = Le(&f[q], 8), q += 8;
        if (csize == 0xffffffff && q + 8 <= end) csize = Le(&f[q], 8), q += 8;
        if (local == 0xffffffff && q + 8 <= end) local = Le(&f[q], 8), q += 8;
      }
      x += 4 + len;
    }
    if (local + 30 > n || Le(&f[local], 4) != 0x04034b50) throw fail("bad local header for '" + name + "'");
    const uint64_t data = local + 30 + Le(&f[local + 26], 2) + Le(&f[local + 28], 2);
    if (data > n || csize > n - data) throw fail("record '" + name + "' extends past the end of the file (truncated?)");
    out[name] = data;
    p += 46 + name_len + extra_len + comment_len;
  }
  return out;
}

}  // namespace

bool ZipReader::LooksLikeZip(std::span<const uint8_t> b) {
  return b.size() >= 4 && b[0] == 'P' && b[1] == 'K' && b[2] == 3 && b[3] == 4;
}

namespace {
// libzip turns every record's DOS time into a time_t with mktime, and glibc
// re-reads /etc/localtime on each call while TZ is unset: two stats per file
// opened, thousands for an xser tag. TZ naming that same file makes glibc
// load it once. Set before main, while no other thread reads the environment.
const bool kTzCached = [] {
  if (!std::getenv("TZ")) ::setenv("TZ", ":/etc/localtime", 0);
  return true;
}();
}  // namespace

ZipReader::ZipReader(std::shared_ptr<const MappedFile> file) : file_(std::move(file)) {
  const std::string& path = file_->path();
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* src = zip_source_buffer_create(file_->data(), file_->size(), 0, &err);
  if (src) zip_ = zip_open_from_source(src, ZIP_RDONLY | ZIP_CHECKCONS, &err);
  if (!zip_) {
    std::string msg = path + ": not a valid zip archive (" + zip_error_strerror(&err) + ")";
    if (zip_error_code_zip(&err) == ZIP_ER_NOZIP) msg += "; the file may be truncated";
    zip_error_fini(&err);
    if (src) zip_source_free(src);
    throw Error(msg);
  }
  zip_error_fini(&err);
  try {
    const zip_int64_t n = zip_get_num_entries(zip_, 0);
    if (n <= 0) throw Error(path + ": zip archive has no records");
    const auto offsets = DataOffsets(file_->bytes(), path);
    for (zip_int64_t i = 0; i < n; ++i) {
      zip_stat_t st;
      zip_stat_init(&st);
      if (zip_stat_index(zip_, i, 0, &st) != 0) throw Error(path + ": cannot stat zip entry " + std::to_string(i));
      std::string full = st.name;
      if (i == 0) {
        const auto slash = full.find('/');
        if (slash == std::string::npos) throw Error(path + ": first zip entry '" + full + "' has no archive folder");
        prefix_ = full.substr(0, slash);
      }
      if (full.compare(0, prefix_.size() + 1, prefix_ + "/") != 0)
        throw Error(path + ": zip entry '" + full + "' lies outside the archive folder '" + prefix_ + "/'");
      const auto off = offsets.find(full);
      if (off == offsets.end()) throw Error(path + ": zip entry '" + full + "' missing from the central directory walk");
      ZipRecord rec{full.substr(prefix_.size() + 1), static_cast<uint64_t>(i), off->second, st.size, st.crc,
                    st.comp_method == ZIP_CM_STORE};
      if (rec.stored && st.comp_size != st.size)
        throw Error(path + ": stored record '" + rec.name + "' has differing sizes");
      by_name_[rec.name] = records_.size();
      records_.push_back(std::move(rec));
    }
  } catch (...) {
    zip_discard(zip_);
    throw;
  }
}

ZipReader::~ZipReader() {
  if (zip_) zip_discard(zip_);
}

const ZipRecord* ZipReader::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &records_[it->second];
}

const ZipRecord& ZipReader::Get(std::string_view name) const {
  if (const ZipRecord* r = Find(name)) return *r;
  throw Error(path() + ": missing record '" + prefix_ + "/" + std::string(name) + "'");
}

std::shared_ptr<Storage> ZipReader::Read(const ZipRecord& rec) const {
  if (rec.stored) {
    auto s = Storage::Borrow(file_, file_->data() + rec.data_offset, rec.size);
    s->set_origin({file_.get(), prefix_ + "/" + rec.name, rec.crc});
    return s;
  }
  auto out = Storage::Allocate(rec.size);
  zip_file_t* zf = zip_fopen_index(zip_, rec.index, 0);
  if (!zf) throw Error(path() + ": cannot open record '" + rec.name + "': " + zip_strerror(zip_));
  const zip_int64_t got = zip_fread(zf, out->mutable_data(), rec.size);
  std::string err = got < 0 ? zip_file_strerror(zf) : "";
  zip_fclose(zf);
  if (got < 0 || static_cast<uint64_t>(got) != rec.size)
    throw Error(path() + ": cannot read record '" + rec.name + "'" + (err.empty() ? "" : ": " + err));
  return out;
}

void ZipReader::VerifyCrc(const ZipRecord& rec) const {
  // A stored record is summed straight from the mapping, a window at a time (Crc32Mapped), so
  // checking a file costs a window of memory, not the file.
  uint32_t got = 0;
  if (rec.stored) {
    if (rec.data_offset > file_->size() || rec.size > file_->size() - rec.data_offset)
      throw Error(path() + ": record '" + rec.name + "' runs past the end of the file");
    got = Crc32Mapped(*file_, {file_->data() + rec.data_offset, rec.size});
  } else {
    auto s = Read(rec);
    got = Crc32({s->data(), s->nbytes()});
  }
  if (got != rec.crc)
    throw Error(path() + ": record '" + rec.name + "' fails its CRC-32 check (stored " + std::to_string(rec.crc) +
                ", computed " + std::to_string(got) + ")");
}

}  // namespace ckpt
