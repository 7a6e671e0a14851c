// shardkit-tokenize INPUT.txt OUTPUT_PREFIX: turns a text file into a
// byte-level Megatron mmap indexed dataset (OUTPUT_PREFIX.bin/.idx), so the
// main job trains on bundled text with nothing downloaded. Token ids are the
// bytes (0-255); each paragraph (text between blank lines) is one document
// and ends with the end-of-document token 256. Vocabulary size: 257.
//   shardkit-tokenize --dump PREFIX START COUNT   prints COUNT tokens from START
//   shardkit-tokenize --samples PREFIX SEQ_LENGTH SEED START COUNT
//       prints training samples START.. (seq_length + 1 tokens each) in the
//       order the training core draws them, one per line
#include <CLI/CLI.hpp>
#include <algorithm>
#include <limits>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tools/common/cli.h"
#include "ckpt/util/error.h"
#include "ckpt/util/output_guard.h"
#include "libtrain/hdf5_dataset.h"
#include "libtrain/indexed_dataset.h"

namespace {

// A whole number in [lo, hi], or an error naming the argument.
int64_t Number(const std::string& text, const char* name, int64_t lo, int64_t hi) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v < lo || v > hi)
    throw ckpt::Error(std::string(name) + ": '" + text + "' is not a whole number from " + std::to_string(lo) + " to " +
                      std::to_string(hi));
  return v;
}

constexpr int64_t kMaxPrint = int64_t{1} << 24;  // tokens or samples printed by one call

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Byte-level tokenizer writing Megatron mmap indexed datasets"};
  std::vector<std::string> args;
  bool dump = false, samples = false;
  std::string format = "mmap";
  app.add_option("args", args, "INPUT.txt OUTPUT_PREFIX, or with --dump: PREFIX START COUNT")->required();
  app.add_flag("--dump", dump, "print tokens of an existing dataset");
  app.add_flag("--samples", samples, "print training samples: PREFIX SEQ_LENGTH SEED START COUNT");
  app.add_option("--format", format, "mmap (PREFIX.bin/.idx) or hdf5 (one file, OUTPUT_PREFIX.h5)")->check(CLI::IsMember({"mmap", "hdf5"}));
  SHARDKIT_PARSE(app, argc, argv);
  try {
    if (dump) {
      if (args.size() != 3) throw ckpt::Error("--dump takes PREFIX START COUNT");
      train::IndexedDataset ds(args[0]);
      const int64_t start = Number(args[1], "START", 0, ds.num_tokens());
      std::vector<int32_t> out(Number(args[2], "COUNT", 0, std::min(kMaxPrint, ds.num_tokens() - start)));
      ds.ReadTokens(start, static_cast<int64_t>(out.size()), out.data());
      for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? " " : "") << out[i];
      std::cout << "\n" << ds.num_sequences() << " sequences, " << ds.num_tokens() << " tokens\n";
      return 0;
    }
    if (samples) {
      if (args.size() != 5) throw ckpt::Error("--samples takes PREFIX SEQ_LENGTH SEED START COUNT");
      auto ds = std::make_shared<train::IndexedDataset>(args[0]);
      const int64_t seq = Number(args[1], "SEQ_LENGTH", 1, std::max<int64_t>(1, ds->num_tokens() - 1));
      const uint64_t seed = static_cast<uint64_t>(Number(args[2], "SEED", 0, std::numeric_limits<int64_t>::max()));
      const int64_t start = Number(args[3], "START", 0, std::numeric_limits<int64_t>::max() / 2);
      const int64_t count = Number(args[4], "COUNT", 0, kMaxPrint / (seq + 1));
      train::SampleSource source({ds}, {1.0}, seq, seed);
      std::vector<int32_t> out(seq + 1);
      for (int64_t i = start, end = start + count; i < end; ++i) {
        source.Sample(i, out.data());
        for (size_t j = 0; j < out.size(); ++j) std::cout << (j ? " " : "") << out[j];
        std::cout << "\n";
      }
      return 0;
    }
    if (args.size() != 2) throw ckpt::Error("expected INPUT.txt OUTPUT_PREFIX");
    if (format == "hdf5") ckpt::CheckOutputs({{args[1] + ".h5", "OUTPUT_PREFIX.h5"}}, {{args[0], "INPUT"}});
    else ckpt::CheckOutputs({{args[1] + ".bin", "OUTPUT_PREFIX.bin"}, {args[1] + ".idx", "OUTPUT_PREFIX.idx"}}, {{args[0], "INPUT"}});
    std::ifstream in(args[0], std::ios::binary);
    if (!in) throw ckpt::Error(args[0] + ": cannot open");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    std::vector<std::vector<int32_t>> docs(1);
    for (size_t i = 0; i < text.size(); ++i) {
      const bool paragraph_end = text[i] == '\n' && i + 1 < text.size() && text[i + 1] == '\n';
      docs.back().push_back(static_cast<uint8_t>(text[i]));
      if (paragraph_end) {
        docs.back().push_back(256);
        docs.emplace_back();
        while (i + 1 < text.size() && text[i + 1] == '\n') ++i;
      }
    }
    if (docs.back().empty()) docs.pop_back();
    else docs.back().push_back(256);
    if (docs.empty()) throw ckpt::Error(args[0] + ": no text");
    if (format == "hdf5") {
      std::vector<int32_t> flat;
      for (const auto& d : docs) flat.insert(flat.end(), d.begin(), d.end());
      train::Hdf5Dataset::Write(args[1] + ".h5", flat);
    } else {
      train::IndexedDataset::Write(args[1], docs);
    }
    int64_t tokens = 0;
    for (const auto& d : docs) tokens += static_cast<int64_t>(d.size());
    std::cout << "shardkit-tokenize: " << docs.size() << " documents, " << tokens << " tokens -> " << args[1]
              << (format == "hdf5" ? ".h5" : ".bin/.idx") << "\n";
    return 0;
  } catch (const ckpt::Error& e) {  // bad input (a missing or malformed file, a bad number): named, exit 2
    std::cerr << "shardkit-tokenize: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {  // anything else (a library's own error): a message and exit 1, never an abort
    std::cerr << "shardkit-tokenize: " << e.what() << "\n";
    return 1;
  }
}
