// Scratch directories, file I/O and the python3 oracle runner (see python_oracle.h).
#include "common/python_oracle.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace opd::test {

ScratchDir::ScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/opd_test_XXXXXX";
  if (!mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
  path_ = pattern;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += "'\\''";
    else q += c;
  }
  return q + "'";
}

}  // namespace

int run_python(const std::string& code, const std::string& args, std::string* out) {
  ScratchDir dir;
  const std::string err_path = dir.file("stderr");
  std::string cmd = "python3 -c " + shell_quote(code) + " " + args + " 2>" + shell_quote(err_path);
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) {
    *out = "popen failed";
    return -1;
  }
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) text.append(buf, n);
  int status = ::pclose(pipe);
  std::string err;
  try {
    err = read_file_bytes(err_path);
  } catch (const std::exception&) {
  }
  *out = text;
  if (!err.empty()) *out += "\n--- python3 stderr ---\n" + err;
  if (status == -1) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool python_can_import(const std::string& modules, std::string* why) {
  std::string out;
  int rc = run_python("import " + modules, "", &out);
  if (rc != 0) {
    *why = "python3 cannot import " + modules + " (exit " + std::to_string(rc) +
           (rc == 127 ? ", python3 not found on PATH" : "") + "): " + out;
  }
  return rc == 0;
}

}  // namespace opd::test
