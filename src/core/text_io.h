// Reading the small text files opd takes from users (config.json, tokenizer.json,
// generation_config.json, chat templates, checkpoint manifests, run metrics) and a guard for the
// JSON in them.
//
// read_text_file refuses what is not a regular file (a directory, a FIFO, /dev/zero: a symlink
// to one reads forever) and files over a size limit, naming the path. check_json_depth refuses
// JSON text nested deeper than a limit before it is parsed: nlohmann's parser is iterative, but
// copying, comparing, converting and dump() of a value recurse, so a request of ~100 KB of '['
// would overflow a thread's stack (a crash of `opd serve` from one request); no file or
// payload opd reads nests more than a few levels.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace opd {

inline constexpr int64_t kMaxTextFileBytes = int64_t{1} << 30;  // 1 GiB
inline constexpr int kMaxJsonDepth = 256;

// The whole file; Io naming the path (and the reason) when it cannot be opened or read,
// InvalidData when it is not a regular file or is larger than max_bytes.
std::string read_text_file(const std::string& path, int64_t max_bytes = kMaxTextFileBytes);

// The deepest nesting of arrays and objects in JSON text (brackets inside strings do not
// count; malformed text is measured as far as it goes).
int json_nesting_depth(std::string_view text);
// InvalidData "<what>: JSON nested N levels deep, over the limit of <limit>" when deeper.
void check_json_depth(std::string_view text, std::string_view what, int limit = kMaxJsonDepth);

}  // namespace opd
