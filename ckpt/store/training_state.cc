#include "ckpt/store/training_state.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <regex>

#include "ckpt/pt/xser.h"
#include "ckpt/spec/tag_paths.h"
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

// A recorded step (or epoch): whole and in [0, kMaxRecordedStep]. Throws naming `what` and the value.
int64_t RecordedStep(const Value& v, const std::string& what) {
  const int64_t s = AsInteger(v, what);
  if (s < 0) throw Error(what + " is " + std::to_string(s) + ", negative");
  if (s > kMaxRecordedStep)
    throw Error(what + " is " + std::to_string(s) + ", beyond 2^40 (" + std::to_string(kMaxRecordedStep) + "), more than any run takes");
  return s;
}

// A recorded sample count: finite, whole, in [0, kMaxRecordedSamples] (an int, a float or a one-element tensor).
double RecordedSamples(const Value& v, const std::string& what) {
  double d = 0;
  try {
    d = v.is_int() ? static_cast<double>(v.as_int()) : AsScalar(v);
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
  const std::string shown = v.is_int() ? std::to_string(v.as_int()) : std::to_string(d);
  if (!std::isfinite(d)) throw Error(what + " is " + shown + ", not a finite count");
  if (d < 0) throw Error(what + " is " + shown + ", negative");
  if (d != std::floor(d)) throw Error(what + " is " + shown + ", not a whole number of samples");
  if (d > static_cast<double>(kMaxRecordedSamples))
    throw Error(what + " is " + shown + ", beyond 2^53 (" + std::to_string(kMaxRecordedSamples) + "), more than any run consumes");
  return d;
}

// A scheduler state's LRs (torch's base_lrs and _last_lr lists): each finite and not negative.
void CheckLearningRates(const Dict& sched, const std::string& where) {
  for (const char* key : {"base_lrs", "_last_lr"}) {
    const Value* lrs = sched.Find(key);
    if (!lrs) continue;
    if (!lrs->is_seq()) throw Error(where + "." + key + " is a " + lrs->kind_name() + ", not a list of learning rates");
    for (size_t i = 0; i < lrs->as_seq().items.size(); ++i) {
      const std::string at = where + "." + key + "[" + std::to_string(i) + "]";
      const Value& x = lrs->as_seq().items[i];
      double lr = 0;
      try {
        lr = x.is_int() ? static_cast<double>(x.as_int()) : AsScalar(x);
      } catch (const Error& e) {
        throw Error(at + ": " + e.what());
      }
      if (!std::isfinite(lr) || lr < 0) throw Error(at + " is " + std::to_string(lr) + ", not a learning rate (finite, not negative)");
    }
  }
}

// Lightning's completed optimizer steps in `loops`, if it records them.
std::optional<int64_t> LoopsStep(const Value& loops, const std::string& where) {
  const Value* v = &loops;
  for (const char* k : {"fit_loop", "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total", "completed"}) {
    if (!v->is_dict()) return std::nullopt;
    v = v->as_dict().Find(k);
    if (!v) return std::nullopt;
  }
  return RecordedStep(*v, where + ": loops' completed optimizer steps");
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
      u.epoch = RecordedStep(x, where + ": epoch");
    } else if (key == "global_step") {
      u.global_step = RecordedStep(x, where + ": global_step");
      step = true;
    } else if (key == "consumed_samples") {
      u.consumed_samples = RecordedSamples(x, where + ": consumed_samples");
    } else {
      u.carried.emplace_back(key, x);
    }
  }
  if (!step) throw Error(where + ": has no global_step");
  // What resume reads is checked now, so a malformed entry is named here.
  if (const Value* loops = u.Carried("loops")) LoopsStep(*loops, where);
  if (const Value* s = u.LrScheduler()) {
    if (!s->is_dict()) throw Error(where + ": lr_schedulers[0] is not a dict");
    if (const Value* e = s->as_dict().Find("last_epoch")) RecordedStep(*e, where + ": lr_schedulers[0].last_epoch");
    CheckLearningRates(s->as_dict(), where + ": lr_schedulers[0]");
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
      s.last_epoch = RecordedStep(x, where + ": last_epoch");
      s.last_epoch_at_ = s.carried.size();
      found = true;
    } else {
      s.carried.emplace_back(key, x);
    }
  }
  if (!found) throw Error(where + ": has no last_epoch");
  CheckLearningRates(v.as_dict(), where);
  return s;
}

