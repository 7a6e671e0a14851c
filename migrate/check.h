// Validation of an NxDT config (nnm2nxdt-config --check, and the migration's
// check of its own output): required sections, the types of known keys,
// mandatory values still '???', and the parallel-layout arithmetic:
// tp * pp divides trainer.devices * num_nodes, global_batch_size is a multiple
// of micro_batch_size * dp, num_layers splits over pp (or pipeline_cuts are
// given) and num_attention_heads over tp. Each problem is one precise line.
#pragma once

#include <string>
#include <vector>

#include "migrate/yaml_tree.h"

namespace migrate {

std::vector<std::string> CheckNxdt(const YAML::Node& config);

// The keys whose value is OmegaConf's mandatory marker `???`: NNM's example
// configs leave data.data_prefix so, and NxDT's Hydra launch takes it as NNM's
// did, from an override when training starts. Not a problem, but to be set.
std::vector<std::string> SetAtLaunch(const YAML::Node& config);

}  // namespace migrate
