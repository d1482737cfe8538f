// Parsing a token-id list given on the command line ("1,2,3", as `opd predict --ids` and
// `opd generate --prompt-ids` take it) into 32-bit ids.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace opd::cli {

// "1,2,3" -> {1, 2, 3}. Every item must be a whole 32-bit integer and the list non-empty;
// errors (InvalidArgument) quote `what` (the flag), the text and the bad item. The range
// against a vocabulary is checked later, by whoever knows the model.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what);

}  // namespace opd::cli
