#include "ckpt/pt/zip_writer.h"

#include <algorithm>
#include <future>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50,
                   kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr uint32_t k32Max = 0xffffffffu;
constexpr uint16_t kFlagUtf8 = 0x0800;
constexpr uint16_t kDosTime = 0, kDosDate = (0 << 9) | (1 << 5) | 1;  // 1980-01-01 00:00

// A zip header being built: fields little-endian, as the format stores them.
class LittleEndianBytes {
 public:
  void u16(uint64_t v) { for (int i = 0; i < 2; ++i) b_.push_back(static_cast<uint8_t>(v >> (8 * i))); }
  void u32(uint64_t v) { for (int i = 0; i < 4; ++i) b_.push_back(static_cast<uint8_t>(v >> (8 * i))); }
  void u64(uint64_t v) { for (int i = 0; i < 8; ++i) b_.push_back(static_cast<uint8_t>(v >> (8 * i))); }
  void str(const std::string& s) { b_.insert(b_.end(), s.begin(), s.end()); }
  void fill(size_t n, uint8_t c) { b_.insert(b_.end(), n, c); }
  size_t size() const { return b_.size(); }
  std::span<const uint8_t> span() const { return b_; }

 private:
  std::vector<uint8_t> b_;
};

}  // namespace

ZipWriter::ZipWriter(WritableFile& out, std::string prefix) : out_(out), prefix_(std::move(prefix)) {}

void ZipWriter::Emit(std::span<const uint8_t> bytes, const uint32_t* crc) {
  out_.Append(bytes);
  file_crc_ = Crc32Combine(file_crc_, crc ? *crc : Crc32(bytes), bytes.size());
}

void ZipWriter::AddRecord(const std::string& name, std::span<const uint8_t> data) {
  AddRecord(name, data, Crc32(data));
}

std::vector<uint8_t> ZipWriter::LocalHeader(const std::string& full, uint64_t offset, uint64_t size, uint32_t crc) const {
  const bool zip64 = size >= k32Max;
  LittleEndianBytes h;
  h.u32(kLocalSig);
  h.u16(zip64 ? 45 : 20);
  h.u16(kFlagUtf8);
  h.u16(0);  // STORED
  h.u16(kDosTime);
  h.u16(kDosDate);
  h.u32(crc);  // at kCrcField
  h.u32(zip64 ? k32Max : size);
  h.u32(zip64 ? k32Max : size);
  h.u16(full.size());
  const size_t extra_pos = h.size();
  h.u16(0);  // extra length, patched below
  h.str(full);
  size_t extra = 0;
  if (zip64) {  // the local ZIP64 field carries both sizes
    h.u16(0x0001);
    h.u16(16);
    h.u64(size);
    h.u64(size);
    extra += 20;
  }
  // 'FB' padding field so the data begins on a 64-byte boundary, as torch
  // does (a page boundary for large records).
  const uint64_t align = size >= kPageRecord ? kPageAlignment : kAlignment;
  const uint64_t start = offset + h.size() + 4;
  const uint64_t pad = (align - start % align) % align;
  h.u16(0x4246);
  h.u16(pad);
  h.fill(pad, 'Z');
  extra += 4 + pad;
  std::vector<uint8_t> header(h.span().begin(), h.span().end());
  header[extra_pos] = static_cast<uint8_t>(extra);
  header[extra_pos + 1] = static_cast<uint8_t>(extra >> 8);
  return header;
}

void ZipWriter::AddRecord(const std::string& name, std::span<const uint8_t> data, uint32_t crc) {
  if (finished_) throw Error("zip: record '" + name + "' added after Finish");
  const std::string full = prefix_ + "/" + name;
  const uint64_t offset = out_.Size(), size = data.size();
  Emit(LocalHeader(full, offset, size, crc));
  Emit(data, &crc);
  entries_.push_back({full, offset, size, crc});
}

