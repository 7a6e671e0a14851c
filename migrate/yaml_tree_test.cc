#include "migrate/yaml_tree.h"

#include <gtest/gtest.h>

namespace migrate {

std::string ErrorOf(const std::string& text) {
  try {
    LoadYaml(text, "c.yaml");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(YamlTree, BadDocumentsNameFileLineAndKey) {
  EXPECT_EQ(ErrorOf("a: 1\nmodel:\n  x: 1\n  y: 2\n  x: 3\n"), "c.yaml:5: duplicate key 'model.x'");
  EXPECT_EQ(ErrorOf("- 1\n- 2\n"), "c.yaml: the top level must be a mapping of config sections, not a list");
  EXPECT_EQ(ErrorOf(""), "c.yaml: the top level must be a mapping of config sections, not an empty document");
  EXPECT_NE(ErrorOf("a: [1, 2\nb: 3\n").find("c.yaml:"), std::string::npos);
  EXPECT_NE(ErrorOf("a: [1, 2\nb: 3\n").find("not valid YAML"), std::string::npos);
}

TEST(YamlTree, EmitKeepsTypesAndStyles) {
  const std::string in =
      "a:\n  lr: 3e-4\n  s: '0'\n  n: null\n  t: ~\n  flow: [1.0, /data/x]\n  block:\n  - 0.9\n  - 0.95\n  e: ''\n"
      "  q: 'it''s'\n  ok: True\n";
  YAML::Node n = LoadYaml(in, "x");
  const std::string out = EmitYaml(n);
  EXPECT_EQ(out,
            "a:\n  lr: 3e-4\n  s: '0'\n  n: null\n  t: null\n  flow: [1.0, /data/x]\n  block:\n    - 0.9\n    - 0.95\n"
            "  e: ''\n  q: 'it''s'\n  ok: True\n");
  // What we emit reads back the same.
  YAML::Node back = LoadYaml(out, "y");
  EXPECT_EQ(EmitYaml(back), out);
  EXPECT_TRUE(IsQuoted(Find(back, "a.s")));
  EXPECT_TRUE(Find(back, "a.n").IsNull());
}

TEST(YamlTree, PathsSetFindErase) {
  YAML::Node n = LoadYaml("a:\n  b: 1\n", "x");
  Set(n, "a.c.d", YAML::Node(5));
  Set(n, "z", YAML::Node("top"));
  EXPECT_EQ(Find(n, "a.c.d").as<int>(), 5);
  EXPECT_FALSE(Has(n, "a.q"));
  EXPECT_FALSE(Has(n, "a.b.c"));
  EXPECT_TRUE(Erase(n, "a.b"));
  EXPECT_FALSE(Erase(n, "a.b"));
  std::vector<std::string> leaves;
  Leaves(n, "", &leaves);
  EXPECT_EQ(leaves, (std::vector<std::string>{"a.c.d", "z"}));
}

}  // namespace migrate
