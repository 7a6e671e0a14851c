#include "migrate/interpolation.h"

#include <gtest/gtest.h>

#include "migrate/yaml_tree.h"

namespace migrate {

TEST(Interpolation, TargetsAbsoluteRelativeAndResolverArguments) {
  EXPECT_EQ(InterpolationTargets("${model.encoder_seq_length}", "model.data.seq_length"),
            std::vector<std::string>{"model.encoder_seq_length"});
  EXPECT_EQ(InterpolationTargets("${.encoder_seq_length}", "model.max_position_embeddings"),
            std::vector<std::string>{"model.encoder_seq_length"});
  EXPECT_EQ(InterpolationTargets("${..x}", "a.b.c"), std::vector<std::string>{"a.x"});
  EXPECT_EQ(InterpolationTargets("${multiply:${model.tensor_model_parallel_size}, ${model.pipeline_model_parallel_size}}",
                                 "exp_manager.checkpoint_callback_params.model_parallel_size"),
            (std::vector<std::string>{"model.tensor_model_parallel_size", "model.pipeline_model_parallel_size"}));
  EXPECT_EQ(InterpolationTargets("prefix-${a.b}-suffix", "k"), std::vector<std::string>{"a.b"});
  EXPECT_THROW(InterpolationTargets("${a.b", "k"), InputError);
}

TEST(Interpolation, RewriteFollowsMovesKeepsRelativeAndResolvesDropped) {
  auto relocate = [](const std::string& p) -> Relocation {
    if (p == "model.tensor_model_parallel_size") return {"distributed_strategy.tensor_model_parallel_size", ""};
    if (p == "model.pipeline_model_parallel_size") return {"distributed_strategy.pipeline_model_parallel_size", ""};
    if (p == "model.global_batch_size") return {"data.global_batch_size", ""};
    if (p == "model.gone") return {std::nullopt, "42"};
    return {p, ""};
  };
  const std::string k = "exp_manager.checkpoint_callback_params.model_parallel_size";
  EXPECT_EQ(RewriteInterpolations("${multiply:${model.tensor_model_parallel_size}, ${model.pipeline_model_parallel_size}}", k, k, relocate),
            "${multiply:${distributed_strategy.tensor_model_parallel_size}, ${distributed_strategy.pipeline_model_parallel_size}}");
  EXPECT_EQ(RewriteInterpolations("${model.global_batch_size}", "model.data.train_ds.global_batch_size",
                                  "data.train_ds.global_batch_size", relocate),
            "${data.global_batch_size}");
  // Key and target stay siblings: still relative.
  EXPECT_EQ(RewriteInterpolations("${.encoder_seq_length}", "model.max_position_embeddings", "model.max_position_embeddings", relocate),
            "${.encoder_seq_length}");
  // The key moved away from its sibling target: becomes absolute.
  EXPECT_EQ(RewriteInterpolations("${.global_batch_size}", "model.x", "other.x", relocate), "${data.global_batch_size}");
  EXPECT_EQ(RewriteInterpolations("n=${model.gone}", "model.k", "model.k", relocate), "n=42");
  EXPECT_EQ(SoleTarget("${.a}", "x.y"), "x.a");
  EXPECT_FALSE(SoleTarget("a${x}", "k").has_value());
}

}  // namespace migrate

namespace migrate {

TEST(Interpolation, ResolveGivesValuesWithTheirTypes) {
  YAML::Node n = LoadYaml(
      "model:\n  seq: 128\n  pos: ${.seq}\n  tp: 2\n  pp: 3\n  name: 'x'\n"
      "data:\n  seq_length: ${model.pos}\n  label: run-${model.name}-${model.seq}\n  mp: ${multiply:${model.tp}, ${model.pp}}\n",
      "c.yaml");
  YAML::Node r = ResolveInterpolations(n);
  EXPECT_EQ(Find(r, "data.seq_length").Scalar(), "128");
  EXPECT_EQ(Find(r, "data.label").Scalar(), "run-x-128");
  EXPECT_EQ(Find(r, "data.mp").Scalar(), "6");
  EXPECT_THROW(ResolveInterpolations(LoadYaml("a: ${b}\nb: ${a}\n", "c")), InputError);
  EXPECT_THROW(ResolveInterpolations(LoadYaml("a: ${oops:1}\n", "c")), InputError);
}

}  // namespace migrate

