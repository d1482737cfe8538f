// NCCL backend of the collectives (communicator.h), compiled in CUDA builds that found nccl.h.
// - libnccl.so.2 is loaded at run time (dlopen) rather than linked: the library is ~220 MB and
//   absent from most machines that run opd's CPU paths or its other GPU tests; linking it would
//   make every binary fail to start without it. Signatures come from nccl.h (decltype), so a
//   call through the table is type-checked like a direct call. NCCL >= 2.14 is required
//   (non-blocking communicators, ncclCommFinalize).
// - The communicator is non-blocking (config.blocking = 0): set-up and the first collectives'
//   connection set-up return ncclInProgress and are polled with a deadline, so a rank that never
//   joins is an error after the timeout, never a hang in NCCL's own code.
// - Watchdog: each collective records a CUDA event on its stream with a deadline; a thread polls
//   the oldest event and ncclCommGetAsyncError, and calls ncclCommAbort when the deadline passes
//   or NCCL reports an error (PyTorch's ProcessGroupNCCL does the same). Aborting makes NCCL's
//   kernels return, so streams waiting on them drain; every later call then throws Cuda naming
//   the collective, the rank and the timeout.
// Every NCCL call goes through OPD_NCCL_CHECK (do/while(0), throws with the call text, file,
// line, NCCL's error string and ncclGetLastError).
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/cuda/allocator.h"  // cuda::current_stream
#include "core/cuda/cuda_check.h"
#include "core/log.h"
#include "dist/communicator.h"
#include "dist/nccl/nccl_library.h"

namespace opd::dist {

namespace {

using Clock = std::chrono::steady_clock;

struct NcclApi {
  void* handle = nullptr;
  std::string path;
  int version = 0;
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
};

std::string g_load_error;

// Loads the first candidate that opens and has every symbol; never throws (the error is kept).
const NcclApi* load_nccl() {
  static std::once_flag once;
  static NcclApi api;
  static bool ok = false;
  std::call_once(once, [] {
    std::string tried;
    for (const std::string& cand : nccl_library_candidates()) {
      void* h = ::dlopen(cand.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) {
        const char* e = ::dlerror();
        tried += cat("\n  ", cand, ": ", e ? e : "not found");
        continue;
      }
      NcclApi a;
      a.handle = h;
      a.path = cand;
      std::string missing;
      auto sym = [&](auto& fn, const char* name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
        if (fn == nullptr) missing += cat(" ", name);
      };
      sym(a.GetVersion, "ncclGetVersion");
      sym(a.GetUniqueId, "ncclGetUniqueId");
      sym(a.CommInitRankConfig, "ncclCommInitRankConfig");
      sym(a.CommFinalize, "ncclCommFinalize");
      sym(a.CommDestroy, "ncclCommDestroy");
      sym(a.CommAbort, "ncclCommAbort");
      sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
      sym(a.GetErrorString, "ncclGetErrorString");
      sym(a.GetLastError, "ncclGetLastError");
      sym(a.AllReduce, "ncclAllReduce");
      sym(a.ReduceScatter, "ncclReduceScatter");
      sym(a.AllGather, "ncclAllGather");
      sym(a.Broadcast, "ncclBroadcast");
      if (missing.empty() && a.GetVersion(&a.version) == ncclSuccess &&
          a.version >= NCCL_VERSION(2, 14, 0)) {
        api = a;
        ok = true;
        return;
      }
      tried += cat("\n  ", cand, ": ",
                   missing.empty() ? cat("NCCL version code ", a.version, " < 21400 (2.14)")
                                   : cat("missing symbols", missing));
      ::dlclose(h);
    }
    g_load_error = cat("cannot load NCCL (libnccl.so.2, >= 2.14); set OPD_NCCL_LIBRARY to its path"
                       " or add its folder to LD_LIBRARY_PATH. Tried:", tried);
  });
  return ok ? &api : nullptr;
}

const NcclApi& nccl() {
  const NcclApi* api = load_nccl();
  if (api == nullptr) OPD_FAIL(Unsupported, g_load_error);
  return *api;
}

[[noreturn]] void nccl_fail(const char* call, const char* file, int line, ncclResult_t r,
                            ncclComm_t comm) {
  const NcclApi& api = nccl();
  const char* last = api.GetLastError(comm);
  throw_error(ErrorKind::Cuda, cat(call, " failed at ", file, ":", line, ": ",
                                   api.GetErrorString(r), (last && *last ? " (" : ""),
                                   (last ? last : ""), (last && *last ? ")" : "")));
}

}  // namespace

}  // namespace opd::dist

