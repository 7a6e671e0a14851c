#include "ckpt/store/training_state.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "ckpt/pt/pickle_writer.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

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
  refused(w, "consumed_samples is -1.000000, negative");
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

// A recorded position no run reaches, or that is no count at all, is refused naming the key and
// the value: resuming from it would skip training or wrap the sample counter.
TEST(UserContent, RefusesAbsurdNonFiniteNegativeAndFractionalPositions) {
  using testing::ErrorOf;
  auto with = [](const std::string& key, const Value& v) {
    Value u = Value::NewDict();
    u.as_dict().Set("global_step", Value(int64_t{4}));
    u.as_dict().Set(key, v);
    return u;
  };
  auto refusal = [](const Value& u) {
    try {
      UserContent::FromValue(u, "t/user_content.pt");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(refusal(with("global_step", Value(int64_t{1} << 62))),
            "t/user_content.pt: global_step is 4611686018427387904, beyond 2^40 (1099511627776), more than any run takes");
  EXPECT_EQ(refusal(with("global_step", Value(int64_t{-3}))), "t/user_content.pt: global_step is -3, negative");
  EXPECT_EQ(refusal(with("epoch", Value((int64_t{1} << 40) + 1))),
            "t/user_content.pt: epoch is 1099511627777, beyond 2^40 (1099511627776), more than any run takes");
  EXPECT_EQ(refusal(with("consumed_samples", Value(inf))), "t/user_content.pt: consumed_samples is inf, not a finite count");
  EXPECT_EQ(refusal(with("consumed_samples", Value(std::nan("")))), "t/user_content.pt: consumed_samples is nan, not a finite count");
  EXPECT_EQ(refusal(with("consumed_samples", Value(-inf))), "t/user_content.pt: consumed_samples is -inf, not a finite count");
  EXPECT_EQ(refusal(with("consumed_samples", Value(32.5))), "t/user_content.pt: consumed_samples is 32.500000, not a whole number of samples");
  EXPECT_EQ(refusal(with("consumed_samples", Value(int64_t{1} << 62))),
            "t/user_content.pt: consumed_samples is 4611686018427387904, beyond 2^53 (9007199254740992), more than any run consumes");
  // The bounds themselves are reachable values.
  EXPECT_EQ(refusal(with("global_step", Value(int64_t{1} << 40))), "accepted");
  EXPECT_EQ(refusal(with("consumed_samples", Value(9007199254740992.0))), "accepted");
  // The loops' count and the schedule are steps too; the schedule's LRs are finite and not negative.
  Value loops = NxdtUserContent(4, int64_t{1} << 62, 5);
  EXPECT_NE(refusal(loops).find("loops' completed optimizer steps is 4611686018427387904, beyond 2^40"), std::string::npos) << refusal(loops);
  EXPECT_NE(refusal(NxdtUserContent(4, 4, -1)).find("lr_schedulers[0].last_epoch is -1, negative"), std::string::npos);
  EXPECT_EQ(refusal(with("lr_schedulers", Value::List({LrSchedulerEntry(std::nan(""), 3, 1e-4)}))),
            "t/user_content.pt: lr_schedulers[0].base_lrs[0] is nan, not a learning rate (finite, not negative)");
  EXPECT_EQ(refusal(with("lr_schedulers", Value::List({LrSchedulerEntry(3e-4, 3, -1e-4)}))),
            "t/user_content.pt: lr_schedulers[0]._last_lr[0] is -0.000100, not a learning rate (finite, not negative)");
  Value sched = Value::NewDict();
  sched.as_dict().Set("last_epoch", Value(int64_t{1} << 62));
  EXPECT_NE(ErrorOf([&] { SchedulerState::FromValue(sched, "s"); }).find("s: last_epoch is 4611686018427387904, beyond 2^40"), std::string::npos);
  sched.as_dict().Set("last_epoch", Value(int64_t{3}));
  sched.as_dict().Set("base_lrs", Value::List({Value(inf)}));
  EXPECT_EQ(ErrorOf([&] { SchedulerState::FromValue(sched, "s"); }), "s.base_lrs[0] is inf, not a learning rate (finite, not negative)");
}

// A tag of `files` (relpath -> value) named `name` under `dir`.
std::string WriteTagOfFiles(const std::string& dir, const std::string& name, const std::vector<std::pair<std::string, Value>>& files) {
  const std::string tag = dir + "/" + name;
  for (const auto& [rel, v] : files) {
    Env::Default()->CreateDirs(std::filesystem::path(tag + "/" + rel).parent_path().string());
    SavePt(tag + "/" + rel, v);
  }
  return tag;
}

// The one rule both resume and the tag reader take: content over name; the name's values kept beside.
TEST(PositionFromContent, TheContentWinsOverTheName) {
  const std::string name = "megatron_llama--step=9-consumed_samples=72.0.ckpt";
  UserContent uc{.global_step = 4, .consumed_samples = 32.0, .carried = {}};
  RecordedPosition p = PositionFromContent(&uc, name, SamplesFromName::kAsNxdtReads);
  EXPECT_EQ(p.step, 4);
  EXPECT_TRUE(p.step_from_content);
  EXPECT_EQ(p.named_step, 9);
  EXPECT_EQ(p.consumed_samples, 32.0);
  EXPECT_TRUE(p.samples_from_content);
  EXPECT_EQ(p.samples_nxdt_reads, 72);
  // No samples recorded: the name's.
  uc.consumed_samples.reset();
  p = PositionFromContent(&uc, name, SamplesFromName::kAsNxdtReads);
  EXPECT_EQ(p.consumed_samples, 72.0);
  EXPECT_FALSE(p.samples_from_content);
  // No content: the name gives the step too; NxD's step_<N> names a step and no samples.
  p = PositionFromContent(nullptr, name, SamplesFromName::kTagName);
  EXPECT_EQ(std::tuple(p.step, p.step_from_content, p.consumed_samples), std::tuple(std::optional<int64_t>(9), false, std::optional(72.0)));
  p = PositionFromContent(nullptr, "step_12", SamplesFromName::kTagName);
  EXPECT_EQ(std::tuple(p.step, p.consumed_samples), std::tuple(std::optional<int64_t>(12), std::optional<double>()));
  EXPECT_EQ(PositionFromContent(nullptr, "latest", SamplesFromName::kTagName).step, std::nullopt);
}

// Where the rules for samples from a name differ: NxDT's regex needs N.N; shardkit's tag name takes "=56".
TEST(PositionFromContent, SamplesFromANameAsEachReaderTakesThem) {
  const std::string name = "megatron_llama--step=9-consumed_samples=56.ckpt";
  EXPECT_EQ(PositionFromContent(nullptr, name, SamplesFromName::kAsNxdtReads).consumed_samples, std::nullopt);
  EXPECT_EQ(PositionFromContent(nullptr, name, SamplesFromName::kTagName).consumed_samples, 56.0);
}

TEST(TrainingPosition, ComesFromTheContentAndANameThatDisagreesIsAWarning) {
  testing::TempDir d("position");
  UserContent uc{.global_step = 4, .consumed_samples = 32.0, .carried = {}};
  uc.carried.emplace_back("lr_schedulers", Value::List({LrSchedulerEntry(3e-4, 4, 3e-4)}));
  const std::string lying = WriteTagOfFiles(d.path(), "m--step=999999999999999999-consumed_samples=7.0.ckpt", {{kUserContentFile, uc.ToValue()}});
  const TrainingPosition at = ReadTrainingPosition(Env::Default(), lying);
  EXPECT_EQ(at.step, 4);
  EXPECT_TRUE(at.step_recorded);
  EXPECT_EQ(at.consumed_samples, 32);
  EXPECT_EQ(at.schedule_step, 4);
  ASSERT_EQ(at.notes.size(), 2u);
  EXPECT_EQ(at.notes[0], "warning: m--step=999999999999999999-consumed_samples=7.0.ckpt is named for step 999999999999999999 but "
                         "user_content.pt records step 4; resuming at step 4, what the tag records");
  EXPECT_EQ(at.notes[1], "warning: m--step=999999999999999999-consumed_samples=7.0.ckpt is named consumed_samples=7 but "
                         "user_content.pt records 32; resuming from 32, what the tag records");
  // NxDT records the samples in the name only: the name gives them, within the same bound.
  const std::string nxdt = WriteTagOfFiles(d.path(), "m--step=6-consumed_samples=48.0.ckpt", {{kUserContentFile, NxdtUserContent(6, 6, 6)}});
  const TrainingPosition n = ReadTrainingPosition(Env::Default(), nxdt);
  EXPECT_EQ(n.step, 6);
  EXPECT_EQ(n.consumed_samples, 48);
  EXPECT_TRUE(n.notes.empty());
  const std::string huge = WriteTagOfFiles(d.path(), "m--step=6-consumed_samples=9999999999999999.0.ckpt", {{kUserContentFile, NxdtUserContent(6, 6, 6)}});
  EXPECT_NE(testing::ErrorOf([&] { ReadTrainingPosition(Env::Default(), huge); }).find("its name's consumed_samples=10000000000000000 is beyond 2^53"),
            std::string::npos) << testing::ErrorOf([&] { ReadTrainingPosition(Env::Default(), huge); });
  // NxD's own free-form user content: the step_<N> name is all there is.
  Value free = Value::NewDict();
  free.as_dict().Set("batch_idx", Value(int64_t{3}));
  SchedulerState sched;
  sched.last_epoch = 7;
  const std::string nxd = WriteTagOfFiles(d.path(), "step_7", {{kUserContentFile, free}, {kSchedulerFile, sched.ToValue()}});
  const TrainingPosition x = ReadTrainingPosition(Env::Default(), nxd);
  EXPECT_EQ(x.step, 7);
  EXPECT_EQ(x.schedule_step, 7);
  EXPECT_EQ(x.consumed_samples, std::nullopt);
  // No user content: weights only, the run starts over.
  const std::string weights = WriteTagOfFiles(d.path(), "m--step=9-consumed_samples=72.0.ckpt", {{"model/x.pt", Value::NewDict()}});
  EXPECT_FALSE(ReadTrainingPosition(Env::Default(), weights).step_recorded);
}

}  // namespace
}  // namespace ckpt
