#include "ckpt/spec/tag_paths.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <regex>

#include "ckpt/util/error.h"

namespace ckpt {

namespace {
std::string Pad2(int v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%02d", v);
  return buf;
}
}  // namespace

std::string RankFileName(const RankCoord& r) {
  return "dp_rank_" + Pad2(r.dp) + (r.ep ? "_ep_rank_" + Pad2(*r.ep) : "") + "_tp_rank_" + Pad2(r.tp) + "_pp_rank_" + Pad2(r.pp) + ".pt";
}

std::string RankFilePath(RankFileKind kind, const RankCoord& r) {
  return (kind == RankFileKind::kModel ? "model/" : "optim/") + RankFileName(r);
}

std::optional<RankCoord> ParseAnyRankFileName(const std::string& name) {
  // At most 6 digits: longer numbers are no rank file (and would overflow int).
  // NxD trainer/checkpoint.py _get_path(..., ep=True) puts the ep rank after dp.
  static const std::regex re(R"(dp_rank_(\d{1,6})(_ep_rank_(\d{1,6}))?_tp_rank_(\d{1,6})_pp_rank_(\d{1,6})\.pt)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  RankCoord c{std::stoi(m[1]), std::stoi(m[4]), std::stoi(m[5])};
  if (m[2].matched) c.ep = std::stoi(m[3]);
  return c;
}

std::optional<RankCoord> ParseRankFileName(const std::string& name) {
  auto c = ParseAnyRankFileName(name);
  if (c && c->ep)
    throw Error(name + ": an expert-parallel rank file (_ep_rank_) of an MoE (Mixtral) tag where none is read: shardkit reads an "
                "expert-parallel tag's model files so named and its optimizer as NxD's NeuronEPZero1Optimizer files, named by dp rank alone");
  return c;
}

std::string EpNamingProblem(const std::vector<RankCoord>& coords) {
  const bool any = std::any_of(coords.begin(), coords.end(), [](const RankCoord& c) { return c.ep.has_value(); });
  const bool all = std::all_of(coords.begin(), coords.end(), [](const RankCoord& c) { return c.ep.has_value(); });
  const bool above_0 = std::any_of(coords.begin(), coords.end(), [](const RankCoord& c) { return c.ep.value_or(0) > 0; });
  if (!any || (all && above_0)) return "";
  return std::string("an expert-parallel rank file (_ep_rank_) ") + (all ? "of ep rank 0 alone" : "beside model files without an ep rank") +
         "; NxD names the ep rank in every model file of an MoE (Mixtral) tag at ep size > 1, and only there (trainer/checkpoint.py _get_path)";
}

std::string FormatTagName(const TagName& t) {
  char c[64];
  // Python's float repr for the integral values Lightning stores: "5120.0".
  if (t.consumed_samples == std::floor(t.consumed_samples) && std::fabs(t.consumed_samples) < 1e15)
    std::snprintf(c, sizeof c, "%.1f", t.consumed_samples);
  else
    std::snprintf(c, sizeof c, "%.17g", t.consumed_samples);
  return t.name + "--step=" + std::to_string(t.step) + "-consumed_samples=" + c + (t.last ? "-last" : "") + ".ckpt";
}

std::optional<TagName> ParseTagName(const std::string& dir_name) {
  static const std::regex re(R"((.*)--step=(\d{1,18})-consumed_samples=([0-9.eE+-]+?)(-last)?\.ckpt)");
  std::smatch m;
  if (!std::regex_match(dir_name, m, re)) return std::nullopt;
  TagName t;
  t.name = m[1];
  t.step = std::stoll(m[2]);
  try {
    t.consumed_samples = std::stod(m[3]);
  } catch (const std::exception&) {  // not a number ("1e999", "-"): not one of our names
    return std::nullopt;
  }
  t.last = m[4].matched;
  return t;
}

std::optional<int64_t> ParseNxdStepTagName(const std::string& dir_name) {
  static const std::regex re(R"(step_(\d{1,18}))");
  std::smatch m;
  if (!std::regex_match(dir_name, m, re)) return std::nullopt;
  return std::stoll(m[1]);
}

bool IsSetAsideTagName(const std::string& name) {
  for (const std::string suffix : {kDamagedSuffix, kSupersededSuffix}) {
    const size_t at = name.rfind(suffix);
    if (at == std::string::npos || at == 0) continue;
    const std::string rest = name.substr(at + suffix.size());  // "" or "-N"
    if (rest.empty() || (rest.size() > 1 && rest[0] == '-' && rest.find_first_not_of("0123456789", 1) == std::string::npos))
      return true;
  }
  return false;
}

}  // namespace ckpt
