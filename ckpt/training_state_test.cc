#include "ckpt/training_state.h"

#include <gtest/gtest.h>

#include "ckpt/error.h"
#include "ckpt/pickle_writer.h"

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
  refused(w, "has no consumed_samples");
  w.as_dict().Set("consumed_samples", Value(-1.0));
  refused(w, "global_step or consumed_samples is negative");
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
