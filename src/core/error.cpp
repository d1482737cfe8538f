// Error kinds and the single throw point (a breakpoint here catches every opd error).
#include "core/error.h"

namespace opd {

std::string_view error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return "invalid argument";
    case ErrorKind::InvalidData: return "invalid data";
    case ErrorKind::Io: return "I/O error";
    case ErrorKind::Unsupported: return "unsupported";
    case ErrorKind::OutOfMemory: return "out of memory";
    case ErrorKind::Cuda: return "CUDA error";
    case ErrorKind::Internal: return "internal error";
    case ErrorKind::Cancelled: return "cancelled";
  }
  return "error";
}

namespace {

// what() is a C string: a NUL byte quoted from input (a name in a file) would cut the message
// there, so NULs are written out as "\0".
std::string without_nul_bytes(const std::string& message) {
  if (message.find('\0') == std::string::npos) return message;
  std::string out;
  out.reserve(message.size() + 8);
  for (char c : message) {
    if (c == '\0') out += "\\0";
    else out += c;
  }
  return out;
}

}  // namespace

void throw_error(ErrorKind kind, const std::string& message) {
  throw Error(kind, without_nul_bytes(message));
}

}  // namespace opd
