// Helpers shared by the test suites: scratch directories, whole-file I/O, and running python3 as an
// oracle (transformers / safetensors) with a clean skip when it is not installed.
#pragma once

#include <string>

namespace opd::test {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string read_file_bytes(const std::string& path);
void write_file_bytes(const std::string& path, const std::string& bytes);

// Runs `python3 -c <code> <args...>` and returns its exit status; stdout goes to *out and
// stderr is appended to it after a marker line so failures are explained.
int run_python(const std::string& code, const std::string& args, std::string* out);
// True when `python3 -c "import <modules>"` succeeds; otherwise *why says what failed.
bool python_can_import(const std::string& modules, std::string* why);

}  // namespace opd::test
