// The server tests' loopback teacher: `scorer` behind an in-process TeacherServer on an
// ephemeral port, 4 connection threads, a 1 MB request limit (test_server.cpp,
// test_server_sockets.cpp).
#pragma once

#include <memory>

#include "teacher/scorer.h"
#include "teacher/server.h"

namespace opd::test {

inline std::unique_ptr<TeacherServer> start_test_server(Scorer& scorer) {
  ServerOptions o;
  o.port = 0;
  o.threads = 4;
  o.max_body_bytes = 1 << 20;
  auto server = std::make_unique<TeacherServer>(scorer, o);
  server->start();
  return server;
}

}  // namespace opd::test
