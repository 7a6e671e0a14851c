// train_reference_dump OUT_DIR [options]: builds a small model from its seed
// and writes OUT_DIR/weights.pt (its state dict, NxDT names). It then runs
// --steps training steps on one batch (forward, backward, gradient clipping,
// the learning-rate schedule, AdamW) and writes OUT_DIR/result.pt: the batch,
// the first step's logits, loss and gradients, every step's loss, lr and
// gradient norm, the final weights and the optimizer state dict, for a
// PyTorch reference (tests/interop/train_reference.py) to compare. With
// --mixed the weights are bfloat16 and the optimizer state is ZeRO-1's layout
// with float32 master weights.
#include <CLI/CLI.hpp>
#include <iostream>
#include <random>
#include <string>

#include "tools/common/cli.h"
#include "ckpt/util/error.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/snapshot.h"
#include "libtrain/model.h"
#include "libtrain/optimizer.h"

namespace train {
// The gradients before clipping changes them: cloned, not views.
ckpt::Value CopyForGradCheck(const Model& m) {
  ckpt::Value g = m.GradDict();
  for (auto& [k, v] : g.as_dict().items) v = ckpt::Value(v.as_tensor().Clone());
  return g;
}
}  // namespace train

namespace {
ckpt::Tensor Floats(const std::vector<float>& v, std::vector<int64_t> shape) {
  return ckpt::Tensor::FromBytes(ckpt::DType::kFloat32, std::move(shape),
                                 {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)});
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Dump a small model's training steps for the PyTorch reference test"};
  std::string dir;
  train::ModelConfig c;
  c.vocab = 64, c.hidden = 32, c.ffn = 48, c.heads = 4, c.kv_heads = 4, c.layers = 2;
  train::AdamWConfig opt;
  opt.lr = 1e-2;
  train::ScheduleConfig sched;
  sched.warmup_steps = 2, sched.max_steps = 6, sched.min_lr = 1e-3;
  int steps = 1;
  double clip = 1.0;
  app.add_option("dir", dir)->required();
  app.add_option("--kv-heads", c.kv_heads);
  app.add_option("--rotary", c.rotary_percentage);
  app.add_option("--rope-theta", c.rope_theta);
  app.add_option("--eps", c.eps);
  app.add_option("--steps", steps);
  app.add_option("--clip", clip);
  app.add_option("--sched", sched.name);
  app.add_option("--warmup", sched.warmup_steps);
  app.add_option("--constant", sched.constant_steps);
  app.add_option("--max-steps", sched.max_steps);
  app.add_option("--min-lr", sched.min_lr);
  app.add_flag("--decay-norms", opt.do_layer_norm_weight_decay);
  bool mixed = false, gpt = false;
  app.add_flag("--layernorm", c.layernorm);
  app.add_flag("--gelu", c.gelu);
  app.add_flag("--bias", c.bias);
  app.add_flag("--learned-positions", c.learned_positions);
  app.add_flag("--tied", c.tied_output);
  app.add_flag("--gpt", gpt, "all five of the above");
  float dropout = 0;
  uint64_t dropout_key = 0;
  app.add_option("--dropout", dropout, "hidden, attention and ffn dropout");
  app.add_option("--dropout-key", dropout_key);
  app.add_flag("--mixed", mixed, "mixed_precision: bfloat16 parameters, float32 master weights, ZeRO-1 optimizer layout");
  SHARDKIT_PARSE(app, argc, argv);
  c.bf16_params = opt.master_weights = opt.zero1 = opt.master_weights_in_ckpt = mixed;
  if (gpt) c.layernorm = c.gelu = c.bias = c.learned_positions = c.tied_output = true;
  c.hidden_dropout = c.attention_dropout = c.ffn_dropout = dropout;
  c.max_positions = 12;  // more rows than the batch's 8 positions: the unused ones get no gradient
  try {
    train::Model m(c);
    m.InitWeights();
    auto weights = [&] { return ckpt::CopyForSnapshot(m.StateDict(), nullptr, m.checkpoint_dtype()); };
    ckpt::SavePt(dir + "/weights.pt", weights(), {.weights_only = true});
    const int64_t B = 2, T = 8;
    std::mt19937 rng(7);
    ckpt::Tensor tokens = ckpt::Tensor::Zeros(ckpt::DType::kInt32, {B, T});
    ckpt::Tensor targets = ckpt::Tensor::Zeros(ckpt::DType::kInt32, {B, T});
    auto* tk = reinterpret_cast<int32_t*>(tokens.mutable_data());
    auto* tg = reinterpret_cast<int32_t*>(targets.mutable_data());
    for (int64_t i = 0; i < B * T; ++i) tk[i] = static_cast<int32_t>(rng() % c.vocab), tg[i] = static_cast<int32_t>(rng() % c.vocab);

    ckpt::Value out = ckpt::Value::NewDict();
    auto& d = out.as_dict();
    train::AdamW adamw(m, opt);
    std::vector<float> losses, lrs, norms;
    double lr = 0;
    for (int s = 0; s < steps; ++s) {
      m.ZeroGrad();
      losses.push_back(m.Forward(tk, tg, B, T, dropout_key + static_cast<uint64_t>(s)));
      m.Backward();
      m.ReduceReplicaGrads();  // GPT's tied output copy and the embedding: each takes the sum
      if (s == 0) {  // the raw forward/backward of the initial weights
        d.Set("logits", ckpt::Value(Floats(m.logits(), {B, T, c.vocab})));
        d.Set("grads", train::CopyForGradCheck(m));
      }
      norms.push_back(static_cast<float>(adamw.ReduceAndClip(m, 1.0, clip)));
      lr = train::LrAt(sched, opt.lr, s);
      lrs.push_back(static_cast<float>(lr));
      adamw.Step(m, lr);
    }
    d.Set("tokens", ckpt::Value(tokens));
    d.Set("targets", ckpt::Value(targets));
    d.Set("losses", ckpt::Value(Floats(losses, {steps})));
    d.Set("lrs", ckpt::Value(Floats(lrs, {steps})));
    d.Set("grad_norms", ckpt::Value(Floats(norms, {steps})));
    d.Set("final", weights());
    d.Set("optim", adamw.StateDict(lr));
    ckpt::Value cfg = ckpt::Value::NewDict();
    for (auto [k, v] : std::vector<std::pair<const char*, int64_t>>{
             {"vocab", c.vocab}, {"hidden", c.hidden}, {"ffn", c.ffn}, {"heads", c.heads}, {"kv_heads", c.kv_heads},
             {"layers", c.layers}, {"rotary_dim", c.rotary_dim()}})
      cfg.as_dict().Set(k, ckpt::Value(v));
    for (auto [k, v] : std::vector<std::pair<const char*, bool>>{{"layernorm", c.layernorm}, {"gelu", c.gelu}, {"tied", c.tied_output}})
      cfg.as_dict().Set(k, ckpt::Value(v));
    d.Set("config", cfg);
    ckpt::SavePt(dir + "/result.pt", out);
    std::cout << "loss " << losses.front() << " -> " << losses.back() << "\n";
    return 0;
  } catch (const ckpt::Error& e) {
    std::cerr << "train_reference_dump: " << e.what() << "\n";
    return 1;
  }
}
