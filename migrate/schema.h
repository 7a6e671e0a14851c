// What migration knows about the two schemas:
//  - NxDT's own NNM -> NxDT mapping table (data/nnm_nxdt_mapping.csv,
//    compiled in), one rule per NNM key;
//  - the NxDT config schema: sections in NxDT's order and the keys each
//    holds with their types (from NxDT's reference configs), used to keep
//    unlisted keys that NxDT also has, to order the output and by --check.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace migrate {

struct MappingRow {
  std::string section;  // "", "trainer", "exp_manager" or "model"
  std::string key;
  std::string mapping;  // the table's NxDT column, as written
  std::string comment;
};

// The rows of NxDT's mapping table, in order.
const std::vector<MappingRow>& MappingTable();

enum class ValueType { kAny, kInt, kNumber, kBool, kString, kMap, kList };

struct SchemaKey {
  std::string path;  // e.g. "distributed_strategy.tensor_model_parallel_size"
  ValueType type;
  bool nullable;
};

// NxDT top-level sections in the order NxDT's configs use.
const std::vector<std::string>& NxdtSectionOrder();
// NxDT keys in reference order (leaves and the mappings that hold them).
const std::vector<SchemaKey>& NxdtSchema();
std::optional<SchemaKey> NxdtKey(const std::string& path);
// Index of `path` in NxDT's order (for sorting), or -1.
int NxdtOrder(const std::string& path);

}  // namespace migrate
