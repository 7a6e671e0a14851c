// ckpt-export SRC OUT.h5 [--weights_only] [--dtype keep|float32]
//             [--compression none|gzip] [--overwrite] [--no_verify] [--json]
// writes a checkpoint tag (or a folder's newest complete tag) as one
// layout-free HDF5 file (tools/h5_state.h), streaming: memory holds one
// block.
// ckpt-export SRC OUT_DIR --format hf [--max_shard_size 10G] [--bin] [--threads N]
// writes its weights as a Hugging Face model folder (tools/hf_export.h), N
// threads reading the next chunks while one writes; --format
// full_state as NxD's converter's OUT_DIR/checkpoint.pt. With --lora_base
// BASE (an HF folder or a tag), an adapter-only LoRA tag is merged into BASE
// (tools/lora_base.h).
// The output is written beside OUT under a temporary name, made durable and
// only then renamed to OUT, so OUT is never partial; an existing OUT is
// replaced only with --overwrite and only when it is such an export.
// Exit 0 on success, 2 for bad input, 1 for anything unexpected.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <iostream>
#include <thread>
#include <nlohmann/json.hpp>

#include "tools/common/cli.h"
#include "ckpt/spec/lora.h"
#include "ckpt/util/error.h"
#include "ckpt/shard/source_check.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/pt/value_json.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/util/progress.h"
#include "ckpt/shard/source_registry.h"
#include "tools/format_hints_cli.h"
#include "tools/h5_state.h"
#include "tools/all_sources.h"
#include "tools/hf_export.h"
#include "tools/lora_base.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/shard/stream_budget.h"

namespace {

void FsyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    if (fd >= 0) ::close(fd);
    throw ckpt::Error(path + ": fsync failed");
  }
  ::close(fd);
}

// A folder ckpt-export --format hf wrote: config.json says so.
bool IsHfExport(ckpt::Env* env, const std::string& dir) {
  const std::string config = dir + (env->Exists(dir + "/adapter_config.json") ? "/adapter_config.json" : "/config.json");
  if (!env->IsDirectory(dir) || !env->Exists(config)) return false;
  const auto m = env->MapFile(config);
  const auto j = ckpt::ParseJsonBounded(reinterpret_cast<const char*>(m->data()), reinterpret_cast<const char*>(m->data()) + m->size(), m->path());
  return j.is_object() && j.contains("shardkit_export");
}

// The base model --lora_base names (any source: an HF folder, a tag), read
// for its weights; what an adapter-only tag cannot tell of the model (the
// vocabulary, and the FFN width when no MLP is targeted) is taken from it
// unless given.
ckpt::OpenedSource OpenLoraBase(ckpt::Env* env, const std::string& path, const std::string& format, ckpt::FormatHints& hints,
                                const std::function<void(const std::string&)>& log) {
  if (format != "hf" && format != "full_state")
    throw ckpt::Error("--lora_base merges LoRA adapters into a base for --format hf or full_state, not --format " + format);
  ckpt::OpenedSource base = tools::AllSources().Open(env, path, {.hints = hints, .weights_only = true, .family = ckpt::ModelFamily::kHfLlama});
  for (const auto& n : base.notes) log("note: the base " + path + ": " + n);
  const ckpt::ModelFormat& f = base.state->layout().format;
  if (!hints.vocab_size) hints.vocab_size = f.vocab_size;
  if (!hints.ffn) hints.ffn = f.ffn;
  return base;
}

