// The vocabulary size a config's data.tokenizer implies, before Megatron pads
// it to make_vocab_size_divisible_by. The training core reads tokenised data,
// so it needs only this number, not the tokenizer itself:
//  - library byte: shardkit-tokenize's 256 bytes plus end-of-document (257);
//  - huggingface: `type` names a tokenizer folder (or its tokenizer.json);
//    the size is one past the largest id in tokenizer.json's model vocabulary
//    and added_tokens, or in vocab.json and added_tokens.json;
//  - megatron (GPT2BPETokenizer and the like): one past the largest id in
//    vocab_file.
// Anything else (sentencepiece models) throws, asking for model.vocab_size.
#pragma once

#include <cstdint>
#include <string>

namespace train {

struct TokenizerSpec {
  std::string library = "byte", type, vocab_file, model;
};

// Throws ckpt::Error naming the file and what is wrong with it.
int64_t TokenizerVocabSize(const TokenizerSpec& t);

}  // namespace train