RecordedPosition PositionFromContent(const UserContent* content, const std::string& tag_name, SamplesFromName rule) {
  RecordedPosition at;
  const auto named = ParseTagName(tag_name);
  at.named_step = named ? std::optional(named->step) : ParseNxdStepTagName(tag_name);
  at.samples_nxdt_reads = ConsumedSamplesFromTagPath(tag_name);
  // The name is a label a later rename or copy can change; the content is what the save recorded.
  at.step_from_content = content != nullptr;
  at.step = content ? std::optional(content->ResumeStep()) : at.named_step;
  if (content && content->consumed_samples) {
    at.consumed_samples = *content->consumed_samples, at.samples_from_content = true;
  } else if (rule == SamplesFromName::kTagName && named) {
    at.consumed_samples = named->consumed_samples;
  } else if (at.samples_nxdt_reads) {
    at.consumed_samples = static_cast<double>(*at.samples_nxdt_reads);
  }
  return at;
}

TrainingPosition ReadTrainingPosition(Env* env, const std::string& tag) {
  TrainingPosition at;
  const std::string name = std::filesystem::path(tag).filename().string();
  if (!env->Exists(tag + "/" + kUserContentFile)) {
    at.notes.push_back("info: " + tag + " holds no " + kUserContentFile + " (weights only); training starts at step 0");
    return at;
  }
  const std::string path = tag + "/" + kUserContentFile;
  const Value content = LoadTagFile(env, tag, kUserContentFile);
  // NxD's own trainer saves free-form user content (its llama example: total_steps, batch_idx,
  // cli_args) and names tags step_<N>: the step comes from the name, the schedule from scheduler.pt.
  std::optional<UserContent> uc;
  if (const auto nxd_step = ParseNxdStepTagName(name); nxd_step && content.is_dict() && !content.as_dict().Find("global_step"))
    at.notes.push_back("info: " + path + " is NxD's free-form user content (no global_step); the step is " + std::to_string(*nxd_step) +
                       ", from the tag's name");
  else
    uc = UserContent::FromValue(content, path);
  const RecordedPosition pos = PositionFromContent(uc ? &*uc : nullptr, name, SamplesFromName::kAsNxdtReads);
  at.step = *pos.step;
  at.step_recorded = true;
  // A name that disagrees is told and not used, so a tag named past every real step cannot hold
  // resume at its true step forever (resume orders tags by this step too).
  if (pos.named_step && *pos.named_step != at.step)
    at.notes.push_back("warning: " + name + " is named for step " + std::to_string(*pos.named_step) + " but " + kUserContentFile +
                       " records step " + std::to_string(at.step) + "; resuming at step " + std::to_string(at.step) + ", what the tag records");
  const std::optional<int64_t>& named_samples = pos.samples_nxdt_reads;
  if (pos.samples_from_content) {
    at.consumed_samples = static_cast<int64_t>(*pos.consumed_samples);
    if (named_samples && *named_samples != *at.consumed_samples)
      at.notes.push_back("warning: " + name + " is named consumed_samples=" + std::to_string(*named_samples) + " but " + kUserContentFile +
                         " records " + std::to_string(*at.consumed_samples) + "; resuming from " + std::to_string(*at.consumed_samples) +
                         ", what the tag records");
  } else if (named_samples) {  // NxDT records them in the name only
    if (*named_samples > kMaxRecordedSamples)
      throw Error(name + ": its name's consumed_samples=" + std::to_string(*named_samples) + " is beyond 2^53 (" +
                  std::to_string(kMaxRecordedSamples) + "), more than any run consumes, and " + kUserContentFile + " records none");
    at.consumed_samples = *named_samples;
  } else {
    at.notes.push_back("warning: " + name + " names no consumed_samples=N.N and its user content records none; assuming 0, as NxDT does");
  }
  if (const auto lr_step = uc ? uc->LrSchedulerStep() : std::nullopt) {
    at.schedule_step = *lr_step;
  } else if (env->Exists(tag + "/" + kSchedulerFile)) {  // shardkit's older tags, NxD's own trainer
    at.schedule_step = SchedulerState::FromValue(LoadTagFile(env, tag, kSchedulerFile), tag + "/" + kSchedulerFile).last_epoch;
  } else {
    at.notes.push_back("warning: " + path + " holds no lr_schedulers; the LR schedule restarts from warmup, as NxDT's does");
  }
  return at;
}

}  // namespace ckpt
