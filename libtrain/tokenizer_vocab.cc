#include "libtrain/tokenizer_vocab.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/util/error.h"

namespace train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json ReadJson(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw ckpt::Error(p.string() + ": cannot open");
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw ckpt::Error(p.string() + ": not valid JSON (" + e.what() + ")");
  }
}

int64_t Id(const json& v, const fs::path& file, const std::string& where) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0)
    throw ckpt::Error(file.string() + ": " + where + " holds " + v.dump() + ", not a token id");
  return v.get<int64_t>();
}

// One past the largest id of a {token: id} object (or the length of a list
// of [token, score] pairs, as Unigram models store them).
int64_t VocabEnd(const json& vocab, const fs::path& file, const std::string& where) {
  if (vocab.is_array()) return static_cast<int64_t>(vocab.size());
  if (!vocab.is_object()) throw ckpt::Error(file.string() + ": " + where + " is not a vocabulary (token -> id)");
  int64_t end = 0;
  for (const auto& [token, id] : vocab.items()) end = std::max(end, Id(id, file, where + "['" + token + "']") + 1);
  return end;
}

int64_t HuggingFace(const std::string& type) {
  if (type.empty()) throw ckpt::Error("data.tokenizer.type: must name a Hugging Face tokenizer folder");
  const fs::path p(type);
  const fs::path dir = fs::is_directory(p) ? p : p.parent_path();
  const fs::path tokenizer_json = fs::is_directory(p) ? p / "tokenizer.json" : p;
  if (fs::is_regular_file(tokenizer_json)) {
    const json t = ReadJson(tokenizer_json);
    if (!t.contains("model") || !t["model"].contains("vocab"))
      throw ckpt::Error(tokenizer_json.string() + ": has no model.vocab");
    int64_t end = VocabEnd(t["model"]["vocab"], tokenizer_json, "model.vocab");
    if (t.contains("added_tokens") && t["added_tokens"].is_array())
      for (const auto& a : t["added_tokens"])
        if (a.contains("id")) end = std::max(end, Id(a["id"], tokenizer_json, "added_tokens[].id") + 1);
    return end;
  }
  if (fs::is_regular_file(dir / "vocab.json")) {
    int64_t end = VocabEnd(ReadJson(dir / "vocab.json"), dir / "vocab.json", "the vocabulary");
    if (fs::is_regular_file(dir / "added_tokens.json"))
      end = std::max(end, VocabEnd(ReadJson(dir / "added_tokens.json"), dir / "added_tokens.json", "added tokens"));
    return end;
  }
  throw ckpt::Error(type + ": no tokenizer.json or vocab.json there (data.tokenizer.type); a sentencepiece-only "
                    "tokenizer needs model.vocab_size");
}

}  // namespace

int64_t TokenizerVocabSize(const TokenizerSpec& t) {
  if (t.library == "byte") return 257;
  if (t.library == "huggingface") return HuggingFace(t.type);
  if (t.library == "megatron" && !t.vocab_file.empty())
    return VocabEnd(ReadJson(t.vocab_file), t.vocab_file, "the vocabulary");
  throw ckpt::Error("data.tokenizer: library '" + t.library + "'" + (t.type.empty() ? "" : " type '" + t.type + "'") +
                    ": cannot read its vocabulary size here; set model.vocab_size");
}

}  // namespace train
