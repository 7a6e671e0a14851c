// ckpt-verify PATH [--json] [--no-checksums] [--fingerprints] [--gc [--dry-run]]
// ckpt-verify TAG --against OTHER [--weights_only] [--rtol R] [--atol A] [--no-checksums] [--json]
// PATH is a checkpoint tag or a checkpoint directory (every tag in it).
// Checks markers, every file against manifest.json (size and CRC-32, in
// parallel), missing and extra files, leftover temporaries and rank-grid
// completeness. Exits 1 with the list of problems, 0 when all is well.
// --fingerprints also recomputes every logical tensor's fingerprint from the
// data and checks the manifest's (ckpt/shard/fingerprint.h). --against compares
// two tags of any layouts by their fingerprints (ckpt/shard/tag_compare.h), or
// with --rtol/--atol as numbers within a tolerance.
// --gc removes incomplete tags (no `done`) and leftover temporaries from a
// checkpoint directory, refusing while a running job holds its lock.
#include <cmath>
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "ckpt/store/checkpoint_store.h"
#include "tools/common/cli.h"
#include "ckpt/util/error.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/shard/model_description.h"
#include "ckpt/pt/xser.h"
#include "ckpt/util/progress.h"
#include "ckpt/shard/source_registry.h"
#include "ckpt/shard/tag_compare.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/store/tag_writer.h"
#include "tools/format_hints_cli.h"

