// ZipReader opens a zip archive held in a MappedFile. libzip validates the
// archive (central directory, local headers, ZIP64) and decompresses any
// compressed record; for STORED records, which is what torch writes, it
// locates the data's byte offset so the record is returned as a zero-copy
// view of the mapping. The archive prefix (torch's top-level folder) is taken
// from the first entry, never assumed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/pt/storage.h"

struct zip;  // libzip's archive handle

namespace ckpt {

struct ZipRecord {
  std::string name;  // without the prefix folder
  uint64_t index;    // libzip index
  uint64_t data_offset;  // valid for stored records
  uint64_t size;
  uint32_t crc;
  bool stored;
};

class ZipReader {
 public:
  // Throws ckpt::Error naming the file for anything that is not a sound zip.
  explicit ZipReader(std::shared_ptr<const MappedFile> file);
  ~ZipReader();
  ZipReader(const ZipReader&) = delete;
  ZipReader& operator=(const ZipReader&) = delete;

  static bool LooksLikeZip(std::span<const uint8_t> bytes);

  const std::string& prefix() const { return prefix_; }
  const std::vector<ZipRecord>& records() const { return records_; }
  // nullptr when there is no such record.
  const ZipRecord* Find(std::string_view name) const;
  // Throws ckpt::Error naming the file and record when absent.
  const ZipRecord& Get(std::string_view name) const;
  // The record's bytes: a view of the mapping when stored, else decompressed.
  std::shared_ptr<Storage> Read(const ZipRecord& rec) const;
  // Recomputes the CRC-32; throws ckpt::Error naming the record on mismatch.
  void VerifyCrc(const ZipRecord& rec) const;
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<const MappedFile> file_;
  ::zip* zip_ = nullptr;
  std::string prefix_;
  std::vector<ZipRecord> records_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

}  // namespace ckpt