void ZipWriter::AddStreamedRecord(const std::string& name, uint64_t size,
                                  const std::function<void(uint64_t, std::span<uint8_t>)>& produce, std::span<uint8_t> buffer) {
  if (finished_) throw Error("zip: record '" + name + "' added after Finish");
  if (buffer.empty() && size > 0) throw Error("zip: record '" + name + "' streamed through an empty buffer");
  const std::string full = prefix_ + "/" + name;
  const uint64_t offset = out_.Size();
  std::vector<uint8_t> header = LocalHeader(full, offset, size, 0);
  out_.Append(header);
  uint32_t crc = 0;
  const size_t half = buffer.size() / 2 / kPageAlignment * kPageAlignment;
  const std::span<uint8_t> halves[2] = {half ? buffer.first(half) : buffer, half ? buffer.subspan(half, half) : buffer};
  std::future<void> writing;  // the append of the other half; its destructor waits, also when produce throws
  for (uint64_t done = 0, k = 0; done < size; k ^= 1) {
    const auto chunk = halves[k].first(static_cast<size_t>(std::min<uint64_t>(halves[k].size(), size - done)));
    produce(done, chunk);
    crc = Crc32Combine(crc, Crc32(chunk), chunk.size());
    if (writing.valid()) writing.get();  // rethrows its failure
    // The last chunk is appended here: a thread per record would cost more than a small tensor's write.
    if (half && done + chunk.size() < size) writing = std::async(std::launch::async, [this, chunk] { out_.Append(chunk); });
    else out_.Append(chunk);
    done += chunk.size();
  }
  if (writing.valid()) writing.get();
  for (int i = 0; i < 4; ++i) header[kCrcField + i] = static_cast<uint8_t>(crc >> (8 * i));
  out_.WriteAt(offset, std::span<const uint8_t>(header).first(kCrcField + 4));
  file_crc_ = Crc32Combine(Crc32Combine(file_crc_, Crc32(header), header.size()), crc, size);
  entries_.push_back({full, offset, size, crc});
}

void ZipWriter::Finish() {
  if (finished_) return;
  finished_ = true;
  const uint64_t cd_offset = out_.Size();
  LittleEndianBytes cd;
  for (const Entry& e : entries_) {
    const bool big_size = e.size >= k32Max, big_off = e.offset >= k32Max;
    cd.u32(kCentralSig);
    cd.u16(45);  // made by: zip 4.5
    cd.u16(big_size || big_off ? 45 : 20);
    cd.u16(kFlagUtf8);
    cd.u16(0);
    cd.u16(kDosTime);
    cd.u16(kDosDate);
    cd.u32(e.crc);
    cd.u32(big_size ? k32Max : e.size);
    cd.u32(big_size ? k32Max : e.size);
    cd.u16(e.name.size());
    const uint16_t extra = (big_size || big_off) ? 4 + (big_size ? 16 : 0) + (big_off ? 8 : 0) : 0;
    cd.u16(extra);
    cd.u16(0);  // comment
    cd.u16(0);  // disk
    cd.u16(0);  // internal attributes
    cd.u32(0);  // external attributes
    cd.u32(big_off ? k32Max : e.offset);
    cd.str(e.name);
    if (extra) {  // only the fields that overflowed, in the order the spec fixes
      cd.u16(0x0001);
      cd.u16(extra - 4);
      if (big_size) {
        cd.u64(e.size);
        cd.u64(e.size);
      }
      if (big_off) cd.u64(e.offset);
    }
  }
  const uint64_t cd_size = cd.size(), count = entries_.size();
  const bool zip64_end = count >= 0xffff || cd_size >= k32Max || cd_offset >= k32Max;
  if (zip64_end) {
    const uint64_t end64_offset = cd_offset + cd_size;
    cd.u32(kZip64EndSig);
    cd.u64(44);
    cd.u16(45);
    cd.u16(45);
    cd.u32(0);
    cd.u32(0);
    cd.u64(count);
    cd.u64(count);
    cd.u64(cd_size);
    cd.u64(cd_offset);
    cd.u32(kZip64LocatorSig);
    cd.u32(0);
    cd.u64(end64_offset);
    cd.u32(1);
  }
  cd.u32(kEndSig);
  cd.u16(0);
  cd.u16(0);
  cd.u16(zip64_end ? 0xffff : count);
  cd.u16(zip64_end ? 0xffff : count);
  cd.u32(zip64_end ? k32Max : cd_size);
  cd.u32(zip64_end ? k32Max : cd_offset);
  cd.u16(0);
  Emit(cd.span());
}

}  // namespace ckpt
