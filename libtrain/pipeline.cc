#include "libtrain/pipeline.h"

#include <algorithm>
#include <deque>
#include <memory>

#include "libtrain/comm.h"
#include "libtrain/pipeline_schedule.h"

namespace train {
namespace {
constexpr int kActivationTag = 1, kGradientTag = 2;

// The interleaved schedule: InterleavedSchedule's steps, each receiving its
// input, running a chunk and sending its output. Chunk c's messages carry
// kActivationTag + 2c and kGradientTag + 2c.
double RunInterleavedStep(Model& model, int64_t count, int64_t B, int64_t T, const std::function<void(int64_t, MicroBatch*)>& load) {
  const PipelineStage& pp = model.pipeline();
  Comm* comm = pp.comm;
  const size_t n = static_cast<size_t>(model.HiddenStateFloats(B, T));
  const int stages = pp.size * pp.chunks;
  std::vector<std::deque<std::unique_ptr<Model::Activations>>> in_flight(pp.chunks);  // by chunk, oldest first
  double loss = 0;
  MicroBatch mb;
  std::vector<float> in, out;
  for (const PipelineStep& s : InterleavedSchedule(pp.size, pp.stage, pp.chunks, count)) {
    const int v = pp.stage + s.chunk * pp.size;  // the virtual stage
    const int prev = (v - 1 + pp.size) % pp.size, next = (v + 1) % pp.size;
    if (s.forward) {
      load(s.micro_batch, &mb);
      if (v > 0) in.resize(n), comm->Recv(in.data(), n, prev, kActivationTag + 2 * s.chunk);
      auto a = model.TakeActivations();
      loss += model.ForwardStage(*a, mb.tokens.data(), mb.targets.data(), in.data(), B, T, mb.dropout_key, &out, s.chunk);
      if (v < stages - 1) comm->Send(out.data(), n, next, kActivationTag + 2 * ((v + 1) / pp.size));
      in_flight[s.chunk].push_back(std::move(a));
    } else {
      if (v < stages - 1) in.resize(n), comm->Recv(in.data(), n, next, kGradientTag + 2 * s.chunk);
      model.BackwardStage(*in_flight[s.chunk].front(), in.data(), &out);
      if (v > 0) comm->Send(out.data(), n, prev, kGradientTag + 2 * ((v - 1) / pp.size));
      model.ReturnActivations(std::move(in_flight[s.chunk].front()));
      in_flight[s.chunk].pop_front();
    }
  }
  comm->WaitSends();
  return loss;
}

}  // namespace

double RunPipelineStep(Model& model, int64_t count, int64_t B, int64_t T, const std::function<void(int64_t, MicroBatch*)>& load) {
  const PipelineStage& pp = model.pipeline();
  if (pp.chunks > 1) return RunInterleavedStep(model, count, B, T, load);
  Comm* comm = pp.comm;
  const size_t n = static_cast<size_t>(model.HiddenStateFloats(B, T));
  const int64_t warmup = std::min<int64_t>(pp.size - pp.stage - 1, count);
  std::deque<std::unique_ptr<Model::Activations>> in_flight;  // oldest first
  int64_t next = 0;
  double loss = 0;
  MicroBatch mb;
  std::vector<float> in, out;
  auto forward = [&] {
    load(next++, &mb);
    if (!pp.first()) in.resize(n), comm->Recv(in.data(), n, pp.stage - 1, kActivationTag);
    auto a = model.TakeActivations();
    loss += model.ForwardStage(*a, mb.tokens.data(), mb.targets.data(), in.data(), B, T, mb.dropout_key, &out);
    if (!pp.last()) comm->Send(out.data(), n, pp.stage + 1, kActivationTag);
    in_flight.push_back(std::move(a));
  };
  auto backward = [&] {
    if (!pp.last()) in.resize(n), comm->Recv(in.data(), n, pp.stage + 1, kGradientTag);
    model.BackwardStage(*in_flight.front(), in.data(), &out);
    if (!pp.first()) comm->Send(out.data(), n, pp.stage - 1, kGradientTag);
    model.ReturnActivations(std::move(in_flight.front()));
    in_flight.pop_front();
  };
  for (int64_t i = 0; i < warmup; ++i) forward();
  for (int64_t i = warmup; i < count; ++i) forward(), backward();
  for (int64_t i = 0; i < warmup; ++i) backward();
  if (comm) comm->WaitSends();
  return loss;
}

}  // namespace train
