#include "libtrain/hdf5_dataset.h"

#include <gtest/gtest.h>
#include <hdf5.h>

#include <fstream>

#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace train {
namespace {

TEST(Hdf5Dataset, WriteThenReadSlices) {
  ckpt::testing::TempDir d("h5");
  std::vector<int32_t> tokens(1000);
  for (int i = 0; i < 1000; ++i) tokens[i] = i * 7 % 257;
  Hdf5Dataset::Write(d / "t.h5", tokens);
  Hdf5Dataset ds(d / "t.h5");
  EXPECT_EQ(ds.num_tokens(), 1000);
  std::vector<int32_t> out(10);
  ds.ReadTokens(990, 10, out.data());
  EXPECT_EQ(out, std::vector<int32_t>(tokens.begin() + 990, tokens.end()));
  EXPECT_THROW(ds.ReadTokens(995, 10, out.data()), ckpt::Error);
}

TEST(Hdf5Dataset, ReadsAFileWrittenDirectlyWithAnyIntegerType) {
  // Written with the HDF5 API itself, uint16 ids under another name.
  ckpt::testing::TempDir d("h5");
  const std::string path = d / "u16.h5";
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const hsize_t dims[1] = {5};
  const hid_t space = H5Screate_simple(1, dims, nullptr);
  const hid_t ds = H5Dcreate2(f, "input_ids", H5T_STD_U16LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  const uint16_t ids[5] = {1, 65535, 3, 4, 5};
  H5Dwrite(ds, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids);
  H5Dclose(ds), H5Sclose(space), H5Fclose(f);
  Hdf5Dataset h(path);
  std::vector<int32_t> out(5);
  h.ReadTokens(0, 5, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 65535, 3, 4, 5}));
}

TEST(Hdf5Dataset, BadFilesAreNamed) {
  ckpt::testing::TempDir d("h5");
  auto error = [](const std::string& p) {
    try {
      Hdf5Dataset h(p);
    } catch (const ckpt::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error(d / "none.h5"), d / "none.h5" + ": missing (data_prefix names an HDF5 file)");
  std::ofstream(d / "text.h5") << "not hdf5";
  EXPECT_EQ(error(d / "text.h5"), d / "text.h5" + ": not an HDF5 file");
  const hid_t f = H5Fcreate((d / "empty.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  H5Fclose(f);
  EXPECT_EQ(error(d / "empty.h5"), d / "empty.h5" + ": must hold exactly one dataset of token ids, found 0");
}

}  // namespace
}  // namespace train
