#include "migrate/overrides.h"

#include <gtest/gtest.h>

namespace migrate {

std::string OverrideError(const std::string& arg, const std::string& yaml = "model:\n  x: 1\n") {
  try {
    YAML::Node n = LoadYaml(yaml, "c.yaml");
    ApplyOverrides(n, {ParseOverride(arg)});
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Overrides, SetAddForceDeleteWithTypedValues) {
  YAML::Node n = LoadYaml("model:\n  x: 1\n  optim:\n    betas: [0.9, 0.98]\ntrainer:\n  max_epochs: -1\n", "c");
  ApplyOverrides(n, {ParseOverride("model.x=8"), ParseOverride("model.optim.betas=[0.9,0.95]"),
                     ParseOverride("+model.save_xser=False"), ParseOverride("trainer.max_epochs=null"),
                     ParseOverride("++model.tokenizer.type='/root/7b-hf'"), ParseOverride("~model.x")});
  EXPECT_FALSE(Has(n, "model.x"));
  EXPECT_EQ(Find(n, "model.optim.betas").size(), 2u);
  EXPECT_EQ(Find(n, "model.optim.betas")[1].Scalar(), "0.95");
  EXPECT_EQ(Find(n, "model.save_xser").Scalar(), "False");
  EXPECT_TRUE(Find(n, "trainer.max_epochs").IsNull());
  EXPECT_EQ(Find(n, "model.tokenizer.type").Scalar(), "/root/7b-hf");
  EXPECT_TRUE(IsQuoted(Find(n, "model.tokenizer.type")));
}

TEST(Overrides, MalformedAndInapplicableOverridesAreNamed) {
  EXPECT_EQ(OverrideError("model.x"), "override 'model.x': missing '=value'");
  EXPECT_EQ(OverrideError("=3"), "override '=3': '' is not a dotted key path (expected e.g. model.num_layers=32)");
  EXPECT_EQ(OverrideError("model..x=3"), "override 'model..x=3': 'model..x' is not a dotted key path (expected e.g. model.num_layers=32)");
  EXPECT_EQ(OverrideError("~model.x=1"), "override '~model.x=1': a deletion (~key) takes no value");
  EXPECT_NE(OverrideError("model.x=[1,").find("override 'model.x=[1,': value '[1,' does not parse"), std::string::npos);
  EXPECT_EQ(OverrideError("model.y=2"), "override 'model.y=2': key 'model.y' is not in the config (use +model.y=2 to add it)");
  EXPECT_EQ(OverrideError("+model.x=2"), "override '+model.x=2': key 'model.x' already exists (drop the '+' to change it)");
  EXPECT_EQ(OverrideError("~model.q"), "override '~model.q': key 'model.q' is not in the config");
}

}  // namespace migrate
