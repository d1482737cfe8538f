// A long `opd train` run (CPU, tiny models, in-process teacher; 2,000 steps with a checkpoint
// every 10 steps and every 0.6 s, --save-total-limit 2, evaluation every 50 steps, TensorBoard,
// metrics every step, SIGHUPs) sampled from /proc/PID while it runs: the baseline (the minimum
// over a stretch of steps, so a save's transient descriptors do not count) of open descriptors,
// threads and memory mappings must not grow from the second quarter of the run to the last, nor
// RSS by more than allocator noise; the run directory holds --save-total-limit checkpoints and
// no leftovers. Then leftovers of interrupted writes (killed between write and rename) are
// planted and a resume must remove them. docs/robustness.md, "Session 17: long runs";
// tools/soak_probe.py is the same probe for hours-long runs.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/child_process.h"
#include "common/run_dir_test.h"

namespace opd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

class TrainSoak : public test::TinyDistillationTest {
 protected:
  TrainSoak() : TinyDistillationTest("opd_train_soak_", 64) {}

  std::vector<std::string> args(const std::string& out, int steps) const {
    std::vector<std::string> a = tiny_train_args(out, steps, 2);
    a.erase(std::find(a.begin(), a.end(), "--no-tensorboard"));
    auto at = std::find(a.begin(), a.end(), "--save-minutes");
    at[1] = "0.01";  // a save by time too, every 0.6 s
    a.insert(a.end(), {"--save-steps", "10", "--save-total-limit", "2", "--eval-steps", "50",
                       "--eval-data", path("train.jsonl"), "--eval-limit", "4"});
    return a;
  }
};

struct Sample {
  int64_t step = -1;
  int64_t fds = 0, threads = 0, maps = 0, rss_kib = 0;
};

int64_t count_entries(const std::string& dir) {
  std::error_code ec;
  int64_t n = 0;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) ++n;
  return n;
}

// The step of metrics.jsonl's last complete line (its tail only), -1 before the first.
int64_t last_step(const std::string& metrics) {
  std::ifstream f(metrics, std::ios::binary | std::ios::ate);
  if (!f) return -1;
  const std::streamoff size = f.tellg();
  const std::streamoff from = std::max<std::streamoff>(0, size - 4096);
  std::string tail(static_cast<size_t>(size - from), '\0');
  f.seekg(from);
  f.read(tail.data(), static_cast<std::streamsize>(tail.size()));
  const size_t end = tail.rfind('\n');
  if (end == std::string::npos) return -1;
  const size_t begin = tail.rfind('\n', end - 1);
  const std::string line = tail.substr(begin == std::string::npos ? 0 : begin + 1, end);
  const size_t at = line.find("\"step\":");
  return at == std::string::npos ? -1 : std::atoll(line.c_str() + at + 7);
}

bool sample(pid_t pid, Sample* s) {
  const std::string p = "/proc/" + std::to_string(pid);
  std::ifstream status(p + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) s->rss_kib = std::atoll(line.c_str() + 6);
  std::ifstream maps(p + "/maps");
  s->maps = 0;
  while (std::getline(maps, line)) ++s->maps;
  s->fds = count_entries(p + "/fd");
  s->threads = count_entries(p + "/task");
  return s->rss_kib > 0 && s->fds > 0 && s->threads > 0;
}

Sample baseline(const std::vector<Sample>& v, int64_t from_step, int64_t to_step) {
  Sample m{from_step, LLONG_MAX, LLONG_MAX, LLONG_MAX, LLONG_MAX};
  int n = 0;
  for (const Sample& s : v) {
    if (s.step < from_step || s.step >= to_step) continue;
    ++n;
    m.fds = std::min(m.fds, s.fds);
    m.threads = std::min(m.threads, s.threads);
    m.maps = std::min(m.maps, s.maps);
    m.rss_kib = std::min(m.rss_kib, s.rss_kib);
  }
  EXPECT_GE(n, 5) << "too few samples between steps " << from_step << " and " << to_step;
  return m;
}

std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> left;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos)
      left.push_back(e.path().string());
  }
  return left;
}

TEST_F(TrainSoak, DescriptorsThreadsMappingsAndMemoryDoNotGrowOverARun) {
  const int steps = 2000;
  auto c = test::spawn(args("run", steps), path("run.log"));
  const std::string metrics = path("run/metrics.jsonl");
  std::vector<Sample> samples;
  int hups = 0;
  for (auto t0 = std::chrono::steady_clock::now(); std::chrono::steady_clock::now() - t0 < 240s;) {
    Sample s;
    s.step = last_step(metrics);
    if (!sample(c->pid, &s)) break;  // gone (exited, a zombie has no fds)
    if (s.step >= steps) break;      // the end: final evaluation, exit
    samples.push_back(s);
    if (s.step >= (hups + 1) * steps / 4 && hups < 3) {  // a terminal closed, three times
      ::kill(c->pid, SIGHUP);
      ++hups;
    }
    std::this_thread::sleep_for(15ms);
  }
  ASSERT_EQ(c->wait_exit(240s), 0) << c->output();
  ASSERT_GE(hups, 3);
  const Sample early = baseline(samples, steps / 4, steps / 2);
  const Sample late = baseline(samples, 3 * steps / 4, steps);
  std::printf("baseline steps %d-%d: fds %lld threads %lld maps %lld rss %lld KiB; steps %d-%d: "
              "fds %lld threads %lld maps %lld rss %lld KiB; %zu samples\n",
              steps / 4, steps / 2, (long long)early.fds, (long long)early.threads,
              (long long)early.maps, (long long)early.rss_kib, 3 * steps / 4, steps,
              (long long)late.fds, (long long)late.threads, (long long)late.maps,
              (long long)late.rss_kib, samples.size());
  // 50 checkpoints, 10 evaluations and saves by time lie between the two stretches: one
  // descriptor, thread or mapping kept per save or evaluation shows here.
  EXPECT_LE(late.fds, early.fds);
  EXPECT_LE(late.threads, early.threads);
  EXPECT_LE(late.maps, early.maps);
  EXPECT_LE(late.rss_kib, early.rss_kib + 4096);

  const std::string ckpts = path("run/checkpoints");
  int64_t kept = 0;
  for (const auto& e : fs::directory_iterator(ckpts)) kept += e.is_directory();
  EXPECT_EQ(kept, 2) << "--save-total-limit 2";
  EXPECT_EQ(leftovers(path("run")), std::vector<std::string>{});
  EXPECT_FALSE(fs::exists(path("run/bad_batches")));
  EXPECT_EQ(count_entries(path("run/tensorboard")), 1);

  // What kill -9 between a write and its rename leaves (config.json and the metrics rewrite at
  // start-up, LATEST, a checkpoint folder): a resumed run removes all of it.
  for (const char* f : {"run/config.json.tmp-77", "run/metrics.jsonl.tmp-78",
                        "run/checkpoints/LATEST.tmp-79"})
    std::ofstream(path(f)) << "left by a killed process";
  fs::create_directories(path("run/checkpoints/step-00000990.tmp-80"));
  auto again = test::spawn(args("run", steps + 10), path("run2.log"));
  ASSERT_EQ(again->wait_exit(120s), 0) << again->output();
  EXPECT_EQ(leftovers(path("run")), std::vector<std::string>{});
}

}  // namespace
}  // namespace opd
