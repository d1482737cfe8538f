// EnvChoice: a process-wide choice among named values (e.g. which kernel runs an op), read
// lazily from an environment variable the first time it is needed and overridable by a setter
// (tests, benches). An unknown value in the environment is an InvalidArgument naming the
// variable, the value and the accepted names, raised where the choice is used, not at start-up.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace opd {

class EnvChoice {
 public:
  // names: (name, value) pairs, values >= 0; fallback: the value when the variable is unset or
  // empty.
  EnvChoice(const char* env_var, std::vector<std::pair<const char*, int>> names, int fallback)
      : env_var_(env_var), names_(std::move(names)), fallback_(fallback) {}

  // The setter's value, else the environment's (read once), else the fallback.
  int get() {
    int s = state_.load();
    if (s == kUnread) {
      int expected = kUnread;
      state_.compare_exchange_strong(expected, parse());  // a concurrent set() wins
      s = state_.load();
    }
    if (s == kInvalid) {
      const char* v = std::getenv(env_var_);
      std::string accepted;
      for (const auto& [name, value] : names_) accepted += (accepted.empty() ? "" : ", ") + std::string(name);
      OPD_FAIL(InvalidArgument, env_var_, "=", v ? v : "", " is not one of ", accepted);
    }
    return s;
  }
  void set(int value) { state_.store(value); }
  // Forget the setter and read the environment again on the next get() (tests).
  void reset() { state_.store(kUnread); }

 private:
  static constexpr int kUnread = -2, kInvalid = -1;
  int parse() const {
    const char* v = std::getenv(env_var_);
    if (v == nullptr || *v == '\0') return fallback_;
    for (const auto& [name, value] : names_)
      if (std::string(v) == name) return value;
    return kInvalid;
  }
  const char* env_var_;
  std::vector<std::pair<const char*, int>> names_;
  int fallback_;
  std::atomic<int> state_{kUnread};
};

}  // namespace opd
