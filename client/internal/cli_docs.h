#ifndef RDMA_AGENTD_CLIENT_INTERNAL_CLI_DOCS_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_CLI_DOCS_H_

// Shell completion and a man page for a CLI11 command line, generated from
// the same parser that reads the arguments, so that they never drift from
// --help.

#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/string_view.h"

namespace rdma_agent::client::internal {

// A bash completion script for `app`: its subcommands, each one's options
// and the global ones; files after options that name a file, the choices of
// -o/--output and --access; nothing is guessed for other values.
std::string BashCompletion(const CLI::App& app);

// A man page (troff, man(7) macros) for `app`: NAME, SYNOPSIS,
// DESCRIPTION, OPTIONS, COMMANDS (each with its options and footer),
// `extra_sections` (already troff) and the version.
std::string ManPage(const CLI::App& app, absl::string_view version,
                    absl::string_view extra_sections);

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_CLI_DOCS_H_
