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

void throw_error(ErrorKind kind, const std::string& message) { throw Error(kind, message); }

}  // namespace opd
