#include "libtrain/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint_store.h"
#include "ckpt/error.h"
#include "ckpt/progress.h"
#include "ckpt/pt_file.h"
#include "ckpt/training_state.h"
#include "libtrain/hdf5_dataset.h"
#include "libtrain/indexed_dataset.h"
#include "libtrain/layers.h"
#include "libtrain/model.h"
#include "libtrain/optimizer.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

const std::string kRankFile = "dp_rank_00_tp_rank_00_pp_rank_00.pt";

// The folder names of the tags resume found damaged, as the store keys them.
std::vector<std::string> DamagedNames(const std::vector<ckpt::DamagedTag>& damaged) {
  std::vector<std::string> names;
  for (const auto& d : damaged) names.push_back(std::filesystem::path(d.path).filename().string());
  return names;
}

}  // namespace

TrainResult RunTraining(const TrainConfig& c, const std::function<void(const std::string&)>& log) {
  TrainResult result;
  for (const auto& k : c.ignored) log("info: " + k + " is accepted and ignored");
  // Data.
  std::vector<std::shared_ptr<TokenSource>> datasets;
  std::vector<double> weights;
  for (const auto& [w, prefix] : c.data_prefix) {
    if (c.data_impl == "hdf5") datasets.push_back(std::make_shared<Hdf5Dataset>(prefix));
    else datasets.push_back(std::make_shared<IndexedDataset>(prefix));
    weights.push_back(w);
  }
  SampleSource data(datasets, weights, c.seq_length, c.seed);
  Model model(c.model);
  model.InitWeights();
  AdamW adamw(model, c.optim);

  // Resume.
  const std::string run_dir = c.RunDir(), ckpt_dir = c.CheckpointDir();
  ckpt::Env::Default()->CreateDirs(run_dir);
  int64_t step = 0, consumed = 0;
  // Every byte of the tag is checked against its manifest before it is loaded; a damaged tag is
  // skipped for the next one that verifies, and kept (retention neither counts nor deletes it).
  std::vector<ckpt::DamagedTag> damaged;
  const auto tag = ckpt::ResolveResume(ckpt::Env::Default(), ckpt_dir,
                                       {.resume_if_exists = c.resume_if_exists,
                                        .resume_ignore_no_checkpoint = c.resume_ignore_no_checkpoint,
                                        .resume_from_checkpoint = c.resume_from_checkpoint,
                                        .verify_checksums = true,
                                        .start_over_damaged = c.resume_past_damaged_checkpoints},
                                       log, &damaged);
  if (tag) {
    try {
      model.LoadStateDict(ckpt::LoadPt(*tag + "/model/" + kRankFile));
      adamw.ResetMasterWeights(model);
      ckpt::Env* env = ckpt::Env::Default();
      if (!env->Exists(*tag + "/optim/" + kRankFile))  // weights only, e.g. converted from NNM's HF import
        log("info: " + *tag + " holds no optimizer state; the optimizer starts fresh");
      else if (!adamw.LoadStateDict(ckpt::LoadPt(*tag + "/optim/" + kRankFile)) && c.optim.master_weights)
        log("info: the checkpoint holds no master weights (use_master_weights_in_ckpt was off); they restart from its "
            "bfloat16 parameters, as in NxDT");
      if (env->Exists(*tag + "/" + ckpt::kUserContentFile)) {
        const std::string path = *tag + "/" + ckpt::kUserContentFile;
        const ckpt::UserContent uc = ckpt::UserContent::FromValue(ckpt::LoadPt(path), path);
        step = uc.global_step;
        consumed = static_cast<int64_t>(uc.consumed_samples);
      } else {
        log("info: " + *tag + " holds no " + ckpt::kUserContentFile + " (weights only); training starts at step 0");
      }
    } catch (const ckpt::Error& e) {
      throw ckpt::Error(*tag + ": cannot resume: " + e.what());
    }
    result.resumed_from = *tag;
    log("resumed from " + *tag + " at step " + std::to_string(step) + ", " + std::to_string(consumed) + " samples consumed");
  }
  result.start_step = step;

  std::unique_ptr<ckpt::CheckpointStore> store;
  auto pool = ckpt::SnapshotPool::Create();
  if (c.create_checkpoint_callback) {
    store = std::make_unique<ckpt::CheckpointStore>(ckpt::StoreOptions{
        .dir = ckpt_dir, .save_top_k = static_cast<int>(c.save_top_k), .async = c.async_checkpointing, .log = log,
        .damaged = DamagedNames(damaged), .model = model.config().format()});
    pool->Reserve(model.StateDict(), model.checkpoint_dtype());  // snapshot buffers, faulted in before the first step
    pool->Reserve(adamw.StateDict(0));
  }
  auto save = [&](int64_t global_step, double lr) {
    if (!store) return;
    ckpt::SchedulerState sched;
    sched.last_epoch = global_step;
    sched.carried = {{"base_lrs", ckpt::Value::List({ckpt::Value(c.optim.lr)})},
                     {"_last_lr", ckpt::Value::List({ckpt::Value(lr)})},
                     {"name", ckpt::Value(c.sched.name)}};
    const ckpt::UserContent user{.epoch = 0, .global_step = global_step, .consumed_samples = static_cast<double>(consumed), .carried = {}};
    ckpt::Snapshot snap;
    snap.tag = {c.name, global_step, static_cast<double>(consumed), false};
    snap.grid.zero1 = c.optim.zero1;  // the optimizer file is ZeRO-1's (one dp rank)
    snap.files = {{"model/" + kRankFile, ckpt::CopyForSnapshot(model.StateDict(), pool.get(), model.checkpoint_dtype()), {.weights_only = true}},
                  {"optim/" + kRankFile, ckpt::CopyForSnapshot(adamw.StateDict(lr), pool.get()), {}},
                  {ckpt::kSchedulerFile, sched.ToValue(), {}},
                  {ckpt::kUserContentFile, user.ToValue(), {}}};
    store->Save(std::move(snap));
  };

  std::ofstream metrics(run_dir + "/metrics.jsonl", std::ios::app);
  const bool tty = ::isatty(2);
  const int64_t micro = c.global_batch_size / c.micro_batch_size, B = c.micro_batch_size, T = c.seq_length;
  std::vector<int32_t> sample(T + 1), tokens(B * T), targets(B * T);
  double lr = 0;
  int64_t last_saved = tag ? step : -1;
  while (step < c.max_steps) {
    const auto t0 = Clock::now();
    model.ZeroGrad();
    double loss = 0;
    for (int64_t m = 0; m < micro; ++m) {
      for (int64_t b = 0; b < B; ++b) {
        data.Sample(consumed + m * B + b, sample.data());
        std::copy(sample.begin(), sample.end() - 1, tokens.begin() + b * T);
        std::copy(sample.begin() + 1, sample.end(), targets.begin() + b * T);
      }
      // Dropout masks are a function of the seed and the batch's place in the data, so a resumed run draws the same.
      const uint64_t dropout_key = DropoutStream(c.seed, static_cast<uint64_t>(consumed + m * B));
      loss += model.Forward(tokens.data(), targets.data(), B, T, dropout_key) / static_cast<double>(micro);
      model.Backward();
    }
    if (micro > 1)  // the mean over micro-batches
      for (const auto& p : model.layout()) {
        float* g = reinterpret_cast<float*>(model.grad(p.name).mutable_data());
        for (int64_t i = 0, n = model.grad(p.name).numel(); i < n; ++i) g[i] /= static_cast<float>(micro);
      }
    const double grad_norm = ClipGradNorm(model, c.gradient_clip_val);
    lr = LrAt(c.sched, c.optim.lr, step);
    adamw.Step(model, lr);
    consumed += c.global_batch_size;
    ++step;
    result.losses.push_back(loss);
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const double tps = static_cast<double>(c.global_batch_size * T) / secs;
    nlohmann::ordered_json j = {{"step", step}, {"loss", loss}, {"lr", lr}, {"consumed_samples", consumed}, {"tokens_per_s", tps}};
    if (c.log_gradient_norm) j["grad_norm"] = grad_norm;
    if (c.log_parameter_norm) j["param_norm"] = ParamNorm(model);
    metrics << j.dump() << "\n" << std::flush;
    if (step % c.log_every_n_steps == 0 || step == c.max_steps) {
      char line[256];
      std::snprintf(line, sizeof line, "step %lld/%lld loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f",
                    static_cast<long long>(step), static_cast<long long>(c.max_steps), loss, lr, grad_norm, tps);
      if (tty) std::fprintf(stderr, "\r%s %s", ckpt::ProgressBar(step, c.max_steps).c_str(), line), std::fflush(stderr);
      else log(line);
    }
    if (c.every_n_train_steps > 0 && step % c.every_n_train_steps == 0) save(step, lr), last_saved = step;
  }
  if (tty) std::fprintf(stderr, "\n");
  if (last_saved != step) save(step, lr);
  if (store) store->Finalize();
  result.end_step = step;
  return result;
}

}  // namespace train