// OPD_NCCL_CHECK(comm, call): ncclSuccess and ncclInProgress (a non-blocking communicator's
// "started, poll for completion") pass; anything else throws Cuda with NCCL's messages.
#define OPD_NCCL_CHECK(comm, call)                                                          \
  do {                                                                                      \
    ncclResult_t opd_nccl_status_ = (call);                                                 \
    if (opd_nccl_status_ != ncclSuccess && opd_nccl_status_ != ncclInProgress)              \
      ::opd::dist::nccl_fail(#call, __FILE__, __LINE__, opd_nccl_status_, (comm));          \
  } while (0)

namespace opd::dist {

namespace {

ncclDataType_t nccl_dtype(DType dt) { return dt == DType::F32 ? ncclFloat32 : ncclBfloat16; }
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclAvg; }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Store> store, int device, double timeout_s)
      : Communicator(std::move(store)), device_(device), timeout_s_(timeout_s) {
    const NcclApi& api = nccl();
    OPD_CHECK(timeout_s > 0, InvalidArgument, "NCCL communicator: timeout must be > 0 s");
    OPD_CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (rank() == 0) OPD_NCCL_CHECK(nullptr, api.GetUniqueId(&id));
    std::string bytes = store_->broadcast(
        rank() == 0 ? std::string_view(reinterpret_cast<const char*>(&id), sizeof(id))
                    : std::string_view(),
        0, "nccl unique id");
    OPD_CHECK(bytes.size() == sizeof(id), Io, "NCCL unique id from rank 0 has ", bytes.size(),
              " bytes, expected ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    OPD_NCCL_CHECK(nullptr, api.CommInitRankConfig(&comm_, world_size(), id, rank(), &config));
    {
      std::unique_lock<std::mutex> lock(mu_);
      settle_locked(lock, "NCCL set-up (ncclCommInitRankConfig)");
    }
    log_info("NCCL ", api.version, " (", api.path, ") rank ", rank(), "/", world_size(),
             " on device ", device_, ", collective timeout ", timeout_s_, " s");
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    try {
      std::unique_lock<std::mutex> lock(mu_);
      if (!aborted_ && comm_ != nullptr) {
        wait_pending_locked(lock);
        OPD_NCCL_CHECK(comm_, nccl().CommFinalize(comm_));
        settle_locked(lock, "NCCL tear-down (ncclCommFinalize)");
        if (comm_ != nullptr) OPD_NCCL_CHECK(comm_, nccl().CommDestroy(comm_));
        comm_ = nullptr;
      }
    } catch (const Error& e) {
      log_error("NCCL communicator tear-down on rank ", rank(), ": ", e.what());
      std::lock_guard<std::mutex> lock(mu_);
      abort_locked("tear-down failed");
    }
    for (cudaEvent_t ev : free_events_) cudaEventDestroy(ev);
    for (const Pending& p : pending_) cudaEventDestroy(p.event);
  }

  const char* backend() const override { return "nccl"; }
  Device device() const override { return Device::CUDA; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check_tensor("all_reduce", "tensor", t);
    enqueue(cat("all_reduce ", dtype_name(t.dtype()), "[", t.numel(), "] ", reduce_op_name(op)),
            [&](ncclComm_t c, cudaStream_t s) {
              OPD_NCCL_CHECK(c, nccl().AllReduce(t.raw(), t.raw(), t.numel(),
                                                 nccl_dtype(t.dtype()), nccl_op(op), c, s));
            });
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    check_tensor("reduce_scatter", "in", in);
    check_tensor("reduce_scatter", "out", out);
    OPD_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * world_size(),
              InvalidArgument, "reduce_scatter: in ", in.describe(), " must hold world_size (",
              world_size(), ") x out ", out.describe(), " elements of one dtype");
    enqueue(cat("reduce_scatter ", dtype_name(in.dtype()), "[", in.numel(), "] ",
                reduce_op_name(op)),
            [&](ncclComm_t c, cudaStream_t s) {
              OPD_NCCL_CHECK(c, nccl().ReduceScatter(in.raw(), out.raw(), out.numel(),
                                                     nccl_dtype(in.dtype()), nccl_op(op), c, s));
            });
  }

  void all_gather(const Tensor& in, Tensor& out) override {
    check_tensor("all_gather", "in", in);
    check_tensor("all_gather", "out", out);
    OPD_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * world_size(),
              InvalidArgument, "all_gather: out ", out.describe(), " must hold world_size (",
              world_size(), ") x in ", in.describe(), " elements of one dtype");
    // NCCL allows in place only when in is exactly this rank's block of out.
    const char* ib = static_cast<const char*>(in.raw());
    const char* ob = static_cast<const char*>(out.raw());
    const bool overlaps = ib < ob + out.nbytes() && ob < ib + in.nbytes();
    OPD_CHECK(!overlaps || ib == ob + rank() * in.nbytes(), InvalidArgument,
              "all_gather: in overlaps out but is not this rank's block of it");
    enqueue(cat("all_gather ", dtype_name(in.dtype()), "[", in.numel(), "]"),
            [&](ncclComm_t c, cudaStream_t s) {
              OPD_NCCL_CHECK(c, nccl().AllGather(in.raw(), out.raw(), in.numel(),
                                                 nccl_dtype(in.dtype()), c, s));
            });
  }

  void broadcast(Tensor& t, int root) override {
    check_tensor("broadcast", "tensor", t);
    OPD_CHECK(root >= 0 && root < world_size(), InvalidArgument, "broadcast: root ", root,
              " is outside [0, ", world_size(), ")");
    enqueue(cat("broadcast ", dtype_name(t.dtype()), "[", t.numel(), "] from ", root),
            [&](ncclComm_t c, cudaStream_t s) {
              OPD_NCCL_CHECK(c, nccl().Broadcast(t.raw(), t.raw(), t.numel(),
                                                 nccl_dtype(t.dtype()), root, c, s));
            });
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    throw_if_aborted_locked();
    wait_pending_locked(lock);
    throw_if_aborted_locked();
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::string what;
    Clock::time_point deadline;
  };

  template <typename Call>
  void enqueue(const std::string& what_base, Call&& call) {
    std::unique_lock<std::mutex> lock(mu_);
    throw_if_aborted_locked();
    const std::string what = cat("NCCL ", what_base, " #", seq_++);
    cudaStream_t stream = cuda::current_stream();
    try {
      call(comm_, stream);
      settle_locked(lock, what);
      cudaEvent_t ev = nullptr;
      if (!free_events_.empty()) {
        ev = free_events_.back();
        free_events_.pop_back();
      } else {
        OPD_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      }
      pending_.push_back({ev, what, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                       std::chrono::duration<double>(timeout_s_))});
      OPD_CUDA_CHECK(cudaEventRecord(ev, stream));
    } catch (const Error& e) {
      if (!aborted_) abort_locked(cat(what, " failed on rank ", rank(), ": ", e.what()));
      throw_if_aborted_locked();
    }
    cv_.notify_all();
  }

  // Polls a non-blocking communicator until its pending operation completes; on an error or
  // after the timeout it aborts the communicator and throws.
  void settle_locked(std::unique_lock<std::mutex>& lock, const std::string& what) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    while (true) {
      throw_if_aborted_locked();
      ncclResult_t state = ncclSuccess;
      OPD_NCCL_CHECK(comm_, nccl().CommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const char* last = nccl().GetLastError(comm_);
        abort_locked(cat(what, " failed on rank ", rank(), ": ", nccl().GetErrorString(state),
                         last && *last ? cat(" (", last, ")") : std::string()));
        throw_if_aborted_locked();
      }
      if (Clock::now() > deadline) {
        abort_locked(cat(what, " did not finish within ", timeout_s_, " s on rank ", rank(),
                         " (a rank did not join or hung); communicator aborted"));
        throw_if_aborted_locked();
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      lock.lock();
    }
  }

  // Waits until every recorded event completed (or the watchdog aborted). Polls with short
  // sleeps instead of cudaEventSynchronize, which could not be interrupted by an abort.
  void wait_pending_locked(std::unique_lock<std::mutex>& lock) {
    while (!pending_.empty() && !aborted_) {
      retire_completed_locked();
      if (pending_.empty()) break;
      if (Clock::now() > pending_.front().deadline) {
        abort_locked(timeout_message(pending_.front().what));
        break;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
    }
  }

  // Pops the finished events at the front; a CUDA error on one aborts.
  void retire_completed_locked() {
    while (!pending_.empty()) {
      cudaError_t q = cudaEventQuery(pending_.front().event);
      if (q == cudaErrorNotReady) return;
      if (q != cudaSuccess) {
        abort_locked(cat(pending_.front().what, " on rank ", rank(), ": CUDA error ",
                         cudaGetErrorName(q), " (", cudaGetErrorString(q), ")"));
        return;
      }
      free_events_.push_back(pending_.front().event);
      pending_.pop_front();
    }
  }

  std::string timeout_message(const std::string& what) const {
    return cat(what, " did not finish within ", timeout_s_, " s on rank ", rank(),
               ": communicator aborted (a peer died, hung, or called a different collective; "
               "OPD_DIST_TIMEOUT sets the limit)");
  }

  void watchdog_loop() {
    cudaSetDevice(device_);  // event queries act on this thread's current device
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (stop_ || aborted_ || comm_ == nullptr) continue;
      retire_completed_locked();
      if (aborted_) continue;
      if (!pending_.empty() && Clock::now() > pending_.front().deadline) {
        abort_locked(timeout_message(pending_.front().what));
        continue;
      }
      ncclResult_t state = ncclSuccess;
      if (nccl().CommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        const char* last = nccl().GetLastError(comm_);
        abort_locked(cat("NCCL reported an asynchronous error on rank ", rank(), ": ",
                         nccl().GetErrorString(state), last && *last ? cat(" (", last, ")") : ""));
      }
    }
  }

  // Aborts once: NCCL's kernels return, the streams drain, every later call throws `message`.
  // The events stay allocated (a waiter may still query one) until the destructor.
  void abort_locked(const std::string& message) {
    if (aborted_) return;
    aborted_ = true;
    error_ = message;
    log_error(message);
    if (comm_ != nullptr) {
      ncclResult_t r = nccl().CommAbort(comm_);
      if (r != ncclSuccess) log_error("ncclCommAbort on rank ", rank(), ": ", nccl().GetErrorString(r));
      comm_ = nullptr;
    }
    for (const Pending& p : pending_) free_events_.push_back(p.event);
    pending_.clear();
    cv_.notify_all();
  }

  void throw_if_aborted_locked() const {
    if (aborted_) throw_error(ErrorKind::Cuda, error_);
  }

  int device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  std::mutex mu_;  // guards everything below and every NCCL call on comm_
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  uint64_t seq_ = 0;
  bool aborted_ = false;
  bool stop_ = false;
  std::string error_;
  std::thread watchdog_;
};

}  // namespace

