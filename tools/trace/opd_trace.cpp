// opd_trace: a CUDA injection library that records the GPU timeline of any CUDA program (opd's
// benches, the GPU tests) with CUPTI's activity API, for measurement only; the engine does not
// link it. The lent GPU machine has no Nsight Systems, and ncu serializes kernels, so neither
// shows the idle time *between* kernels: this does.
//
//   CUDA_INJECTION64_PATH=/path/libopd_trace.so OPD_TRACE_OUT=trace.csv opd bench score ...
//   python3 tools/trace_summary.py trace.csv
//
// The CUDA driver loads the library at the program's first CUDA call and runs
// InitializeInjection; the records are written when the program exits (atexit). One CSV row
// per record, times in ns on CUPTI's clock (GPU and host records share it):
//   kind,start,end,stream,name,detail
//   kind: K kernel (detail = grid x block, graph id), M memcpy (detail = copy kind, bytes),
//         S memset (bytes), Y synchronization (detail = type), A runtime/driver API call that
//         lasted >= OPD_TRACE_API_MIN_NS (default 5000 ns: syncs, blocking copies, mallocs; the
//         short launches would swamp the file).
// Build: tools/trace/build.sh (needs CUPTI's headers and library from the CUDA toolkit).
#include <cupti.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Row {
  char kind;
  uint64_t start, end;
  uint32_t stream;
  std::string name, detail;
};

std::mutex g_mu;
std::vector<Row> g_rows;
uint64_t g_api_min_ns = 5000;
uint64_t g_dropped = 0;
constexpr size_t kBufBytes = 8u << 20;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  std::fprintf(stderr, "opd_trace: %s failed: %s\n", what, s ? s : "?");
}

const char* copy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
    default: return "other";
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufBytes));
  *size = *buffer ? kBufBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Row> rows;
  CUpti_Activity* rec = nullptr;
  char tmp[160];
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        std::snprintf(tmp, sizeof tmp, "%dx%dx%d/%dx%dx%d g%u", k->gridX, k->gridY, k->gridZ,
                      k->blockX, k->blockY, k->blockZ, k->graphId);
        rows.push_back({'K', k->start, k->end, k->streamId, k->name ? k->name : "?", tmp});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        std::snprintf(tmp, sizeof tmp, "%" PRIu64, static_cast<uint64_t>(m->bytes));
        rows.push_back({'M', m->start, m->end, m->streamId, copy_kind(m->copyKind), tmp});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        std::snprintf(tmp, sizeof tmp, "%" PRIu64, static_cast<uint64_t>(m->bytes));
        rows.push_back({'S', m->start, m->end, m->streamId, "memset", tmp});
        break;
      }
      case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
        const auto* s = reinterpret_cast<const CUpti_ActivitySynchronization2*>(rec);
        const char* t = "other";
        switch (s->type) {
          case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_EVENT_SYNCHRONIZE: t = "event"; break;
          case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_WAIT_EVENT: t = "stream_wait_event"; break;
          case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_SYNCHRONIZE: t = "stream"; break;
          case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_CONTEXT_SYNCHRONIZE: t = "context"; break;
          default: break;
        }
        rows.push_back({'Y', s->start, s->end, s->streamId, "sync", t});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        if (a->end - a->start < g_api_min_ns) break;
        const char* n = nullptr;
        cuptiGetCallbackName(rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                      : CUPTI_CB_DOMAIN_DRIVER_API,
                             a->cbid, &n);
        rows.push_back({'A', a->start, a->end, 0, n ? n : "api", std::to_string(a->threadId)});
        break;
      }
      default: break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  std::free(buffer);
  const std::lock_guard<std::mutex> lock(g_mu);
  g_dropped += dropped;
  for (Row& r : rows) g_rows.push_back(std::move(r));
}

void write_out() {
  cuptiActivityFlushAll(1);
  const char* path = std::getenv("OPD_TRACE_OUT");
  if (!path || !*path) path = "opd_trace.csv";
  const std::lock_guard<std::mutex> lock(g_mu);
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "opd_trace: cannot write %s\n", path);
    return;
  }
  std::fprintf(f, "kind,start,end,stream,name,detail\n");
  for (const Row& r : g_rows)
    std::fprintf(f, "%c,%" PRIu64 ",%" PRIu64 ",%u,\"%s\",\"%s\"\n", r.kind, r.start, r.end,
                 r.stream, r.name.c_str(), r.detail.c_str());
  std::fclose(f);
  std::fprintf(stderr, "opd_trace: %zu records -> %s (%" PRIu64 " dropped)\n", g_rows.size(),
               path, g_dropped);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  if (const char* s = std::getenv("OPD_TRACE_API_MIN_NS")) g_api_min_ns = std::strtoull(s, nullptr, 10);
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_SYNCHRONIZATION), "enable synchronization");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime");
  std::atexit(write_out);
  return 1;
}
