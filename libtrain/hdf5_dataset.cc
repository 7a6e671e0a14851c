#include "libtrain/hdf5_dataset.h"

#include <hdf5.h>
#include <unistd.h>

#include <cstdio>
#include <mutex>

#include "ckpt/util/env.h"
#include "ckpt/util/error.h"
#include "ckpt/util/hdf5_lock.h"

namespace train {
namespace {

// Names of the datasets directly under the root group.
herr_t CollectDatasets(hid_t group, const char* name, const H5L_info_t*, void* out) {
  H5O_info_t info;
  if (H5Oget_info_by_name2(group, name, &info, H5O_INFO_BASIC, H5P_DEFAULT) >= 0 && info.type == H5O_TYPE_DATASET)
    static_cast<std::vector<std::string>*>(out)->push_back(name);
  return 0;
}

}  // namespace

Hdf5Dataset::Hdf5Dataset(const std::string& path) : path_(path) {
  std::lock_guard<std::mutex> l(ckpt::Hdf5Lock());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors come back as codes, reported by us
  if (::access(path.c_str(), R_OK) != 0) throw ckpt::Error(path + ": missing (data_prefix names an HDF5 file)");
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) throw ckpt::Error(path + ": not an HDF5 file");
  file_ = f;
  std::vector<std::string> names;
  H5Literate(f, H5_INDEX_NAME, H5_ITER_INC, nullptr, CollectDatasets, &names);
  if (names.size() != 1) {
    H5Fclose(f);
    throw ckpt::Error(path + ": must hold exactly one dataset of token ids, found " + std::to_string(names.size()));
  }
  dataset_name_ = names[0];
  const hid_t d = H5Dopen2(f, names[0].c_str(), H5P_DEFAULT);
  const hid_t type = H5Dget_type(d), space = H5Dget_space(d);
  const bool integer = H5Tget_class(type) == H5T_INTEGER;
  const int rank = H5Sget_simple_extent_ndims(space);
  hsize_t dims[1] = {0};
  if (rank == 1) H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Tclose(type);
  H5Sclose(space);
  if (!integer || rank != 1) {
    H5Dclose(d);
    H5Fclose(f);
    throw ckpt::Error(path + ": dataset '" + names[0] + "' must be one-dimensional integer token ids");
  }
  dataset_ = d;
  total_ = static_cast<int64_t>(dims[0]);
}

Hdf5Dataset::~Hdf5Dataset() {
  std::lock_guard<std::mutex> l(ckpt::Hdf5Lock());
  if (dataset_ >= 0) H5Dclose(dataset_);
  if (file_ >= 0) H5Fclose(file_);
}

void Hdf5Dataset::ReadTokens(int64_t pos, int64_t count, int32_t* out) const {
  if (pos < 0 || count < 0 || pos + count > total_) throw ckpt::Error(path_ + ": token range out of bounds");
  std::lock_guard<std::mutex> l(ckpt::Hdf5Lock());
  const hid_t file_space = H5Dget_space(dataset_);
  const hsize_t start[1] = {static_cast<hsize_t>(pos)}, n[1] = {static_cast<hsize_t>(count)};
  H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start, nullptr, n, nullptr);
  const hid_t mem_space = H5Screate_simple(1, n, nullptr);
  const herr_t rc = H5Dread(dataset_, H5T_NATIVE_INT32, mem_space, file_space, H5P_DEFAULT, out);
  H5Sclose(mem_space);
  H5Sclose(file_space);
  if (rc < 0) throw ckpt::Error(path_ + ": cannot read tokens " + std::to_string(pos) + ".." + std::to_string(pos + count));
}

void Hdf5Dataset::Write(const std::string& path, const std::vector<int32_t>& tokens) {
  const std::string tmp = ckpt::TempPathFor(path);
  {
    std::lock_guard<std::mutex> l(ckpt::Hdf5Lock());
    const hid_t f = H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (f < 0) throw ckpt::Error(path + ": cannot create HDF5 file");
    const hsize_t dims[1] = {tokens.size()};
    const hid_t space = H5Screate_simple(1, dims, nullptr);
    const hid_t d = H5Dcreate2(f, "tokens", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    const herr_t rc = H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data());
    H5Dclose(d);
    H5Sclose(space);
    H5Fflush(f, H5F_SCOPE_GLOBAL);
    H5Fclose(f);
    if (rc < 0) {
      std::remove(tmp.c_str());
      throw ckpt::Error(path + ": cannot write tokens");
    }
  }
  ckpt::Env::Default()->RenameFile(tmp, path);
}

}  // namespace train
