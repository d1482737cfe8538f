// Where opd looks for libnccl.so.2 at run time (nccl_communicator.cpp loads it with dlopen):
// $OPD_NCCL_LIBRARY alone when set; else the dynamic loader's own search (LD_LIBRARY_PATH,
// ld.so cache), the library CMake found, the CUDA toolkit folders, and the nvidia-nccl wheel
// that PyTorch installs in the usual site-packages folders.
#pragma once

#include <string>
#include <vector>

namespace opd::dist {

std::vector<std::string> nccl_library_candidates();

}  // namespace opd::dist
