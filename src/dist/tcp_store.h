// The job's host-side meeting point: rank 0 runs a small TCP server (StoreServer), every rank
// (rank 0 too) connects a Store client to it, with retries until the timeout. Its one
// primitive is an exchange: every rank contributes a payload under the next collective number
// and receives all payloads in rank order. That is enough for the NCCL unique-id broadcast, a
// barrier, a host all-reduce of a few values ("did any rank fail"), and the CPU collectives
// (cpu_communicator.cpp), in the spirit of torch.distributed's TCPStore + gloo.
// Failure: a rank whose connection closes without a goodbye (crash, kill) is recorded by the
// server and every wait fails at once naming it; a wait that outlasts the timeout fails naming
// the ranks that did not arrive. Every rank must call the same collectives in the same order;
// each contribution carries a descriptor, and a mismatch is an error naming both sides.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dist/rendezvous.h"

namespace opd::dist {

class StoreServer {
 public:
  // Listens on all IPv4 interfaces at `port` (0: any free port, see port()) for a job of
  // world_size ranks. Throws Io naming the port when it cannot bind.
  StoreServer(int port, int world_size);
  // Waits (at most grace_s) for connected ranks to say goodbye so none loses its last reply,
  // then closes every connection and joins its threads.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;
  void set_shutdown_grace(double seconds);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

enum class HostReduce { Sum, Max, Min };

class Store {
 public:
  // Connects rank `rank` of `world_size` to host:port, retrying until timeout_s.
  Store(const std::string& host, int port, int rank, int world_size, double timeout_s);
  ~Store();  // says goodbye (a clean exit, not a failure) and closes
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Rank 0 starts the server on env.master_port, then every rank connects as a client.
  static std::shared_ptr<Store> connect(const DistEnv& env, double timeout_s);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  double timeout() const { return timeout_s_; }
  uint64_t collectives() const { return seq_; }  // exchanges completed so far

  // Every rank's payload, in rank order. `what` describes the call ("all_reduce f32[1024] sum");
  // it must be identical on every rank (checked). Throws Io on a lost connection, a dead or
  // aborted peer, or the timeout, with a message naming the rank(s) and the collective.
  std::vector<std::string> exchange(std::string_view what, std::string_view payload);
  void barrier(std::string_view what = "barrier");
  // Element-wise reduction of every rank's values, in rank order (same result on every rank).
  std::vector<double> all_reduce(std::vector<double> values, HostReduce op,
                                 std::string_view what = "host all_reduce");
  std::string broadcast(std::string_view value, int root, std::string_view what = "broadcast");
  // Tells the server this rank failed; the waits of every other rank fail at once with the
  // message (instead of after the timeout). Never throws.
  void abort(std::string_view message) noexcept;

 private:
  void send_request(uint8_t op, uint64_t seq, double timeout_s, std::string_view payload);
  std::string receive_reply(const std::string& what, double timeout_s);
  int fd_ = -1;
  int rank_ = 0;
  int world_size_ = 1;
  double timeout_s_ = 600;
  uint64_t seq_ = 0;
  int uncaught_at_start_ = 0;
  std::string endpoint_;
  std::unique_ptr<StoreServer> server_;  // rank 0 of connect() only; destroyed after the client
};

// A free TCP port on this host (bind to 0, read, close): for tests and `opd launch
// --master-port 0`. Another process may take it before it is used; callers accept that race.
int pick_free_port();

}  // namespace opd::dist
