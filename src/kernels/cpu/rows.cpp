// Row gather with zero rows, and dtype conversion (kernels/ops.h: gather_rows, convert): the
// CPU reference. out[i, :] = rows[i] == -1 ? 0 : in[rows[i], :]. The model picks the completion
// rows of a packed batch for the loss with it, and scatters their gradient back with the
// inverse map (-1 where a row has no loss).
#include <string>

#include "core/error.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

void check_rows(const char* op, const int32_t* rows, int64_t n_out, int64_t n_in) {
  for (int64_t i = 0; i < n_out; ++i) {
    const int32_t r = rows[i];
    if (r < -1 || r >= n_in) {
      OPD_FAIL(InvalidData, op, ": source row ", r, " at row ", i, " is outside [-1, ", n_in,
               ")");
    }
  }
}

template <typename T>
void gather_rows(const T* in, int64_t n_in, const int32_t* rows, int64_t n_out, int64_t h,
                 T* out) {
  check_rows("gather_rows", rows, n_out, n_in);  // before anything is written
  for (int64_t i = 0; i < n_out; ++i) {
    const int32_t r = rows[i];
    for (int64_t c = 0; c < h; ++c) out[i * h + c] = r < 0 ? T(0) : in[r * h + c];
  }
}

template void gather_rows<float>(const float*, int64_t, const int32_t*, int64_t, int64_t, float*);
template void gather_rows<double>(const double*, int64_t, const int32_t*, int64_t, int64_t,
                                  double*);

}  // namespace opd::cpu
