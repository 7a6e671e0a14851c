#include "ckpt/store/training_state.h"

#include <algorithm>
#include <cstdlib>
#include <regex>

#include "ckpt/util/error.h"

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

// Lightning's completed optimizer steps in `loops`, if it records them.
std::optional<int64_t> LoopsStep(const Value& loops, const std::string& where) {
  const Value* v = &loops;
  for (const char* k : {"fit_loop", "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total", "completed"}) {
    if (!v->is_dict()) return std::nullopt;
    v = v->as_dict().Find(k);
    if (!v) return std::nullopt;
  }
  const int64_t s = AsInteger(*v, where + ": loops' completed optimizer steps");
  if (s < 0) throw Error(where + ": loops' completed optimizer steps are negative");
  return s;
}

}  // namespace

Value UserContent::ToValue() const {
  Value v = Value::NewDict();
  v.as_dict().Set("epoch", Value(epoch));
  v.as_dict().Set("global_step", Value(global_step));
  if (consumed_samples) v.as_dict().Set("consumed_samples", Value(*consumed_samples));
  for (const auto& [k, x] : carried) v.as_dict().Set(k, x);
  return v;
}

UserContent UserContent::FromValue(const Value& v, const std::string& where) {
  UserContent u;
  bool step = false;
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
    } else {
      u.carried.emplace_back(key, x);
    }
  }
  if (!step) throw Error(where + ": has no global_step");
  if (u.global_step < 0 || (u.consumed_samples && !(*u.consumed_samples >= 0)))
    throw Error(where + ": global_step or consumed_samples is negative");
  // What resume reads is checked now, so a malformed entry is named here.
  if (const Value* loops = u.Carried("loops")) LoopsStep(*loops, where);
  if (const Value* s = u.LrScheduler()) {
    if (!s->is_dict()) throw Error(where + ": lr_schedulers[0] is not a dict");
    if (const Value* e = s->as_dict().Find("last_epoch")) {
      if (AsInteger(*e, where + ": lr_schedulers[0].last_epoch") < 0) throw Error(where + ": lr_schedulers[0].last_epoch is negative");
    }
  }
  return u;
}

const Value* UserContent::Carried(const std::string& key) const {
  for (const auto& [k, v] : carried)
    if (k == key) return &v;
  return nullptr;
}

int64_t UserContent::ResumeStep() const {
  if (const Value* loops = Carried("loops"))
    if (auto s = LoopsStep(*loops, "loops")) return *s;
  return global_step;
}

const Value* UserContent::LrScheduler() const {
  const Value* l = Carried("lr_schedulers");
  if (!l || !l->is_seq() || l->as_seq().items.empty()) return nullptr;
  return &l->as_seq().items[0];
}

std::optional<int64_t> UserContent::LrSchedulerStep() const {
  const Value* s = LrScheduler();
  const Value* e = s && s->is_dict() ? s->as_dict().Find("last_epoch") : nullptr;
  if (!e) return std::nullopt;
  return AsInteger(*e, "lr_schedulers[0].last_epoch");
}

Value LrSchedulerEntry(double base_lr, int64_t last_epoch, double next_lr) {
  Value v = Value::NewDict();
  v.as_dict().Set("base_lrs", Value::List({Value(base_lr)}));
  v.as_dict().Set("last_epoch", Value(last_epoch));
  v.as_dict().Set("verbose", Value(false));
  v.as_dict().Set("_step_count", Value(last_epoch + 1));
  v.as_dict().Set("_get_lr_called_within_step", Value(false));
  v.as_dict().Set("_last_lr", Value::List({Value(next_lr)}));
  return v;
}

const Value* ConfigEntry(const Value& cfg, const std::string& key) {
  const Value* content = &cfg;
  if (cfg.is_object()) {
    const Object& o = cfg.as_object();
    content = o.state && o.state->is_dict() ? o.state->as_dict().Find("_content") : nullptr;
  }
  const Value* v = content && content->is_dict() ? content->as_dict().Find(key) : nullptr;
  if (v && v->is_object()) {
    const Object& node = v->as_object();
    if (const Value* val = node.state && node.state->is_dict() ? node.state->as_dict().Find("_val") : nullptr) return val;
  }
  return v;
}

const Value* RecordedJobConfig(const Value& checkpoint) {
  const Value* hp = checkpoint.is_dict() ? checkpoint.as_dict().Find("hyper_parameters") : nullptr;
  const Value* cfg = hp ? ConfigEntry(*hp, "cfg") : nullptr;
  return cfg && (cfg->is_dict() || cfg->is_object()) ? cfg : nullptr;
}

std::optional<int64_t> ConsumedSamplesFromTagPath(const std::string& path) {
  // Python's re.findall(r"consumed_samples\=([0-9]+.[0-9]+)", path)[0]: the '.' is any character.
  static const std::regex re(R"(consumed_samples=([0-9]+.[0-9]+))");
  std::smatch m;
  if (!std::regex_search(path, m, re)) return std::nullopt;
  const std::string text = m[1];
  // float(text): digits, one character, digits; it parses only when that character is '.'
  // (or a digit), and int() truncates.
  if (text.find_first_not_of("0123456789.") != std::string::npos || std::count(text.begin(), text.end(), '.') > 1) return std::nullopt;
  if (text.size() > 18) return std::nullopt;
  return static_cast<int64_t>(std::strtod(text.c_str(), nullptr));
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
