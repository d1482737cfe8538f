// Bounded text-file reads and the JSON nesting guard (text_io.h).
#include "core/text_io.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace opd {

std::string read_text_file(const std::string& path, int64_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    OPD_FAIL(Io, "cannot open ", path, ": ", std::strerror(errno));
  OPD_CHECK(S_ISREG(st.st_mode), InvalidData, path, " is not a regular file (",
            S_ISDIR(st.st_mode) ? "a directory" : "a device, FIFO or socket", ")");
  OPD_CHECK(st.st_size <= max_bytes, InvalidData, path, " is ", st.st_size,
            " bytes, over the limit of ", max_bytes, " for this kind of file");
  std::ifstream in(path, std::ios::binary);
  if (!in) OPD_FAIL(Io, "cannot open ", path, ": ", std::strerror(errno));
  std::string text;
  text.resize(static_cast<size_t>(st.st_size));
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) OPD_FAIL(Io, "cannot read ", path, ": ", std::strerror(errno));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

int json_nesting_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

void check_json_depth(std::string_view text, std::string_view what, int limit) {
  const int d = json_nesting_depth(text);
  OPD_CHECK(d <= limit, InvalidData, what, ": JSON nested ", d, " levels deep, over the limit of ",
            limit);
}

}  // namespace opd
