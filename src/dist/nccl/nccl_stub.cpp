// The NCCL backend in builds without CUDA or without nccl.h: every request is a clear
// Unsupported error; the CPU backend (cpu_communicator.cpp) is unaffected.
#include "dist/communicator.h"
#include "dist/nccl/nccl_library.h"

namespace opd::dist {

namespace {
const char* kWhy =
    "this opd was built without NCCL (no CUDA toolkit, or nccl.h was not found at configure "
    "time); use the CPU backend or rebuild with the CUDA toolkit's NCCL";
}

std::vector<std::string> nccl_library_candidates() { return {}; }

bool nccl_available(std::string* why) {
  if (why) *why = kWhy;
  return false;
}

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Store>, int, double) {
  OPD_FAIL(Unsupported, "NCCL communicator: ", kWhy);
}

}  // namespace opd::dist
