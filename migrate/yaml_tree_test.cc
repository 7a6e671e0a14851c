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

TEST(YamlTree, ScalarKindsAreScannedWithoutRegexRecursion) {
  for (const char* s : {"0", "-12", "+7", "0012"}) EXPECT_TRUE(IsIntegerText(s)) << s;
  for (const char* s : {"", "-", "1.0", "1e3", " 1", "0x10"}) EXPECT_FALSE(IsIntegerText(s)) << s;
  for (const char* s : {"1", "1.", "1.5", ".5", "-2.5e-3", "3E+2", ".inf", "-.Inf", "inf", ".nan", "NaN"})
    EXPECT_TRUE(IsNumberText(s)) << s;
  for (const char* s : {"", ".", "e3", "1e", "1.2.3", "--1", "1e3.5", "infinity"}) EXPECT_FALSE(IsNumberText(s)) << s;
  EXPECT_TRUE(IsBoolText("True"));
  EXPECT_FALSE(IsBoolText("yes"));
  // A million digits: std::regex overflowed the stack here.
  EXPECT_TRUE(IsIntegerText(std::string(1000000, '7')));
  EXPECT_FALSE(IsNumberText(std::string(1000000, '7') + "x"));
}

TEST(YamlTree, AliasCyclesBombsAndDepthAreRefused) {
  auto error = [](const std::string& text) {
    try {
      LoadYaml(text, "t.yaml");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error("model: &a {x: *a}\n").find("t.yaml:1: an alias refers to a node that contains it"), std::string::npos);
  std::string bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1]\n";
  for (char c = 'b'; c <= 'k'; ++c)
    bomb += std::string(1, c) + ": &" + c + " [" + std::string("*") + char(c - 1) + ", *" + char(c - 1) + ", *" + char(c - 1) +
            ", *" + char(c - 1) + "]\n";
  EXPECT_NE(error(bomb).find("once its aliases are expanded"), std::string::npos);
  EXPECT_NE(error("model: " + std::string(3000, '[') + std::string(3000, ']')).find("levels deep"), std::string::npos);
  std::string block = "model:\n";
  for (int i = 1; i < 80; ++i) block += std::string(2 * i, ' ') + "k:\n";
  EXPECT_NE(error(block).find("nested more than 64 levels"), std::string::npos);
  // Shared aliases well inside the bounds are fine.
  EXPECT_EQ(error("base: &b {lr: 1}\nmodel: {optim: *b, other: *b}\n"), "");
}

}  // namespace migrate
