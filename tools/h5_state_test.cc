// The layout-free HDF5 export: a state written and read back is the same
// logical state, element for element; a file that is not one is refused,
// naming it.
#include "tools/h5_state.h"

#include <gtest/gtest.h>

#include <fstream>

#include "ckpt/shard/fake_state.h"
#include "ckpt/shard/tag_compare.h"
#include "ckpt/testing/test_util.h"

namespace tools {
namespace {

using ckpt::testing::ErrorOf;
using ckpt::testing::FakeState;
using ckpt::testing::SmallLlama;
using ckpt::testing::TempDir;

TEST(H5State, WrittenAndReadBackIsTheSameState) {
  TempDir dir("h5_state");
  const FakeState src(dir / "src", SmallLlama());
  ExportOptions opts;
  opts.weights_only = true;
  opts.block = 4096;  // many blocks per tensor
  const ExportSummary sum = WriteH5State(src, "src", dir / "state.h5", opts);
  EXPECT_EQ(sum.tensors, src.params().size());
  EXPECT_TRUE(IsH5State(dir / "state.h5"));
  const auto back = H5State::Open(dir / "state.h5");
  EXPECT_EQ(back->layout().format.heads, 4);
  EXPECT_EQ(back->layout().format.kv_heads, 2);
  EXPECT_EQ(back->step(), src.step());
  const ckpt::CompareReport r = ckpt::CompareTags(src, *back);
  EXPECT_TRUE(r.differences.empty()) << r.differences[0].name << ": " << r.differences[0].what;
  EXPECT_EQ(r.tensors, src.params().size());
}

TEST(H5State, AFileThatIsNotAnExportIsRefusedNamingIt) {
  TempDir dir("h5_state");
  std::ofstream(dir / "not.h5") << "plain text";
  EXPECT_FALSE(IsH5State(dir / "not.h5"));
  EXPECT_NE(ErrorOf([&] { H5State::Open(dir / "not.h5"); }).find(dir / "not.h5"), std::string::npos);
}

}  // namespace
}  // namespace tools
