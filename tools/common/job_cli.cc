#include "tools/common/job_cli.h"

namespace tools {

ckpt::JobFields JobOf(const CLI::App& app, const JobOptions& o, ckpt::Env* env) {
  ckpt::JobFields job{{"command", o.command}};
  for (const CLI::Option* opt : app.get_options()) {
    std::string name = opt->get_name();
    if (name.empty()) name = opt->get_name(/*positional=*/true);
    if (opt->count() == 0 || o.not_in_output.count(name)) continue;
    std::string value;
    for (const std::string& v : opt->results()) {
      const std::string one = o.inputs.count(name) ? ckpt::DescribeInput(env, v) : o.outputs.count(name) ? ckpt::DescribeOutput(v) : v;
      value += (value.empty() ? "" : ", ") + one;
    }
    job.emplace_back(name, value);
  }
  return job;
}

}  // namespace tools
