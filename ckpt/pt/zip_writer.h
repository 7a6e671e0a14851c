// ZipWriter streams an uncompressed (STORED) zip archive the way torch.save
// lays it out: every record under one prefix folder, each record's data
// starting at a multiple of 64 bytes (padding in a local 'FB' extra field),
// correct CRC-32s in the headers, and ZIP64 fields whenever a size, an offset
// or the entry count passes the classic limits. Output is deterministic
// (fixed timestamps), so equal content gives equal bytes.
//
// libzip is not used for writing: it cannot place data at an alignment, and
// it writes through its own file layer, not through ckpt::Env.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/util/env.h"

namespace ckpt {

class ZipWriter {
 public:
  // Every record's data starts at a multiple of kAlignment (torch's rule);
  // records of kPageRecord bytes or more start on a page (a multiple of 64
  // too), so the Env can write them with O_DIRECT and readers map them whole.
  static constexpr uint64_t kAlignment = 64;
  static constexpr uint64_t kPageAlignment = 4096;
  static constexpr uint64_t kPageRecord = 64 << 10;

  ZipWriter(WritableFile& out, std::string prefix);

  // Appends `prefix/name` holding `data`; `crc` is its CRC-32.
  void AddRecord(const std::string& name, std::span<const uint8_t> data, uint32_t crc);
  void AddRecord(const std::string& name, std::span<const uint8_t> data);
  // Appends `prefix/name` of `size` bytes that `produce` fills in order, one
  // `buffer` at a time, computing the CRC-32 as they pass; the header's CRC
  // is then patched in place (WritableFile::WriteAt). The bytes on disk are
  // exactly what AddRecord of the whole data would write. The buffer is used
  // in two page-aligned halves: while one half is appended (from a second
  // thread: an O_DIRECT write waits for the device), `produce` fills the
  // other, so producing and writing overlap. One append is in flight at a
  // time, in order.
  void AddStreamedRecord(const std::string& name, uint64_t size,
                         const std::function<void(uint64_t offset, std::span<uint8_t> out)>& produce, std::span<uint8_t> buffer);
  // Writes the central directory and end records. No records may follow.
  void Finish();
  // CRC-32 of every byte appended so far, from the record CRCs (no second
  // pass over the data): the whole-file checksum the manifest records.
  uint32_t file_crc() const { return file_crc_; }

 private:
  struct Entry {
    std::string name;
    uint64_t offset, size;
    uint32_t crc;
  };
  WritableFile& out_;
  std::string prefix_;
  std::vector<Entry> entries_;
  bool finished_ = false;
  uint32_t file_crc_ = 0;

  void Emit(std::span<const uint8_t> bytes, const uint32_t* crc = nullptr);
  // The local header of a record at `offset`, and where its CRC-32 field sits.
  std::vector<uint8_t> LocalHeader(const std::string& full, uint64_t offset, uint64_t size, uint32_t crc) const;
  static constexpr size_t kCrcField = 14;
};

}  // namespace ckpt
