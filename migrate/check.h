// Validation of an NxDT config (nnm2nxdt-config --check, and the migration's
// check of its own output): required sections, the types of known keys,
// mandatory values still '???', and the arithmetic that holds at any world
// size: global_batch_size is a multiple of micro_batch_size, num_layers splits
// over pp (or pipeline_cuts are given), heads over KV heads. Each problem is
// one precise line.
#pragma once

#include <string>
#include <vector>

#include "migrate/yaml_tree.h"

namespace migrate {

std::vector<std::string> CheckNxdt(const YAML::Node& config);

// The arithmetic of the world size the config names (trainer.devices *
// trainer.num_nodes): tp * pp divides it, and global_batch_size is a multiple
// of micro_batch_size * dp. Launch scripts set these sizes (NNM's
// mistral_7b.sh passes trainer.devices, trainer.num_nodes and both batch sizes
// as overrides; its megatron_mistral_config.yaml names 32 x 2 devices with a
// global batch of 8), and NxD checks them when the job starts. So a mismatch
// is reported as to be settled at launch, not as an error.
std::vector<std::string> CheckAtLaunch(const YAML::Node& config);

// The keys whose value is OmegaConf's mandatory marker `???`: NNM's example
// configs leave data.data_prefix so, and NxDT's Hydra launch takes it as NNM's
// did, from an override when training starts. Not a problem, but to be set.
std::vector<std::string> SetAtLaunch(const YAML::Node& config);

}  // namespace migrate
