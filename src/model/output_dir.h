// The output directory of commands that write a whole model directory (`opd convert`, `opd
// shrink`, `opd init`): checked before any work is done, so a bad --out fails at once instead of
// after minutes of conversion.
#pragma once

#include <filesystem>
#include <string>

namespace opd {

// Checks the --out text `out_dir` of `command` ("convert", "shrink", "init") and returns the
// path to write: absolute and lexically normal, without trailing separators ("DIR/" and "DIR/."
// are DIR, so the temporary sibling DIR.tmp.PID lands beside DIR, not inside it). Refuses empty
// text, and a path that exists and is not an empty directory (InvalidArgument naming the path).
std::filesystem::path checked_output_dir(const std::string& out_dir, const std::string& command);

}  // namespace opd
