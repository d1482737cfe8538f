// Flag-setting signal handlers for training runs (policy in signals.h).
#include "train/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace opd {
namespace {

std::atomic<int> g_stop{0};  // 0 none, 1 SIGTERM, 2 SIGINT
std::atomic<int> g_hups{0};
std::atomic<int> g_interrupts{0};

void on_signal(int sig) {
  if (sig == SIGHUP) {
    g_hups.fetch_add(1);
    return;
  }
  if (sig == SIGINT) {
    if (g_interrupts.fetch_add(1) >= 1) _exit(130);  // second Ctrl-C: leave now
    g_stop.store(2);
    return;
  }
  if (sig == SIGTERM) g_stop.store(1);
}

}  // namespace

void install_training_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGHUP, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // A file past the size limit (ulimit -f) kills the process without a word by default; ignored,
  // the write fails with EFBIG and takes the path of any failed write (a named error, a periodic
  // checkpoint retried later, the last complete one intact).
  signal(SIGXFSZ, SIG_IGN);
}

StopRequest stop_requested() {
  switch (g_stop.load()) {
    case 1: return StopRequest::Terminate;
    case 2: return StopRequest::Interrupt;
    default: return StopRequest::None;
  }
}

int hangups_received() { return g_hups.load(); }

void clear_stop_request() {
  g_stop.store(0);
  g_interrupts.store(0);
}

}  // namespace opd
