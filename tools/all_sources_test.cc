// The conformance suite every registered reader passes (issue #36 step 5).
// From one model per origin (the shard tests' fake, and the NNM sample
// checkpoint in tests/data), the existing writers make every other kind: the
// reshard engine writes the tag, and ckpt-export's writers the HDF5 file and
// the Hugging Face folder from that tag. Each kind, opened through the
// registry by detection alone, must then give:
//   - the origin's logical tensors (names, shapes, dtypes, element counts)
//     and fingerprints (the bytes), for every field it holds (an HF folder:
//     the weights);
//   - the same bytes read in pieces as read whole, each piece touching no
//     more mapped bytes than it copies (Touched: the reader does not load the
//     source to read a piece);
//   - refusal of damaged input (its largest file truncated, removed, or its
//     first byte changed) with a ckpt::Error naming the file.
#include "tools/all_sources.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "ckpt/shard/fake_state.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/testing/test_util.h"
#include "tools/h5_state.h"
#include "tools/hf_export.h"

namespace tools {
namespace {

namespace fs = std::filesystem;
using ckpt::testing::ErrorOf;
using ckpt::testing::TempDir;

const char kNnmSample[] = SHARDKIT_TEST_DATA "/sample/nnm_tiny_llama";

// The registry under test: every program's entries and the fake's.
const ckpt::SourceRegistry& Registry() {
  static const ckpt::SourceRegistry& r = [] {
    AllSources();
    ckpt::SourceRegistry::Default().Add(ckpt::testing::FakeSourceKind());
    return std::cref(ckpt::SourceRegistry::Default());
  }();
  return r;
}

// One origin model and every kind made from it: kind -> path.
struct Made {
  std::unique_ptr<TempDir> dir;
  std::string origin_kind;
  std::map<std::string, std::string> paths;
  ckpt::SourceOptions hf_options;  // pads the vocabulary as the origin does
};

// The origin `kind` at `origin`, written as a tag at its own degrees, and the
// tag exported as an HDF5 file and a Hugging Face folder.
Made MakeAll(const std::string& kind, const std::string& origin) {
  Made m;
  m.dir = std::make_unique<TempDir>("sources_" + kind);
  m.origin_kind = kind;
  ckpt::Env* env = ckpt::Env::Default();
  std::string from = origin;
  if (kind == "fake") std::ofstream(from = *m.dir / "model.fake") << "SmallLlama\n";  // bytes another detector might claim
  m.paths[kind] = from;
  const ckpt::OpenedSource src = Registry().Open(env, from, {});
  const ckpt::TagDescription& L = src.state->layout();
  ckpt::ReshardArgs a;
  a.dst = *m.dir / "tag";
  a.tp = 2, a.pp = 2;  // several rank files, as a tag from a parallel job has
  ckpt::ReshardSummary sum;
  sum.src_tag = from;
  ckpt::WriteInLayout(*src.state, src.tag_name, a, env, [](const std::string&) {}, std::chrono::steady_clock::now(), sum);
  m.paths["tag"] = a.dst;
  const ckpt::OpenedSource tag = Registry().Open(env, a.dst, {}, "tag");
  WriteH5State(*tag.state, "tag", *m.dir / "state.h5", {});
  m.paths["h5"] = *m.dir / "state.h5";
  env->CreateDirs(*m.dir / "hf");
  WriteHfFolder(*tag.state, *m.dir / "hf", {}, env);
  m.paths["hf"] = *m.dir / "hf";
  m.hf_options.hints.make_vocab_size_divisible_by = L.format.make_vocab_size_divisible_by * L.grid.tp;  // the origin's padding
  return m;
}

const Made& Origin(const std::string& kind) {
  static std::map<std::string, Made> made;
  if (!made.count(kind)) made.emplace(kind, MakeAll(kind, kind == "nnm" ? kNnmSample : ""));
  return made.at(kind);
}

struct Case {
  std::string origin, kind;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.kind << " made from " << c.origin; }

class Conformance : public ::testing::TestWithParam<Case> {
 protected:
  const Made& made() const { return Origin(GetParam().origin); }
  const std::string& path() const { return made().paths.at(GetParam().kind); }
  ckpt::SourceOptions options() const { return GetParam().kind == "hf" ? made().hf_options : ckpt::SourceOptions{}; }
  // `p` as this case's kind reads it (by detection when `kind` is empty).
  ckpt::OpenedSource Open(const std::string& p, const std::string& kind = "") const {
    return Registry().Open(ckpt::Env::Default(), p, options(), kind);
  }
  ckpt::OpenedSource OpenOrigin() const { return Registry().Open(ckpt::Env::Default(), made().paths.at(made().origin_kind), {}); }
  // What reading a piece of `piece` bytes of a logical tensor of `tensor`
  // bytes may touch: the piece; for an HF folder the tensor, since a logical
  // tensor is rows of several HF tensors (q, k, v) and Touched keeps one span
  // per file, from the first byte touched to the last.
  uint64_t bound(uint64_t piece, uint64_t tensor) const { return GetParam().kind == "hf" ? tensor : piece; }
  // The fields this kind holds: an HF folder has weights only.
  std::optional<ckpt::StateField> only() const {
    return GetParam().kind == "hf" ? std::optional(ckpt::StateField::kParam) : std::nullopt;
  }
};

TEST_P(Conformance, IsDetectedAsItsKindAndNoOther) {
  const ckpt::SourceKind* k = Registry().Detect(ckpt::Env::Default(), path());  // throws when two claim it
  ASSERT_NE(k, nullptr) << path();
  EXPECT_EQ(k->name, GetParam().kind);
  EXPECT_EQ(Open(path()).kind, GetParam().kind);
}

// The largest file of `path` (itself when a file), relative to `path`.
std::string LargestFile(const std::string& path) {
  if (!fs::is_directory(path)) return "";
  std::string best;
  uintmax_t size = 0;
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file() && e.file_size() > size) size = e.file_size(), best = fs::relative(e.path(), path).string();
  return best;
}

TEST_P(Conformance, NoReaderClaimsAPartOfIt) {
  const std::string part = LargestFile(path());  // a tag's rank file, an HF folder's weights
  if (part.empty() || GetParam().kind == "nnm") return;  // one NNM rank file is itself a (tp 1) NNM checkpoint
  EXPECT_EQ(Registry().Detect(ckpt::Env::Default(), path() + "/" + part), nullptr) << part;
}

TEST_P(Conformance, HoldsTheOriginsLogicalTensorsAndFingerprints) {
  const ckpt::OpenedSource origin = OpenOrigin(), s = Open(path());
  ASSERT_EQ(s.state->params().size(), origin.state->params().size());
  for (size_t i = 0; i < s.state->params().size(); ++i) {
    EXPECT_EQ(s.state->params()[i].name, origin.state->params()[i].name);
    EXPECT_EQ(s.state->params()[i].shape, origin.state->params()[i].shape) << origin.state->params()[i].name;
  }
  std::vector<ckpt::LogicalTensor> want;
  for (const auto& t : ckpt::LogicalTensors(*origin.state))
    if (!only() || t.field == *only()) want.push_back(t);
  const auto have = ckpt::LogicalTensors(*s.state);
  ASSERT_EQ(have.size(), want.size());
  for (size_t i = 0; i < have.size(); ++i) {
    EXPECT_EQ(have[i].name, want[i].name);
    EXPECT_EQ(have[i].field, want[i].field) << want[i].name;
    EXPECT_EQ(have[i].dtype, want[i].dtype) << want[i].name;
    EXPECT_EQ(have[i].numel, want[i].numel) << want[i].name;
  }
  const ckpt::TensorFingerprints a = ckpt::ComputeFingerprints(*origin.state, 4 << 20, only()),
                                 b = ckpt::ComputeFingerprints(*s.state, 4 << 20, only());
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(ckpt::RecordedMismatches(a, b).size(), 0u);
  EXPECT_EQ(a.size(), b.size());
}

TEST_P(Conformance, ReadsAPieceAtATimeTouchingOnlyThatPiece) {
  const ckpt::OpenedSource s = Open(path());
  const ckpt::LogicalState& st = *s.state;
  uint64_t pieces = 0;
  for (const auto& t : ckpt::LogicalTensors(st)) {
    const size_t es = ckpt::ElementSize(t.dtype);
    std::vector<uint8_t> whole(t.numel * es), joined(whole.size());
    st.Read(t.name, t.field, 0, whole, nullptr);
    const uint64_t piece = std::max<uint64_t>(1, t.numel / 7);  // pieces that cut rows
    for (uint64_t at = 0; at < t.numel; at += piece, ++pieces) {
      const uint64_t n = std::min(piece, t.numel - at);
      ckpt::Touched touched;
      st.Read(t.name, t.field, at, {joined.data() + at * es, n * es}, &touched);
      EXPECT_LE(touched.bytes(), bound(n * es, t.numel * es)) << t.name << " " << ckpt::FieldName(t.field) << " at " << at;
    }
    EXPECT_EQ(joined, whole) << t.name << " " << ckpt::FieldName(t.field);
  }
  EXPECT_GT(pieces, 7u);
  EXPECT_LE(st.ReadMemory(), uint64_t{64} << 20);  // what a reader may hold besides: fixed, not the model's size
}

enum class Damage { kTruncated, kRemoved, kFirstByteChanged };

TEST_P(Conformance, RefusesDamagedInputNamingTheFile) {
  std::vector<Damage> damages = {Damage::kTruncated, Damage::kRemoved, Damage::kFirstByteChanged};
  if (GetParam().kind == "fake") damages = {Damage::kRemoved};  // its file is a name; its data are computed
  for (Damage d : damages) {
    TempDir dir("damaged");
    const std::string copy = dir / fs::path(path()).filename().string();
    fs::copy(path(), copy, fs::copy_options::recursive);
    const std::string rel = LargestFile(copy), file = rel.empty() ? copy : copy + "/" + rel;
    const uintmax_t size = fs::file_size(file);
    if (d == Damage::kTruncated) fs::resize_file(file, size / 2);
    if (d == Damage::kRemoved) fs::remove(file);
    if (d == Damage::kFirstByteChanged) {
      std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
      const char c = static_cast<char>(f.get() ^ 0x5a);
      f.seekp(0);
      f.put(c);
    }
    const std::string e = ErrorOf([&] {
      const ckpt::OpenedSource s = Open(copy, GetParam().kind);  // the tools name the kind, as damage may hide it
      ckpt::ComputeFingerprints(*s.state, 4 << 20, only());
    });
    // A missing file may be named by the folder that lacks it (an NNM rank folder).
    const bool named = e.find(fs::path(file).filename().string()) != std::string::npos ||
                       (d == Damage::kRemoved && !rel.empty() && e.find(fs::path(file).parent_path().string() + ":") != std::string::npos);
    EXPECT_TRUE(named) << "damage " << static_cast<int>(d) << " of " << file << ": " << (e.empty() ? "accepted" : e);
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (const char* origin : {"fake", "nnm"})
    for (const char* kind : {origin, "tag", "h5", "hf"}) out.push_back({origin, kind});
  return out;
}

INSTANTIATE_TEST_SUITE_P(EveryReader, Conformance, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.origin + "_" + info.param.kind; });

TEST(AllSources, EveryRegisteredReaderHasAConformanceCase) {
  std::set<std::string> covered;
  for (const Case& c : Cases()) covered.insert(c.kind);
  const auto names = Registry().names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), covered);
  EXPECT_EQ(names.front(), "tag");  // detection tries the tag first, as every command did
}

// NxD's Mixtral (MoE) tags (tests/data/upstream/nxd_mixtral): detected as tags, and refused when
// opened, naming MoE, until a reader takes them (issue #38).
TEST(AllSources, MixtralTagsAreDetectedAsTagsAndRefusedNamingMoe) {
  auto* env = ckpt::Env::Default();
  for (const char* t : {"hf_ep1_pt/step_2", "hf_ep1_xser/step_2", "hf_ep2_pt/step_2", "hf_ep2_xser/step_2"}) {
    const std::string path = std::string(SHARDKIT_TEST_DATA "/upstream/nxd_mixtral/") + t;
    const ckpt::SourceKind* k = Registry().Detect(env, path);
    ASSERT_NE(k, nullptr) << path;
    EXPECT_EQ(k->name, "tag") << path;
    const std::string e = ErrorOf([&] { Registry().Open(env, path, {}); });
    EXPECT_NE(e.find("MoE"), std::string::npos) << path << ": " << (e.empty() ? "accepted" : e);
  }
}

}  // namespace
}  // namespace tools
