// ckpt-sample DIR [--steps N] [--save-top-k K]: writes a small Llama-shaped
// checkpoint (TP=PP=DP=1) through the checkpoint store: NxDT tags
// sample--step=S-consumed_samples=C.ckpt with model/, optim/, scheduler.pt,
// user_content.pt, manifest.json and done. A test-only program: the interop
// tests read, inspect, corrupt and verify what it writes.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>

#include "ckpt/store/checkpoint_store.h"
#include "tools/common/cli.h"
#include "ckpt/util/env.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/training_state.h"

using ckpt::DType;
using ckpt::Tensor;
using ckpt::Value;

namespace {

Tensor Random(std::mt19937& rng, DType dt, std::vector<int64_t> shape, float std) {
  Tensor t = Tensor::Zeros(dt, std::move(shape));
  std::normal_distribution<float> dist(0.f, std);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    float x = dist(rng);
    if (dt == DType::kFloat32) {
      reinterpret_cast<float*>(t.mutable_data())[i] = x;
    } else {  // bfloat16: the top half of the float32 bits, rounded to nearest even
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      bits += 0x7fff + ((bits >> 16) & 1);
      reinterpret_cast<uint16_t*>(t.mutable_data())[i] = static_cast<uint16_t>(bits >> 16);
    }
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a sample Llama-shaped checkpoint in the NxDT layout"};
  std::string dir;
  int layers = 2, hidden = 64, vocab = 256, steps = 1, top_k = -1;
  app.add_option("dir", dir, "checkpoint directory (tags are created inside)")->required();
  app.add_option("--steps", steps, "how many tags to write (steps 1..N)")->check(CLI::Range(1, 1000));
  app.add_option("--save-top-k", top_k, "keep only the newest K tags");
  app.add_option("--layers", layers)->check(CLI::Range(1, 64));
  app.add_option("--hidden", hidden)->check(CLI::Range(8, 8192));
  app.add_option("--vocab", vocab)->check(CLI::Range(8, 1 << 20));
  SHARDKIT_PARSE(app, argc, argv);
  try {
    std::mt19937 rng(1234);
    const int64_t H = hidden, F = hidden * 8 / 3, V = vocab;
    Value model = Value::NewDict();
    auto& m = model.as_dict();
    std::vector<std::string> names;
    auto add = [&](const std::string& name, Tensor t) {
      names.push_back(name);
      m.Set(name, Value(std::move(t)));
    };
    add("language_model.embedding.word_embeddings.weight", Random(rng, DType::kBFloat16, {V, H}, 0.02f));
    for (int l = 0; l < layers; ++l) {
      const std::string p = "language_model.encoder.layers." + std::to_string(l) + ".";
      add(p + "input_layernorm.weight", Random(rng, DType::kBFloat16, {H}, 0.f));
      add(p + "self_attention.query_key_value.weight", Random(rng, DType::kBFloat16, {3 * H, H}, 0.02f));
      add(p + "self_attention.dense.weight", Random(rng, DType::kBFloat16, {H, H}, 0.02f));
      add(p + "post_attention_layernorm.weight", Random(rng, DType::kBFloat16, {H}, 0.f));
      add(p + "mlp.dense_h_to_4h.weight", Random(rng, DType::kBFloat16, {2 * F, H}, 0.02f));
      add(p + "mlp.dense_4h_to_h.weight", Random(rng, DType::kBFloat16, {H, F}, 0.02f));
    }
    add("language_model.encoder.final_layernorm.weight", Random(rng, DType::kBFloat16, {H}, 0.f));
    add("language_model.output_layer.weight", Random(rng, DType::kBFloat16, {V, H}, 0.02f));

    // A torch.optim AdamW state dict: moments in fp32, positional parameter ids, one group.
    ckpt::OptimizerFile of;
    Value ids = Value::List();
    for (size_t i = 0; i < names.size(); ++i) {
      const auto& shape = m.At(names[i]).as_tensor().shape();
      ckpt::ParamState ps;
      Tensor step = Tensor::Zeros(DType::kFloat32, {});
      reinterpret_cast<float*>(step.mutable_data())[0] = 1.f;
      ps.step = Value(step);
      ps.exp_avg = Value(Random(rng, DType::kFloat32, shape, 1e-3f));
      ps.exp_avg_sq = Value(Random(rng, DType::kFloat32, shape, 1e-6f));
      ps.shape = shape;
      of.params.push_back(std::move(ps));
      ids.as_seq().items.push_back(Value(static_cast<int64_t>(i)));
    }
    Value group = Value::NewDict();
    for (auto [k, v] : std::vector<std::pair<const char*, Value>>{
             {"lr", Value(3e-4)}, {"betas", Value::Tuple({Value(0.9), Value(0.95)})}, {"eps", Value(1e-8)},
             {"weight_decay", Value(0.1)}, {"amsgrad", Value(false)}, {"maximize", Value(false)}})
      group.as_dict().Set(k, v);
    group.as_dict().Set("params", ids);
    of.param_groups = Value::List({group});
    const Value optim = of.ToValue();

    ckpt::CheckpointStore store({.dir = dir, .save_top_k = top_k, .log = [](const std::string& l) { std::cout << l << "\n"; }});
    for (int step = 1; step <= steps; ++step) {
      ckpt::Snapshot snap;
      snap.tag = {"sample", step, static_cast<double>(step * 8), false};
      ckpt::SchedulerState sched;
      sched.last_epoch = step;
      sched.carried = {{"_step_count", Value(static_cast<int64_t>(step + 1))}};
      const ckpt::UserContent user{.epoch = 0, .global_step = step, .consumed_samples = static_cast<double>(step * 8), .carried = {}};
      snap.files = {{ckpt::RankFilePath(ckpt::RankFileKind::kModel, {}), model, {.weights_only = true}},
                    {ckpt::RankFilePath(ckpt::RankFileKind::kOptim, {}), optim, {}},
                    {ckpt::kSchedulerFile, sched.ToValue(), {}},
                    {ckpt::kUserContentFile, user.ToValue(), {}}};
      store.Save(std::move(snap));
    }
    store.Finalize();
    std::cout << "ckpt-sample: " << names.size() << " parameters and their AdamW state, " << steps << " tag(s) in " << dir << "\n";
    return 0;
  } catch (const ckpt::Error& e) {
    std::cerr << "ckpt-sample: " << e.what() << "\n";
    return 1;
  }
}
