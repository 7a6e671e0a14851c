// Command-line parsing shared by every shardkit command (CLI11): --help and
// --version exit 0; every usage error (unknown option, a value out of range,
// a missing argument) prints CLI11's message and exits 2, the code every
// command uses for bad input, instead of CLI11's own codes above 100.
#pragma once

#include <CLI/CLI.hpp>

#define SHARDKIT_PARSE(app, argc, argv)           \
  try {                                           \
    (app).parse((argc), (argv));                  \
  } catch (const CLI::ParseError& e) {            \
    return (app).exit(e) == 0 ? 0 : 2;            \
  }