// Throws ckpt::Error naming the tensor when `tag` records fingerprints its parameters no
// longer match. From what the export read (`read`) when that covers each parameter once;
// else (merged LoRA adapters, --bin's second pass, peft) from a pass of its own.
void CheckWhatWasRead(const ckpt::LogicalState& tag, const ckpt::FingerprintCollector& read, size_t chunk) {
  if (!tag.recorded_fingerprints()) return;
  std::vector<ckpt::LogicalTensor> params = ckpt::LogicalTensors(tag);
  std::erase_if(params, [](const ckpt::LogicalTensor& t) { return t.field != ckpt::StateField::kParam; });
  ckpt::TensorFingerprints computed;
  try {
    computed = read.Finish(params);
  } catch (const ckpt::Error&) {
    return ckpt::CheckRecordedFingerprints(tag, chunk, ckpt::StateField::kParam);
  }
  ckpt::CheckRecordedFingerprints(tag, computed);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a checkpoint's whole state, layout-free, to one HDF5 file"};
  std::string src, out, dtype = "keep", compression = "none", format = "h5", max_shard = "10G", budget = "256M";
  bool weights_only = false, overwrite = false, no_verify = false, json = false;
  app.add_option("src", src, "a checkpoint tag, or a checkpoint folder (its newest complete tag is taken)")->required();
  app.add_option("out", out, "the .h5 file to write")->required();
  app.add_flag("--weights_only", weights_only, "leave out the optimizer state, scheduler and user content (the optimizer files are not read)");
  app.add_option("--dtype", dtype, "keep: bfloat16 as uint16 bit patterns (dtype attribute); float32: widen 16-bit floats")
      ->check(CLI::IsMember({"keep", "float32"}));
  app.add_option("--compression", compression, "none, or gzip (with shuffle)")->check(CLI::IsMember({"none", "gzip"}));
  app.add_option("--format", format,
                 "h5: the whole state in one HDF5 file; hf: the weights as a Hugging Face model folder; full_state: OUT/checkpoint.pt "
                 "(HF names, one torch file) and config.json, as NxD's checkpoint_converter.py --convert_to_full_state writes it; peft: a LoRA "
                 "tag's adapters as a peft folder (adapter_config.json, adapter_model.safetensors)")
      ->check(CLI::IsMember({"h5", "hf", "full_state", "peft"}));
  app.add_option("--max_shard_size", max_shard, "with --format hf: bytes per weights file (default 10G)");
  bool bin = false;
  app.add_flag("--bin", bin, "with --format hf: also write torch's pytorch_model*.bin (default: model*.safetensors only, as transformers saves)");
  app.add_option("--memory_budget", budget,
                 "peak memory to stay within (default 256M; one logical matrix more for GPT-2's and Mixtral's transposes)");
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--threads", threads, "with --format hf or peft: threads reading the next chunks while one writes (default: every core)")
      ->check(CLI::Range(1, 1024));
  app.add_flag("--overwrite", overwrite, "replace an existing export");
  app.add_flag("--no_verify", no_verify, "skip checking the source's checksums first");
  app.add_flag("--json", json, "print the summary as JSON on stdout");
  // Named after NxD's save_lora_base (LoraConfig), the key whose False left the base out of the tag.
  std::string lora_base;
  app.add_option("--lora_base", lora_base,
                 "with --format hf or full_state: the base model (an HF folder or a tag) to merge an adapter-only LoRA tag "
                 "(NxD's save_lora_base False) into");
  tools::FormatHintOptions hints;
  hints.AddTo(app);
  SHARDKIT_PARSE(app, argc, argv);
  auto log = [](const std::string& s) { std::cerr << s << std::endl; };
  ckpt::Env* env = ckpt::Env::Default();
  std::string partial;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    out = ckpt::WithoutTrailingSeparators(out);
    const bool hf = format == "hf" || format == "full_state" || format == "peft";
    // A Hugging Face folder holds weights alone, so the optimizer is never read for it.
    const bool model_only = weights_only || hf;
    const ckpt::SourceTag found = ckpt::FindSourceTag(src, !no_verify, env, log);
    const std::string& tag = found.tag;
    // The checksum pass runs beside the export; the output is renamed into place only once it passed.
    ckpt::SourceCheck check(env, tag, !no_verify && !found.checked, model_only);
    try {
      const uint64_t memory_budget = ckpt::ParseSize(budget, "--memory_budget");
      const uint64_t shard_size = ckpt::ParseSize(max_shard, "--max_shard_size");
      ckpt::CheckOutputs({{out, hf ? "OUT_DIR" : "OUT", hf}}, {{tag, "SRC"}});
      if (env->Exists(out) && !(hf && env->IsDirectory(out) && env->ListDir(out).empty())) {
        if (!overwrite) throw ckpt::Error(out + ": exists; pass --overwrite to replace it (it is kept until the new one is complete)");
        if (hf ? !IsHfExport(env, out) : !tools::IsH5State(out))
          throw ckpt::Error(out + ": --overwrite replaces only what ckpt-export --format " + format + " wrote, and this is not that");
      }
      ckpt::FormatHints given = hints.Hints();
      ckpt::OpenedSource base_model;
      if (!lora_base.empty()) base_model = OpenLoraBase(env, lora_base, format, given, log);
      const ckpt::OpenedSource opened = ckpt::SourceRegistry::Default().Open(env, tag, {.hints = given, .weights_only = model_only}, "tag");
      const ckpt::LogicalState* state = opened.state.get();
      for (const auto& n : opened.notes) log("note: " + n);
      std::unique_ptr<tools::LoraWithBase> joined;
      if (base_model.state) {
        ckpt::CheckRecordedFingerprints(*base_model.state, size_t{1} << 20, ckpt::StateField::kParam);
        state = (joined = std::make_unique<tools::LoraWithBase>(*state, *base_model.state)).get();
      }
      // Memory: what is resident now (the source's index), then for HF, the
      // threads filling chunks and the one writing, shared out as ckpt-reshard's
      // writing threads are; for HDF5, blocks: one read, one widened (float32),
      // and what HDF5 and the writer buffer.
      const uint64_t base = ckpt::CurrentRss() + check.memory(), min_block = 1 << 20;
      if (!hf && memory_budget < base + 4 * min_block)
        throw ckpt::Error("--memory_budget " + ckpt::HumanBytes(memory_budget) + " is too small: the process already holds " +
                          ckpt::HumanBytes(base) + "; give at least " + ckpt::HumanBytes(base + 4 * min_block));
      const size_t block = static_cast<size_t>(
          hf ? ckpt::StreamChunk(memory_budget, base, threads + 1)
             : std::clamp<uint64_t>((memory_budget - base) / 4 / 4096 * 4096, min_block, uint64_t{64} << 20));
      check.Start();

      const std::filesystem::path p(out);
      const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
      partial = dir + "/." + p.filename().string() + ".ckpt-export-partial";
      if (env->Exists(partial)) env->RemoveAll(partial);  // an interrupted earlier export's
      if (hf) {
        if (const std::string why = ckpt::HfUnsupported(state->layout().format); !why.empty()) throw ckpt::Error(tag + ": " + why);
        if (const std::string why = ckpt::LoraHfUnsupported(state->layout().format); !why.empty() && format != "peft") throw ckpt::Error(tag + ": " + why);
        env->CreateDirs(partial);
        ckpt::FingerprintCollector read;
        const tools::HfExportOptions ho{.max_shard_size = shard_size, .chunk = block, .threads = threads, .bin = bin, .full_state = format == "full_state",
                                        .fingerprints = state == opened.state.get() && state->recorded_fingerprints() ? &read : nullptr};
        const tools::HfExportSummary s = format == "peft" ? tools::WritePeftFolder(*state, partial, ho, env) : tools::WriteHfFolder(*state, partial, ho, env);
        // As the HDF5 export and reshard do: a source must still hold what its manifest recorded, before the output is published.
        CheckWhatWasRead(*opened.state, read, block);
        env->SyncDir(partial);
        check.Wait(log);
        const std::string old = dir + "/." + p.filename().string() + ".ckpt-export-old";
        if (env->Exists(out)) env->RenameFile(out, old);
        env->RenameFile(partial, out);
        partial.clear();
        env->SyncDir(dir);
        if (env->Exists(old)) env->RemoveAll(old);
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (json)
          std::cout << nlohmann::ordered_json{{"source", tag}, {"output", out}, {"architecture", s.architecture}, {"tensors", s.tensors},
                                              {"tensor_bytes", s.bytes}, {"shards", s.shards}, {"seconds", secs}, {"peak_rss", ckpt::PeakRss()}}
                           .dump(1)
                    << std::endl;
        log("exported " + std::to_string(s.tensors) + " tensors (" + ckpt::HumanBytes(s.bytes) + ") of " + tag + " as " + s.architecture + " to " +
            out + " (" + (format == "full_state" ? std::string("checkpoint.pt") : std::to_string(s.shards) + " shard(s)") + "); peak memory " + ckpt::HumanBytes(ckpt::PeakRss()));
        return 0;
      }
      tools::ExportOptions o;
      o.weights_only = weights_only;
      o.float32 = dtype == "float32";
      o.gzip = compression == "gzip";
      o.block = block;
      const bool bar = ::isatty(2) && !json;
      int64_t last_logged = -1;
      std::string last_tensor;
      o.progress = [&](uint64_t done, uint64_t total, const std::string& tensor) {
        if (bar) {
          std::fprintf(stderr, "\r%s %s of %s", ckpt::ProgressBar(done, total).c_str(), ckpt::HumanBytes(done).c_str(), ckpt::HumanBytes(total).c_str());
        } else if (tensor != last_tensor || done == total) {  // a line per tensor
          const int64_t pct = total ? static_cast<int64_t>(100 * done / total) : 100;
          if (!last_tensor.empty() && pct != last_logged) log("exported " + last_tensor + " [" + std::to_string(pct) + "%]");
          last_logged = pct;
        }
        last_tensor = tensor;
      };
      const tools::ExportSummary s = tools::WriteH5State(*state, std::filesystem::path(tag).filename().string(), partial, o);
      if (bar) std::fprintf(stderr, "\n");
      FsyncPath(partial);
      check.Wait(log);
      env->RenameFile(partial, out);
      partial.clear();
      env->SyncDir(dir);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const uint64_t size = env->FileSize(out);
      if (json)
        std::cout << nlohmann::ordered_json{{"source", tag},       {"output", out},  {"tensors", s.tensors}, {"tensor_bytes", s.bytes},
                                            {"file_bytes", size},  {"seconds", secs}, {"peak_rss", ckpt::PeakRss()}}
                         .dump(1)
                  << std::endl;
      log("exported " + std::to_string(s.tensors) + " logical tensors (" + ckpt::HumanBytes(s.bytes) + ") of " + tag + " to " + out + " (" +
          ckpt::HumanBytes(size) + ") in " + std::to_string(secs).substr(0, std::to_string(secs).find('.') + 3) + " s; peak memory " +
          ckpt::HumanBytes(ckpt::PeakRss()));
      return 0;
    } catch (const ckpt::Error&) {
      check.ThrowIfFailed(log);
      throw;
    }
  } catch (const ckpt::Error& e) {
    if (!partial.empty() && env->Exists(partial)) env->RemoveAll(partial);
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    if (!partial.empty() && env->Exists(partial)) env->RemoveAll(partial);
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
