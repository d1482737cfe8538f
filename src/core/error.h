// Typed errors carrying context (invariant 4 of DESIGN.md: errors are values until the edge).
// Library code throws opd::Error; only main() decides to exit. opd::cat builds messages
// from any streamable values so call sites can name file, tensor, field, value and limit.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace opd {

enum class ErrorKind {
  InvalidArgument,  // a caller passed something the API does not accept
  InvalidData,      // a file, payload or dataset is malformed (names the source)
  Io,               // open/read/write/rename failed (names the path and errno text)
  Unsupported,      // a real but unimplemented feature (names the feature)
  OutOfMemory,
  Cuda,             // CUDA runtime / cuBLAS / NCCL failure (names the call)
  Internal,         // a broken invariant of opd itself
  Cancelled,        // long work stopped on request (e.g. a stop signal during a rollout)
};

std::string_view error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Concatenate streamable values into a string: cat("tensor ", name, " has ", n, " dims").
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

[[noreturn]] void throw_error(ErrorKind kind, const std::string& message);

}  // namespace opd

// OPD_CHECK(cond, kind, msg-parts...): throw opd::Error(kind, "msg (check `cond` failed at file:line)").
#define OPD_CHECK(cond, kind, ...)                                                      \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      ::opd::throw_error(::opd::ErrorKind::kind,                                        \
                         ::opd::cat(__VA_ARGS__, " [check `" #cond "` failed at ",      \
                                    __FILE__, ":", __LINE__, "]"));                     \
    }                                                                                   \
  } while (0)

#define OPD_FAIL(kind, ...) ::opd::throw_error(::opd::ErrorKind::kind, ::opd::cat(__VA_ARGS__))
