// The comma-separated token-id lists of cli/id_list.h.
#include "cli/id_list.h"

#include <climits>
#include <exception>
#include <sstream>

#include "core/error.h"

namespace opd::cli {

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> out;
  // getline drops an empty last item: "1,2," would read as "1,2".
  OPD_CHECK(text.empty() || text.back() != ',', InvalidArgument, what, " '", text,
            "' ends with a comma (an empty id)");
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      OPD_FAIL(InvalidArgument, what, " '", text, "': '", item, "' is not an integer");
    }
    OPD_CHECK(used == item.size() && v >= INT32_MIN && v <= INT32_MAX, InvalidArgument, what,
              " '", text, "': '", item, "' is not a 32-bit integer");
    out.push_back(static_cast<int32_t>(v));
  }
  OPD_CHECK(!out.empty(), InvalidArgument, what, " '", text, "' holds no ids");
  return out;
}

}  // namespace opd::cli