std::vector<std::string> nccl_library_candidates() {
  if (const char* p = std::getenv("OPD_NCCL_LIBRARY"); p != nullptr && *p) return {p};
  std::vector<std::string> c = {"libnccl.so.2"};  // LD_LIBRARY_PATH, rpath, ld.so cache
#ifdef OPD_NCCL_LIBRARY_HINT
  c.push_back(OPD_NCCL_LIBRARY_HINT);  // the library CMake found at configure time
#endif
  for (const char* p : {"/usr/local/cuda/lib64/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2",
                        "/usr/lib/x86_64-linux-gnu/libnccl.so.2"})
    c.push_back(p);
  // The NVIDIA wheel PyTorch depends on (nvidia-nccl-cu12/13) in the usual site-packages.
  std::vector<std::string> patterns = {
      "/usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
      "/usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
      "/usr/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
      "/opt/conda/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"};
  if (const char* venv = std::getenv("VIRTUAL_ENV"))
    patterns.push_back(cat(venv, "/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"));
  if (const char* home = std::getenv("HOME")) {
    patterns.push_back(cat(home, "/.local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"));
    patterns.push_back(
        cat(home, "/.pyenv/versions/*/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"));
  }
  for (const std::string& pat : patterns) {
    glob_t g{};
    if (::glob(pat.c_str(), 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) c.push_back(g.gl_pathv[i]);
    ::globfree(&g);
  }
  return c;
}

bool nccl_available(std::string* why) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    if (why) *why = "no CUDA device";
    return false;
  }
  if (load_nccl() == nullptr) {
    if (why) *why = g_load_error;
    return false;
  }
  return true;
}

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Store> store, int device,
                                                     double timeout_s) {
  OPD_CHECK(store != nullptr, InvalidArgument, "make_nccl_communicator: no store");
  return std::make_unique<NcclCommunicator>(std::move(store), device, timeout_s);
}

}  // namespace opd::dist
