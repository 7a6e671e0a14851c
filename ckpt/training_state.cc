#include "ckpt/training_state.h"

#include "ckpt/error.h"

namespace ckpt {
namespace {

const Dict& DictOf(const Value& v, const std::string& where) {
  if (!v.is_dict()) throw Error(where + ": is not a dict");
  return v.as_dict();
}

std::string KeyString(const Value& k, const std::string& where) {
  if (!k.is_str()) throw Error(where + ": has a key that is not a string");
  return k.as_str();
}

}  // namespace

Value UserContent::ToValue() const {
  Value v = Value::NewDict();
  v.as_dict().Set("epoch", Value(epoch));
  v.as_dict().Set("global_step", Value(global_step));
  v.as_dict().Set("consumed_samples", Value(consumed_samples));
  for (const auto& [k, x] : carried) v.as_dict().Set(k, x);
  return v;
}

UserContent UserContent::FromValue(const Value& v, const std::string& where) {
  UserContent u;
  bool step = false, consumed = false;
  for (const auto& [k, x] : DictOf(v, where).items) {
    const std::string key = KeyString(k, where);
    if (key == "epoch") {
      u.epoch = AsInteger(x, where + ": epoch");
    } else if (key == "global_step") {
      u.global_step = AsInteger(x, where + ": global_step");
      step = true;
    } else if (key == "consumed_samples") {
      try {
        u.consumed_samples = x.is_int() ? static_cast<double>(x.as_int()) : AsScalar(x);
      } catch (const Error& e) {
        throw Error(where + ": consumed_samples: " + e.what());
      }
      consumed = true;
    } else {
      u.carried.emplace_back(key, x);
    }
  }
  if (!step) throw Error(where + ": has no global_step");
  if (!consumed) throw Error(where + ": has no consumed_samples");
  if (u.global_step < 0 || !(u.consumed_samples >= 0)) throw Error(where + ": global_step or consumed_samples is negative");
  return u;
}

Value SchedulerState::ToValue() const {
  Value v = Value::NewDict();
  for (size_t i = 0; i <= carried.size(); ++i) {
    if (i == last_epoch_at_) v.as_dict().Set("last_epoch", Value(last_epoch));
    if (i < carried.size()) v.as_dict().Set(carried[i].first, carried[i].second);
  }
  return v;
}

SchedulerState SchedulerState::FromValue(const Value& v, const std::string& where) {
  SchedulerState s;
  bool found = false;
  for (const auto& [k, x] : DictOf(v, where).items) {
    const std::string key = KeyString(k, where);
    if (key == "last_epoch") {
      s.last_epoch = AsInteger(x, where + ": last_epoch");
      s.last_epoch_at_ = s.carried.size();
      found = true;
    } else {
      s.carried.emplace_back(key, x);
    }
  }
  if (!found) throw Error(where + ": has no last_epoch");
  return s;
}

}  // namespace ckpt
