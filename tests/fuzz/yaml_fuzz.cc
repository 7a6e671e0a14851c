// libFuzzer target for every path a YAML config takes: the migration
// (nnm2nxdt-config), --check, and the training config (shardkit-train),
// overrides included. migrate::InputError and ckpt::Error are correct
// rejections; a crash, a hang (aliases), UB, a leak or any other exception
// is a finding.
#include <cstdint>
#include <string>

#include "ckpt/util/error.h"
#include "libtrain/train_config.h"
#include "migrate/check.h"
#include "migrate/migrate.h"
#include "migrate/overrides.h"
#include "migrate/yaml_tree.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    YAML::Node nnm = migrate::LoadYaml(text, "fuzz.yaml");
    migrate::CheckNxdt(nnm);
    migrate::ApplyOverrides(nnm, {migrate::ParseOverride("+model.fuzz=[1, ${model.num_layers}]")});
    const migrate::Migration m = migrate::Migrate(nnm, {});
    migrate::EmitYaml(m.config);
    m.report.ToJson().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const migrate::InputError&) {
  } catch (const ckpt::Error&) {
  }
  try {
    train::ParseTrainConfig(text, "/nonexistent/fuzz.yaml", {});
  } catch (const migrate::InputError&) {
  } catch (const ckpt::Error&) {
  }
  return 0;
}