namespace {

int Gc(ckpt::Env* env, const std::string& dir, bool dry_run, bool json) {
  auto lock = env->LockFile(dir + "/" + ckpt::kStoreLockFile, /*exclusive=*/true, /*wait=*/false);
  if (!lock) {
    std::cerr << "ckpt-verify: " << dir << ": a running job holds " << ckpt::kStoreLockFile
              << "; not removing anything while it may be saving\n";
    return 1;
  }
  nlohmann::ordered_json removed = nlohmann::ordered_json::array();
  nlohmann::ordered_json kept = nlohmann::ordered_json::array();
  for (const auto& t : ckpt::ListTags(env, dir)) {
    if (t.has_done || t.listed_in_newest) continue;
    // Only what carries our markers or NxD's tag structure is ours to collect.
    if (const std::string why = ckpt::NotATag(env, t.path); !why.empty() || env->ListDir(t.path).empty()) {
      kept.push_back({{"path", t.path}, {"why", why.empty() ? "an empty folder, not a checkpoint tag" : why}});
      continue;
    }
    // A tool's staging folder is its writer's while that writer lives
    // (ckpt/store/tag_writer.h): collected only under its lock.
    std::unique_ptr<ckpt::FileLock> writer;
    if (const std::string lock = ckpt::WriterLockOf(t.path); !lock.empty()) {
      std::string holder;
      if (!(writer = ckpt::TryLockWriter(env, lock, &holder))) {
        kept.push_back({{"path", t.path}, {"why", "a live writer is writing it (" + holder + ")"}});
        continue;
      }
    }
    removed.push_back({{"path", t.path}, {"why", "incomplete: no done marker"}});
    if (!dry_run) ckpt::DeleteTag(env, t.path);
  }
  for (const auto& name : env->ListDir(dir))
    if (ckpt::IsTempPath(name)) {
      removed.push_back({{"path", dir + "/" + name}, {"why", "leftover temporary file"}});
      if (!dry_run) env->RemoveAll(dir + "/" + name);
    }
  if (!dry_run) env->SyncDir(dir);
  if (json) {
    std::cout << nlohmann::ordered_json{{"dry_run", dry_run}, {"removed", removed}, {"kept", kept}}.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    for (const auto& r : removed)
      std::cout << (dry_run ? "would remove " : "removed ") << r["path"].get<std::string>() << " ("
                << r["why"].get<std::string>() << ")\n";
    for (const auto& k : kept)
      std::cout << "left alone " << k["path"].get<std::string>() << ": not ours to remove (" << k["why"].get<std::string>() << ")\n";
    if (removed.empty()) std::cout << "nothing to remove\n";
  }
  return 0;
}

// ckpt-verify TAG --against OTHER: 0 when both hold the same state, 1 naming
// every tensor that differs, 2 when either is not a readable tag. A tag's
// recorded fingerprints are used once its files match its manifest's
// checksums (skipped with --no-checksums: then only the manifests speak).
int Against(ckpt::Env* env, const std::string& a, const std::string& b, const ckpt::SourceOptions& read, bool checksums, bool json,
            const ckpt::CompareOptions& tolerance) {
  std::vector<ckpt::TagDifference> failed;
  for (const std::string& t : {a, b})
    if (checksums && env->Exists(t + "/" + ckpt::kManifestFile))
      for (const auto& p : ckpt::VerifyTag(env, t, {.checksums = true}).problems)
        failed.push_back({"", t + (p.file.empty() ? "" : "/" + p.file) + ": " + p.what});
  ckpt::CompareReport r;
  if (failed.empty()) {
    const ckpt::SourceRegistry& sources = ckpt::SourceRegistry::Default();
    const auto ta = sources.Open(env, a, read, "tag"), tb = sources.Open(env, b, read, "tag");
    r = ckpt::CompareTags(*ta.state, *tb.state, tolerance);
  } else {
    r.differences = failed;  // a tag that fails verification proves nothing
  }
  const bool same = r.differences.empty();
  auto source = [](bool recorded) { return recorded ? "computed from the data, and the manifest's checked" : "computed from the data"; };
  if (json) {
    nlohmann::ordered_json d = nlohmann::ordered_json::array();
    for (const auto& x : r.differences) d.push_back({{"tensor", x.name}, {"difference", x.what}});
    std::cout << nlohmann::ordered_json{{"tag", a}, {"against", b}, {"same", same}, {"tensors_compared", r.tensors},
                                        {"bytes_compared", r.bytes}, {"fingerprints", {{a, source(r.recorded_a)}, {b, source(r.recorded_b)}}},
                                        {"rtol", tolerance.rtol}, {"atol", tolerance.atol}, {"tensors_within_tolerance", r.inexact},
                                        {"max_abs_diff", r.max_abs_diff}, {"max_rel_diff", r.max_rel_diff}, {"max_rel_diff_at", r.max_rel_at},
                                        {"differences", d}}
                     .dump(2, ' ', false, nlohmann::json::error_handler_t::replace)
              << "\n";
  } else {
    for (const auto& x : r.differences) std::cout << "DIFFERS  " << (x.name.empty() ? "(tag)" : x.name) << ": " << x.what << "\n";
    std::cout << (same ? "same     " : "FAILED   ") << a << " and " << b << ": " << r.tensors << " logical tensors, "
              << ckpt::HumanBytes(r.bytes) << " compared by fingerprint (" << source(r.recorded_a) << ", " << source(r.recorded_b) << ")"
              << (same ? "" : ", " + std::to_string(r.differences.size()) + " differ") << "\n";
    if (tolerance.rtol > 0 || tolerance.atol > 0) {
      char line[256];
      std::snprintf(line, sizeof line, "         %llu equal within rtol %g atol %g; largest difference %.3g absolute, %.3g relative%s%s\n",
                    static_cast<unsigned long long>(r.inexact), tolerance.rtol, tolerance.atol, r.max_abs_diff, r.max_rel_diff,
                    r.max_rel_at.empty() ? "" : " at ", r.max_rel_at.c_str());
      std::cout << line;
    }
  }
  return same ? 0 : 1;
}

// Problems of a tag's recorded fingerprints against the data they describe.
std::vector<ckpt::TagProblem> CheckFingerprints(ckpt::Env* env, const std::string& tag) {
  // Only a manifest that records fingerprints has any to check (and records
  // the model format that opening the tag needs).
  if (!ckpt::Manifest::Load(env, tag + "/" + ckpt::kManifestFile).tensors) return {};
  const auto t = ckpt::SourceRegistry::Default().Open(env, tag, {}, "tag").state;
  std::vector<ckpt::TagProblem> out;
  const ckpt::TensorFingerprints have = ckpt::ComputeFingerprints(*t), &want = *t->recorded_fingerprints();
  for (const auto& [name, fields] : have)
    for (const auto& [field, f] : fields)
      if (!want.count(name) || !want.at(name).count(field)) out.push_back({ckpt::kManifestFile, "records no fingerprint of " + name + " " + field});
  for (const ckpt::FingerprintMismatch& m : ckpt::RecordedMismatches(want, have)) {
    const ckpt::TensorFingerprint &w = m.recorded, &f = m.computed;
    out.push_back({ckpt::kManifestFile, "the fingerprint of " + m.tensor + " " + m.field + " is " + ckpt::CrcHex(w.crc32) + " (" +
                                            std::to_string(w.numel) + " " + w.dtype + "), the data's is " + ckpt::CrcHex(f.crc32) + " (" +
                                            std::to_string(f.numel) + " " + f.dtype + ")"});
  }
  for (const auto& [name, fields] : want)
    for (const auto& [field, f] : fields)
      if (!have.count(name) || !have.at(name).count(field))
        out.push_back({ckpt::kManifestFile, "records a fingerprint of " + name + " " + field + ", which the tag does not hold"});
  return out;
}

// The virtual pipeline stages per pp rank of a tag that verified: its
// manifest's recorded stage map when it has one, else the tag reader's rule
// (StageSplitOfFiles) over the layer names of tp rank 0's model files (NxD
// writes no manifest); 1 when neither tells.
int VirtualStages(ckpt::Env* env, const std::string& tag, const ckpt::TagReport& r) {
  if (!r.grid || r.grid->pp == 1) return 1;
  try {
    if (r.has_manifest) {
      const ckpt::Manifest m = ckpt::Manifest::Load(env, tag + "/" + ckpt::kManifestFile);
      const auto split = m.layout ? ckpt::StageSplitOf(m.layout->stages) : std::nullopt;
      if (split || m.layout) return split ? split->virtual_stages : 1;
    }
    std::vector<ckpt::Value> files;
    for (int p = 0; p < r.grid->pp; ++p) files.push_back(ckpt::LoadTagFile(env, tag, ckpt::RankFilePath(ckpt::RankFileKind::kModel, {0, 0, p})));
    ckpt::ModelEvidence e;
    e.dir = tag, e.grid = *r.grid;
    e.model = [&](int, int p) -> const ckpt::Dict& { return files[static_cast<size_t>(p)].as_dict(); };
    e.path = [&](const std::string& rel) { return tag + "/" + rel; };
    return ckpt::StageSplitOfFiles(e).virtual_stages;
  } catch (const ckpt::Error&) {
    return 1;  // the tag reader says why when it reads the tag
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Verify NxDT checkpoint tags against their manifests and rank grid"};
  std::string path;
  bool json = false, no_checksums = false, gc = false, dry_run = false, weights_only = false;
  app.add_option("path", path, "a checkpoint tag or a checkpoint directory")->required();
  app.add_flag("--json", json, "print the report as JSON");
  app.add_flag("--no-checksums", no_checksums, "check sizes only");
  app.add_flag("--gc", gc, "remove incomplete tags and leftover temporaries");
  app.add_flag("--dry-run", dry_run, "with --gc: list what would be removed");
  std::string against;
  tools::FormatHintOptions hints;
  bool fingerprints = false;
  app.add_flag("--fingerprints", fingerprints, "also recompute each logical tensor's fingerprint and check it against the manifest's");
  app.add_option("--against", against, "another tag, in any layout: do both hold the same model and optimizer state?");
  ckpt::CompareOptions tolerance;
  app.add_flag("--weights_only", weights_only, "with --against: compare the models alone (neither tag's optimizer state is read)");
  app.add_option("--rtol", tolerance.rtol, "with --against: equal within |a-b| <= atol + rtol*|b| (numpy.allclose), not bit for bit")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--atol", tolerance.atol, "with --against: the absolute part of the tolerance")->check(CLI::Range(0.0, 1e30));
  hints.AddTo(app);  // with --against, for a tag without a manifest
  SHARDKIT_PARSE(app, argc, argv);
  if (!std::isfinite(tolerance.rtol) || !std::isfinite(tolerance.atol)) {  // NaN passes CLI11's range check
    std::cerr << "error: --rtol and --atol take numbers (not nan or inf)\n";
    return 2;
  }
  auto* env = ckpt::Env::Default();
  try {
    if (!against.empty()) {
      return Against(env, path, against, {.hints = hints.Hints(), .weights_only = weights_only}, !no_checksums, json, tolerance);
    }
    if (!env->IsDirectory(path)) throw ckpt::Error(path + ": not a directory");
    if (gc) {
      if (ckpt::LooksLikeTag(env, path)) throw ckpt::Error(path + ": --gc takes a checkpoint directory, not a tag");
      return Gc(env, path, dry_run, json);
    }
    std::vector<std::string> tags;
    if (ckpt::LooksLikeTag(env, path)) tags.push_back(path);
    else
      for (const auto& t : ckpt::ListTags(env, path)) tags.push_back(t.path);
    if (tags.empty()) throw ckpt::Error(path + ": no checkpoint tags found");
    bool all_ok = true;
    nlohmann::ordered_json out = {{"tags", nlohmann::ordered_json::array()}};
    for (const auto& t : tags) {
      auto r = ckpt::VerifyTag(env, t, {.checksums = !no_checksums});
      if (fingerprints && r.ok() && r.has_manifest)
        for (auto& p : CheckFingerprints(env, t)) r.problems.push_back(std::move(p));
      all_ok &= r.ok();
      nlohmann::ordered_json problems = nlohmann::ordered_json::array();
      for (const auto& p : r.problems) problems.push_back({{"file", p.file}, {"problem", p.what}});
      nlohmann::ordered_json tj = {{"path", t}, {"ok", r.ok()}, {"done", r.has_done}, {"manifest", r.has_manifest}, {"model_only", r.model_only},
                                   {"files_checked", r.files_checked}, {"bytes_checked", r.bytes_checked}};
      const int virtual_stages = r.ok() ? VirtualStages(env, t, r) : 1;
      if (r.grid) tj["grid"] = {{"tp", r.grid->tp}, {"pp", r.grid->pp}, {"dp", r.grid->dp}, {"zero1", r.grid->zero1}};
      if (r.grid && virtual_stages > 1) tj["grid"]["virtual_pipeline_size"] = virtual_stages;
      tj["problems"] = problems;
      out["tags"].push_back(tj);
      if (!json) {
        std::cout << (r.ok() ? "ok      " : "FAILED  ") << t;
        if (r.grid)
          std::cout << "  (tp=" << r.grid->tp << " pp=" << r.grid->pp << " dp=" << r.grid->dp << (r.grid->zero1 ? " zero1" : "")
                    << (virtual_stages > 1 ? ", " + std::to_string(virtual_stages) + " virtual stages" : "") << ")";
        if (r.model_only) std::cout << "  weights only: model/ alone, as NxD's checkpoint_converter.py writes it";
        std::cout << "\n";
        for (const auto& p : r.problems) std::cout << "  " << (p.file.empty() ? "(tag)" : p.file) << ": " << p.what << "\n";
      }
    }
    out["ok"] = all_ok;
    if (json) std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";  // folder names need not be UTF-8
    return all_ok ? 0 : 1;
  } catch (const ckpt::Error& e) {
    std::cerr << "ckpt-verify: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {  // a library's own error: a message and an exit code, never an abort
    std::cerr << "ckpt-verify: " << path << ": " << e.what() << "\n";
    return 2;
  }
}
