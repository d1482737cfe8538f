// Output-directory checks shared by convert, shrink and init (see output_dir.h).
#include "model/output_dir.h"

#include <system_error>

#include "core/error.h"

namespace opd {

namespace fs = std::filesystem;

fs::path checked_output_dir(const std::string& out_dir, const std::string& command) {
  OPD_CHECK(!out_dir.empty(), InvalidArgument, command,
            ": --out is empty; give the output directory");
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(out_dir), ec);
  OPD_CHECK(!ec, Io, command, ": cannot resolve --out '", out_dir, "': ", ec.message());
  std::string s = p.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  p = s;
  if (fs::exists(p, ec) && !(fs::is_directory(p, ec) && fs::is_empty(p, ec)))
    OPD_FAIL(InvalidArgument, command, ": output ", out_dir,
             " exists and is not an empty directory; choose another --out or remove it");
  return p;
}

}  // namespace opd
