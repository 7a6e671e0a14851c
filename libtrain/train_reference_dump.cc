// train_reference_dump OUT_DIR [--kv-heads G] [--rotary R]: builds a small
// model from its seed, runs one batch forward and backward, and writes
// OUT_DIR/weights.pt (the state dict, NxDT names) and OUT_DIR/result.pt
// (tokens, targets, logits, loss, grads) for a PyTorch reference to compare.
#include <cstring>
#include <iostream>
#include <random>
#include <string>

#include "ckpt/error.h"
#include "ckpt/pt_file.h"
#include "libtrain/model.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: train_reference_dump OUT_DIR [--kv-heads G] [--rotary R]\n";
    return 2;
  }
  train::ModelConfig c;
  c.vocab = 64, c.hidden = 32, c.ffn = 48, c.heads = 4, c.kv_heads = 4, c.layers = 2;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--kv-heads") c.kv_heads = std::stoi(argv[i + 1]);
    else if (flag == "--rotary") c.rotary_percentage = std::stod(argv[i + 1]);
  }
  try {
    train::Model m(c);
    m.InitWeights();
    const int64_t B = 2, T = 8;
    std::mt19937 rng(7);
    ckpt::Tensor tokens = ckpt::Tensor::Zeros(ckpt::DType::kInt32, {B, T});
    ckpt::Tensor targets = ckpt::Tensor::Zeros(ckpt::DType::kInt32, {B, T});
    for (int64_t i = 0; i < B * T; ++i) {
      reinterpret_cast<int32_t*>(tokens.mutable_data())[i] = static_cast<int32_t>(rng() % c.vocab);
      reinterpret_cast<int32_t*>(targets.mutable_data())[i] = static_cast<int32_t>(rng() % c.vocab);
    }
    m.ZeroGrad();
    const float loss = m.Forward(reinterpret_cast<const int32_t*>(tokens.data()),
                                 reinterpret_cast<const int32_t*>(targets.data()), B, T);
    m.Backward();
    const std::string dir = argv[1];
    ckpt::SavePt(dir + "/weights.pt", m.StateDict(), {.weights_only = true});
    ckpt::Tensor logits = ckpt::Tensor::FromBytes(
        ckpt::DType::kFloat32, {B, T, c.vocab},
        {reinterpret_cast<const uint8_t*>(m.logits().data()), m.logits().size() * sizeof(float)});
    ckpt::Tensor loss_t = ckpt::Tensor::Zeros(ckpt::DType::kFloat32, {});
    reinterpret_cast<float*>(loss_t.mutable_data())[0] = loss;
    ckpt::Value out = ckpt::Value::NewDict();
    auto& d = out.as_dict();
    d.Set("tokens", ckpt::Value(tokens));
    d.Set("targets", ckpt::Value(targets));
    d.Set("logits", ckpt::Value(logits));
    d.Set("loss", ckpt::Value(loss_t));
    d.Set("grads", m.GradDict());
    d.Set("config", ckpt::Value::NewDict());
    for (auto [k, v] : std::vector<std::pair<const char*, int64_t>>{
             {"vocab", c.vocab}, {"hidden", c.hidden}, {"ffn", c.ffn}, {"heads", c.heads}, {"kv_heads", c.kv_heads},
             {"layers", c.layers}, {"rotary_dim", c.rotary_dim()}})
      d.At("config").as_dict().Set(k, ckpt::Value(v));
    ckpt::SavePt(dir + "/result.pt", out, {.weights_only = true});
    std::cout << "loss " << loss << "\n";
    return 0;
  } catch (const ckpt::Error& e) {
    std::cerr << "train_reference_dump: " << e.what() << "\n";
    return 1;
  }
}
