// The source registry: entries are found by name or by detection, a path no
// entry claims (or several claim) is refused naming it, and the process's
// registry opens a tag through the tag entry as ShardedTag::Open does.
#include "ckpt/shard/source_registry.h"

#include <gtest/gtest.h>

#include <fstream>

#include "ckpt/shard/fake_state.h"
#include "ckpt/shard/tag_compare.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;
using testing::TempDir;

// An entry claiming paths that end in `suffix`, opening them as the fake.
SourceKind EndsWith(const std::string& name, const std::string& suffix) {
  SourceKind k = testing::FakeSourceKind();
  k.name = name;
  k.detect = [suffix](Env*, const std::string& p) { return p.ends_with(suffix); };
  return k;
}

TEST(SourceRegistry, FindsAnEntryByNameOrByDetection) {
  TempDir dir("registry");
  std::ofstream(dir / "a.fake");
  SourceRegistry r;
  r.Add(EndsWith("fake", ".fake"));
  r.Add(EndsWith("other", ".other"));
  EXPECT_EQ(r.names(), (std::vector<std::string>{"fake", "other"}));
  ASSERT_NE(r.Find("other"), nullptr);
  EXPECT_EQ(r.Find("other")->name, "other");
  EXPECT_EQ(r.Find("tag"), nullptr);
  ASSERT_NE(r.Detect(Env::Default(), dir / "a.fake"), nullptr);
  EXPECT_EQ(r.Detect(Env::Default(), dir / "a.fake")->name, "fake");
  EXPECT_EQ(r.Detect(Env::Default(), dir / "a.pt"), nullptr);
  const OpenedSource s = r.Open(Env::Default(), dir / "a.fake", {});
  EXPECT_EQ(s.kind, "fake");
  EXPECT_EQ(s.state->path(), dir / "a.fake");
  EXPECT_EQ(s.state->params().size(), testing::FakeState("x", testing::SmallLlama()).params().size());
}

TEST(SourceRegistry, RefusesWhatItCannotPlaceNamingThePath) {
  TempDir dir("registry");
  SourceRegistry r;
  r.Add(EndsWith("fake", ".fake"));
  EXPECT_NE(ErrorOf([&] { r.Add(EndsWith("fake", ".other")); }).find("'fake': registered twice"), std::string::npos);
  SourceKind no_open = EndsWith("half", ".half");
  no_open.open = nullptr;
  EXPECT_NE(ErrorOf([&] { r.Add(no_open); }).find("needs a name, a detect and an open function"), std::string::npos);
  const std::string e = ErrorOf([&] { r.Open(Env::Default(), dir / "x.pt", {}); });
  EXPECT_NE(e.find(dir / "x.pt" + ": is not a checkpoint source"), std::string::npos) << e;
  EXPECT_NE(e.find("known: fake"), std::string::npos) << e;
  const std::string k = ErrorOf([&] { r.Open(Env::Default(), dir / "x.fake", {}, "hdf9"); });
  EXPECT_NE(k.find("no reader of kind 'hdf9'"), std::string::npos) << k;
  r.Add(EndsWith("greedy", "e"));  // claims x.fake too
  const std::string both = ErrorOf([&] { r.Detect(Env::Default(), dir / "x.fake"); });
  EXPECT_NE(both.find(dir / "x.fake" + ": could be any of these kinds of source: fake, greedy"), std::string::npos) << both;
}

TEST(SourceRegistry, TheDefaultOpensATagAsShardedTagDoes) {
  TempDir dir("registry");
  const testing::FakeState src(dir / "src", testing::SmallLlama());
  ReshardArgs a;
  a.tp = 2, a.pp = 2;
  testing::WriteFake(src, dir / "tag", a);
  const SourceRegistry& r = SourceRegistry::Default();
  EXPECT_EQ(r.names().front(), "tag");
  ASSERT_NE(r.Detect(Env::Default(), dir / "tag"), nullptr);
  EXPECT_EQ(r.Detect(Env::Default(), dir / "tag")->name, "tag");
  EXPECT_EQ(r.Detect(Env::Default(), dir.path()), nullptr);  // a folder holding a tag is not one
  const OpenedSource s = r.Open(Env::Default(), dir / "tag/", {});
  EXPECT_EQ(s.kind, "tag");
  EXPECT_EQ(s.tag_name, "tag");
  EXPECT_GT(s.bytes, 0u);
  EXPECT_EQ(s.state->layout().grid.tp, 2);
  EXPECT_EQ(s.state->layout().grid.pp, 2);
  const CompareReport cmp = CompareTags(src, *s.state);
  EXPECT_TRUE(cmp.differences.empty());
  EXPECT_EQ(cmp.tensors, src.params().size());
}

}  // namespace
}  // namespace ckpt
