#include "libtrain/tokenizer_vocab.h"

#include <gtest/gtest.h>

#include <fstream>

#include "ckpt/testing/test_util.h"

namespace train {
namespace {

using ckpt::testing::ErrorOf;
using ckpt::testing::TempDir;

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(TokenizerVocab, ByteTokenizerHasBytesPlusEndOfDocument) { EXPECT_EQ(TokenizerVocabSize({"byte", "", "", ""}), 257); }

TEST(TokenizerVocab, HuggingFaceTokenizerJsonCountsAddedTokens) {
  TempDir d("tok");
  // A BPE vocabulary with ids 0..3 and two added tokens past it (Llama 3 style).
  Write(d / "tokenizer.json", R"({"version": "1.0", "added_tokens": [{"id": 4, "content": "<s>"}, {"id": 9, "content": "</s>"}],
                                  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "c": 3}, "merges": ["a b"]}})");
  EXPECT_EQ(TokenizerVocabSize({"huggingface", d.path(), "", ""}), 10);
  EXPECT_EQ(TokenizerVocabSize({"huggingface", d / "tokenizer.json", "", ""}), 10);
}

TEST(TokenizerVocab, UnigramVocabularyIsAList) {
  TempDir d("tok");
  Write(d / "tokenizer.json", R"({"model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.5], ["b", -2.0]]}})");
  EXPECT_EQ(TokenizerVocabSize({"huggingface", d.path(), "", ""}), 3);
}

TEST(TokenizerVocab, SlowTokenizerFilesAndMegatronVocabFile) {
  TempDir d("tok");
  Write(d / "vocab.json", R"({"x": 0, "y": 1, "z": 2})");
  Write(d / "added_tokens.json", R"({"<pad>": 5})");
  EXPECT_EQ(TokenizerVocabSize({"huggingface", d.path(), "", ""}), 6);
  EXPECT_EQ(TokenizerVocabSize({"megatron", "GPT2BPETokenizer", d / "vocab.json", ""}), 3);
}

TEST(TokenizerVocab, BadInputsNameTheFile) {
  TempDir d("tok");
  EXPECT_NE(ErrorOf([&] { TokenizerVocabSize({"huggingface", d.path(), "", ""}); }).find("no tokenizer.json or vocab.json"),
            std::string::npos);
  Write(d / "tokenizer.json", "{\"model\": {\"vocab\": {\"a\": 0, ");
  EXPECT_NE(ErrorOf([&] { TokenizerVocabSize({"huggingface", d.path(), "", ""}); }).find(d / "tokenizer.json" + ": not valid JSON"),
            std::string::npos);
  Write(d / "tokenizer.json", R"({"model": {"vocab": {"a": 0, "b": "one"}}})");
  EXPECT_EQ(ErrorOf([&] { TokenizerVocabSize({"huggingface", d.path(), "", ""}); }),
            d / "tokenizer.json" + ": model.vocab['b'] holds \"one\", not a token id");
  EXPECT_EQ(ErrorOf([&] { TokenizerVocabSize({"sentencepiece", "", "", "t.model"}); }),
            "data.tokenizer: library 'sentencepiece': cannot read its vocabulary size here; set model.vocab_size");
}

}  // namespace
}  // namespace train
