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
