#include "ckpt/store/training_state.h"

#include <gtest/gtest.h>

#include "ckpt/util/error.h"
#include "ckpt/pt/pickle_writer.h"

namespace ckpt {
namespace {

TEST(UserContent, RoundTripsKeepingCarriedEntriesInOrder) {
  UserContent u{.epoch = 2, .global_step = 80, .consumed_samples = 640.0, .carried = {}};
  u.carried = {{"loops", Value::NewDict()}, {"pytorch-lightning_version", Value(std::string("1.8.6"))}};
  const Value v = u.ToValue();
  std::vector<std::string> keys;
  for (const auto& [k, x] : v.as_dict().items) keys.push_back(k.as_str());
  EXPECT_EQ(keys, (std::vector<std::string>{"epoch", "global_step", "consumed_samples", "loops", "pytorch-lightning_version"}));
  const UserContent back = UserContent::FromValue(v, "uc");
  EXPECT_EQ(back.epoch, 2);
  EXPECT_EQ(back.global_step, 80);
  EXPECT_EQ(back.consumed_samples, 640.0);
  EXPECT_TRUE(DeepEqual(back.ToValue(), v));
}

TEST(UserContent, RefusesWhatIsNotUserContentNamingTheKey) {
  auto refused = [](const Value& v, const std::string& what) {
    try {
      UserContent::FromValue(v, "x/user_content.pt");
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("x/user_content.pt: " + what), std::string::npos) << e.what();
    }
  };
  refused(Value(int64_t{3}), "is not a dict");
  Value v = Value::NewDict();
  v.as_dict().Set("consumed_samples", Value(8.0));
  refused(v, "has no global_step");
  v.as_dict().Set("global_step", Value(std::string("7")));
  refused(v, "global_step");
  Value w = Value::NewDict();
  w.as_dict().Set("global_step", Value(int64_t{7}));
  w.as_dict().Set("consumed_samples", Value(-1.0));
  refused(w, "global_step or consumed_samples is negative");
  Value x = Value::NewDict();
  x.as_dict().Set("global_step", Value(int64_t{7}));
  x.as_dict().Set("lr_schedulers", Value::List({Value(int64_t{1})}));
  refused(x, "lr_schedulers[0] is not a dict");
}

// NxDT's user content as NLPCheckpointIO saves it (tests/data/upstream/nxd_tags: the Lightning
// dict minus model and optimizer), reduced to what resume reads.
Value NxdtUserContent(int64_t global_step, int64_t loops_completed, int64_t last_epoch) {
  auto dict = [](std::vector<std::pair<std::string, Value>> items) {
    Value d = Value::NewDict();
    for (auto& [k, v] : items) d.as_dict().Set(k, v);
    return d;
  };
  const Value progress = dict({{"optimizer", dict({{"step", dict({{"total", dict({{"ready", Value(loops_completed)},
                                                                                   {"completed", Value(loops_completed)}})}})}})}});
  return dict({{"epoch", Value(int64_t{0})},
               {"global_step", Value(global_step)},
               {"pytorch-lightning_version", Value(std::string("2.5.0"))},
               {"loops", dict({{"fit_loop", dict({{"epoch_loop.automatic_optimization.optim_progress", progress}})}})},
               {"lr_schedulers", Value::List({LrSchedulerEntry(3e-4, last_epoch, 2.6e-4)})},
               {"hparams_name", Value(std::string("kwargs"))}});
}

TEST(UserContent, ReadsNxdtsShapeAsNxdtResumes) {
  const UserContent u = UserContent::FromValue(NxdtUserContent(4, 6, 5), "uc");
  EXPECT_FALSE(u.consumed_samples.has_value());  // NxDT keeps it in the tag name only
  EXPECT_EQ(u.global_step, 4);
  EXPECT_EQ(u.ResumeStep(), 6);  // the loops' count overrides global_step
  EXPECT_EQ(u.LrSchedulerStep(), 5);
  EXPECT_TRUE(DeepEqual(u.ToValue(), NxdtUserContent(4, 6, 5)));  // carried as it was, in order
  Value no_loops = NxdtUserContent(4, 6, 5);
  no_loops.as_dict().items.erase(no_loops.as_dict().items.begin() + 3);
  EXPECT_EQ(UserContent::FromValue(no_loops, "uc").ResumeStep(), 4);
}

TEST(UserContent, LrSchedulerEntryHoldsTorchsGenericKeysOnly) {
  const Value e = LrSchedulerEntry(3e-4, 12, 1e-4);
  std::vector<std::string> keys;
  for (const auto& [k, v] : e.as_dict().items) keys.push_back(k.as_str());
  EXPECT_EQ(keys, (std::vector<std::string>{"base_lrs", "last_epoch", "verbose", "_step_count", "_get_lr_called_within_step", "_last_lr"}));
  EXPECT_EQ(AsInteger(e.as_dict().At("_step_count"), "n"), 13);
}

TEST(ConsumedSamples, FromTheTagPathByNxdtsRegex) {
  EXPECT_EQ(ConsumedSamplesFromTagPath("/c/megatron_llama--step=4-consumed_samples=32.0.ckpt"), 32);
  EXPECT_EQ(ConsumedSamplesFromTagPath("a--step=9-consumed_samples=5120.0-last.ckpt"), 5120);
  EXPECT_EQ(ConsumedSamplesFromTagPath("x--step=1-consumed_samples=56.75.ckpt"), 56);  // int(float(...)) truncates
  EXPECT_EQ(ConsumedSamplesFromTagPath("x--step=1-consumed_samples=56.ckpt"), std::nullopt);  // "56." then no digit: no match
  EXPECT_EQ(ConsumedSamplesFromTagPath("x--step=1-consumed_samples=5x6.ckpt"), std::nullopt);  // float('5x6') fails: NxDT assumes 0
  EXPECT_EQ(ConsumedSamplesFromTagPath("x--step=1-consumed_samples=560.ckpt"), 560);  // '.' matches the '6'
  EXPECT_EQ(ConsumedSamplesFromTagPath("step_4"), std::nullopt);
}

TEST(SchedulerState, KeepsLastEpochWhereTheSchedulerPutIt) {
  Value v = Value::NewDict();
  v.as_dict().Set("base_lrs", Value::List({Value(3e-4)}));
  v.as_dict().Set("last_epoch", Value(int64_t{12}));
  v.as_dict().Set("_step_count", Value(int64_t{13}));
  SchedulerState s = SchedulerState::FromValue(v, "sched");
  EXPECT_EQ(s.last_epoch, 12);
  EXPECT_TRUE(DeepEqual(s.ToValue(), v));
  s.last_epoch = 20;
  EXPECT_EQ(AsInteger(s.ToValue().as_dict().items[1].second, "last_epoch"), 20);
  SchedulerState fresh;
  fresh.last_epoch = 5;
  EXPECT_EQ(fresh.ToValue().as_dict().items[0].first.as_str(), "last_epoch");
  EXPECT_THROW(SchedulerState::FromValue(Value::NewDict(), "sched"), Error);
}

}  // namespace
}  // namespace ckpt
