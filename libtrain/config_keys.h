// Every key of an NxDT config, as shardkit-train takes it, in one table
// (config_keys.cc): read (TrainConfig holds it), ignored (it changes nothing
// shardkit trains or writes, e.g. a Neuron compiler or runtime setting:
// reported once, with the reason) or refused (it changes the model, the loss
// or the data in a way shardkit does not implement: the run stops before any
// work, naming it). A key the table does not know is refused too: NxDT reads
// some keys wherever they sit (utils/utils.py get_attribute_from_cfg), so an
// unknown key may well change what NxDT trains.
//
// Sources: NxDT 9169aa0's example configs (examples/conf/*.yaml, copied in
// tests/data/configs/nxdt/), examples/training_orchestrator.py
// process_config, lightning_modules/ and models/.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <string_view>
#include <vector>

namespace train {

enum class KeyUse { kRead, kIgnored, kRefused };

struct KeyRule {
  std::string_view key;  // dotted path; the rule of a section covers every key under it
  KeyUse use;
  // kIgnored: why it changes nothing here. kRefused (and kRead with `values`):
  // what it does that shardkit does not implement.
  std::string_view why;
  // kRefused: the values that leave the feature off, accepted silently (null
  // always does); empty: refused whatever it says. kRead: the only values
  // shardkit implements, others refused; empty: the reader checks the value.
  std::vector<std::string_view> values;
  // kRead: the key that must be above 1 for a value above 1 of this one (else
  // refused, with `why`: what needs it); empty: none.
  std::string_view needs_above_one = {};
  // kRefused section: "key=value" of another key under which the section is
  // not refused but walked into, each key under it judged by its own rule;
  // empty: refused always.
  std::string_view walked_when = {};
};

// The rule for a dotted key (a section's covers the keys under it); nullptr
// if the table does not know it.
const KeyRule* FindKeyRule(std::string_view dotted);

struct KeyCheck {
  std::vector<std::string> ignored;  // "key (why)", in config order
  std::vector<std::string> refused;  // "key: value: why", in config order
};

// Walks every key of a resolved config against the table: a key with a rule
// is judged whole (a sequence or a section is one value); null, an empty
// mapping or one of unset values is unset and passes.
KeyCheck CheckConfigKeys(const YAML::Node& root);

}  // namespace train
