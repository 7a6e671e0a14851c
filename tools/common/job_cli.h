// The job a command line asks for, as the ranks of one mpirun compare it
// (ckpt/store/job_agreement.h): every option given, by its name, in the
// order the command declares them, except those that cannot change what is
// written (threads, memory budgets, how the summary is printed); inputs are
// described by their resolved path and size, outputs by their resolved path.
// A new option is part of the job unless a command lists it as not changing
// the output, so forgetting one refuses too much, never too little.
#pragma once

#include <CLI/CLI.hpp>
#include <set>
#include <string>

#include "ckpt/store/job_agreement.h"
#include "ckpt/util/env.h"

namespace tools {

struct JobOptions {
  std::string command;                     // "ckpt-reshard": ranks running different programs differ here
  std::set<std::string> inputs;            // option names (positional: their name, "src") whose values are read
  std::set<std::string> outputs;           // option names whose values are written
  std::set<std::string> not_in_output;     // option names that cannot change what is written
};

// Of a parsed `app`. Reads only file sizes (DescribeInput).
ckpt::JobFields JobOf(const CLI::App& app, const JobOptions& o, ckpt::Env* env);

}  // namespace tools