namespace migrate {

// "a0: x" and a1..a<n>, each holding `copies` references to the one before: a<n> expands to copies^n times "x".
std::string Chain(int n, int copies) {
  std::string text = "a0: x\n";
  for (int i = 1; i <= n; ++i) {
    text += "a" + std::to_string(i) + ": '";
    for (int c = 0; c < copies; ++c) text += "${a" + std::to_string(i - 1) + "}";
    text += "'\n";
  }
  return text;
}

std::string ErrorOfResolving(const std::string& yaml) {
  try {
    ResolveInterpolations(LoadYaml(yaml, "c.yaml"));
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Interpolation, ABlowUpFailsFastNamingTheKey) {
  // About 500 bytes that expand to 10^9 bytes (the bad-input sweep's case took minutes and gigabytes).
  const std::string e = ErrorOfResolving(Chain(9, 10));
  EXPECT_NE(e.find("key 'a7': its interpolation expands past 1 MiB (the bound on one value)"), std::string::npos) << e;
  // The same through a sole reference to a sequence of them, and with empty values (no bytes, but
  // exponentially many references): targets are resolved once, so this ends at once.
  EXPECT_NE(ErrorOfResolving("b: ['${a9}']\n" + Chain(9, 10)).find("key 'a7'"), std::string::npos);
  std::string empty = Chain(60, 2);
  empty.replace(0, 5, "a0: ''");
  EXPECT_NO_THROW(ResolveInterpolations(LoadYaml(empty, "c.yaml")));
}

TEST(Interpolation, AValueMayExpandToItsBoundAndTheConfigToItsOwn) {
  const std::string kib(1024, 'x');
  // 1024 references to 1 KiB: exactly 1 MiB, accepted; one more is past the bound.
  auto refs = [](int n) {
    std::string s = "'";
    for (int i = 0; i < n; ++i) s += "${k}";
    return s + "'";
  };
  YAML::Node r = ResolveInterpolations(LoadYaml("k: " + kib + "\nv: " + refs(1024) + "\n", "c.yaml"));
  EXPECT_EQ(Find(r, "v").Scalar().size(), kMaxInterpolatedValueBytes);
  EXPECT_NE(ErrorOfResolving("k: " + kib + "\nv: " + refs(1025) + "\n").find("key 'v': its interpolation expands past 1 MiB"),
            std::string::npos);
  // Values each within the bound, but together past the config's.
  std::string many = "k: " + kib + "\nbig: " + refs(1000) + "\n";
  const size_t keys = kMaxInterpolatedConfigBytes / (1000 * 1024) + 1;
  for (size_t i = 0; i < keys; ++i) many += "c" + std::to_string(i) + ": ${big}\n";
  const std::string e = ErrorOfResolving(many);
  EXPECT_NE(e.find("interpolations expand the config past 4 MiB"), std::string::npos) << e;
  // Sole references to a mapping count its whole tree: 2^k copies of a small mapping through k keys.
  std::string tree = "m0: {a: 1, b: 2}\n";
  for (int i = 1; i <= 40; ++i) tree += "m" + std::to_string(i) + ": ['${m" + std::to_string(i - 1) + "}', '${m" + std::to_string(i - 1) + "}']\n";
  EXPECT_NE(ErrorOfResolving(tree).find("its interpolation expands past 1 MiB"), std::string::npos) << ErrorOfResolving(tree);
}

TEST(Interpolation, CyclesAndDeepNestingAreRefusedAtOnce) {
  EXPECT_NE(ErrorOfResolving("a: '${b}${b}${b}'\nb: '${a}${a}${a}'\n").find("cycle"), std::string::npos);
  EXPECT_NE(ErrorOfResolving("m: {x: '${m}'}\n").find("cycle through 'm'"), std::string::npos);
  std::string nested = "a: '";
  for (int i = 0; i < 100000; ++i) nested += "${multiply:";
  nested += "1";
  for (int i = 0; i < 100000; ++i) nested += "}";
  EXPECT_NE(ErrorOfResolving(nested + "'\n").find("nested deeper than 32"), std::string::npos);
}

TEST(Interpolation, ATargetReferredToOftenIsResolvedOnceAndKeepsItsValue) {
  std::string text = "base: {n: 7, s: '${.n}-${.n}'}\n";
  for (int i = 0; i < 200; ++i) text += "k" + std::to_string(i) + ": ${base}\n";
  YAML::Node r = ResolveInterpolations(LoadYaml(text, "c.yaml"));
  EXPECT_EQ(Find(r, "k199.s").Scalar(), "7-7");
  EXPECT_EQ(Find(r, "k0.n").Scalar(), "7");
  // A top-level key spelled like a nested path is not taken for it.
  r = ResolveInterpolations(LoadYaml("a: {b: 2}\n'a.b': 1\nx: ${a.b}\ny: ${a}\n", "c.yaml"));
  EXPECT_EQ(Find(r, "x").Scalar(), "2");
  EXPECT_EQ(Find(r, "y.b").Scalar(), "2");
}

}  // namespace migrate
