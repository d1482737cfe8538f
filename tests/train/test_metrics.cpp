// MetricsLog: TensorBoard event files read back with an independent TFRecord/protobuf reader
// (framing CRCs, steps, tags, values), checked again by tensorboard's own EventAccumulator
// (tests/train/tb_oracle.py); metrics.jsonl round trip, torn last lines, truncate_after on resume.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "core/error.h"
#include "core/log.h"
#include "train/metrics.h"
#include "train/metrics_test_util.h"

namespace opd {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using test::MetricsTempDir;

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Seeded, non-constant values: step s gives loss 2/(s+1) + small wiggle, lr a warm-up ramp.
json record_for(int64_t s, double offset = 0) {
  return json{{"loss", 2.0 / double(s + 1) + 0.01 * std::sin(double(s)) + offset},
              {"lr", 1e-5 * double(s) / 7.0 + offset},
              {"tokens", 1000 * s + 17},
              {"ok", s % 2 == 0},
              {"phase", "train"}};
}

std::vector<fs::path> event_files(const fs::path& run) {
  std::vector<fs::path> out;
  if (!fs::exists(run / "tensorboard")) return out;
  for (const auto& e : fs::directory_iterator(run / "tensorboard")) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Metrics, Crc32cMatchesKnownVectorsAndBitwiseReference) {
  // The CRC-32C check value of "123456789" (RFC 3720 / iSCSI).
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  for (std::string s : {std::string("a"), std::string("brain.Event:2"), std::string(1000, '\x7f')})
    EXPECT_EQ(masked_crc32c(s.data(), s.size()), test::ref_masked_crc(s)) << s.size();
  // Incremental use gives the same CRC as one call.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
}

TEST(Metrics, EventFileHasValidFramingAndScalars) {
  MetricsTempDir dir;
  const double t0 = now_s();
  std::string event_path;
  {
    MetricsLog log(dir.str());
    event_path = log.event_path();
    for (int64_t s = 1; s <= 5; ++s) {
      json r = record_for(s);
      if (s == 3) r["grad_norm"] = NAN;  // non-finite: a NaN scalar in TB, null in the jsonl
      else r["grad_norm"] = 0.5 + 0.1 * double(s);
      log.write(s, r);
    }
  }
  const double t1 = now_s();
  ASSERT_EQ(event_files(dir.path).size(), 1u);
  const std::string name = fs::path(event_path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_NE(name.find("." + std::to_string(::getpid())), std::string::npos) << name;

  std::vector<test::DecodedEvent> ev;
  ASSERT_TRUE(test::read_events(event_path, &ev));
  ASSERT_EQ(ev.size(), 6u);
  EXPECT_EQ(ev[0].file_version, "brain.Event:2");
  EXPECT_EQ(ev[0].step, 0);
  EXPECT_FALSE(ev[0].has_summary);
  for (int64_t s = 1; s <= 5; ++s) {
    const test::DecodedEvent& e = ev[s];
    EXPECT_EQ(e.step, s);
    EXPECT_GE(e.wall_time, t0 - 1);
    EXPECT_LE(e.wall_time, t1 + 1);
    ASSERT_TRUE(e.has_summary);
    // Numeric fields only (json objects iterate keys sorted); "ok" and "phase" stay in the jsonl.
    ASSERT_EQ(e.scalars.size(), 4u);
    const json r = record_for(s);
    EXPECT_EQ(e.scalars[0].first, "grad_norm");
    if (s == 3) EXPECT_TRUE(std::isnan(e.scalars[0].second));
    else EXPECT_EQ(e.scalars[0].second, static_cast<float>(0.5 + 0.1 * double(s)));
    EXPECT_EQ(e.scalars[1].first, "loss");
    EXPECT_EQ(e.scalars[1].second, static_cast<float>(r["loss"].get<double>()));
    EXPECT_EQ(e.scalars[2].first, "lr");
    EXPECT_EQ(e.scalars[2].second, static_cast<float>(r["lr"].get<double>()));
    EXPECT_EQ(e.scalars[3].first, "tokens");
    EXPECT_EQ(e.scalars[3].second, static_cast<float>(1000 * s + 17));
  }
}

TEST(Metrics, CorruptedEventByteFailsTheCrc) {
  // The reader really checks: flipping one payload byte must be caught.
  const std::string framed = tfrecord_frame(encode_scalars_event(1.5, 7, {{"loss", 0.25f}}));
  std::vector<std::string> recs;
  ASSERT_TRUE(test::read_tfrecords(framed, &recs));
  std::string bad = framed;
  bad[14] ^= 0x01;
  recs.clear();
  EXPECT_FALSE(test::read_tfrecords(bad, &recs));
  bad = framed;
  bad[0] ^= 0x01;  // length
  recs.clear();
  EXPECT_FALSE(test::read_tfrecords(bad, &recs));
}

TEST(Metrics, NegativeAndLargeStepsEncode) {
  for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{127}, int64_t{128}, int64_t{1} << 40, int64_t{-3}}) {
    test::DecodedEvent e;
    ASSERT_TRUE(test::decode_event(encode_scalars_event(2.25, step, {{"x", -1.5f}}), &e));
    EXPECT_EQ(e.step, step);
    EXPECT_EQ(e.wall_time, 2.25);
    ASSERT_EQ(e.scalars.size(), 1u);
    EXPECT_EQ(e.scalars[0].second, -1.5f);
  }
}

TEST(Metrics, JsonlRoundTrip) {
  MetricsTempDir dir;
  const double t0 = now_s();
  {
    MetricsLog log(dir.str());
    for (int64_t s = 1; s <= 4; ++s) {
      json r = record_for(s);
      r["inf_value"] = s == 2 ? INFINITY : 1.25 * double(s);
      log.write(s, r);
    }
  }
  // Each line starts with step and time (ordered), then the record's keys.
  const std::string text = test::slurp(dir.str() + "/metrics.jsonl");
  EXPECT_EQ(text.rfind("{\"step\":1,\"time\":", 0), 0u) << text.substr(0, 60);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 4);

  int64_t torn = -1;
  const auto recs = MetricsLog::read(dir.str() + "/metrics.jsonl", &torn);
  EXPECT_EQ(torn, 0);
  ASSERT_EQ(recs.size(), 4u);
  for (int64_t s = 1; s <= 4; ++s) {
    const json& r = recs[s - 1];
    const json want = record_for(s);
    EXPECT_EQ(r["step"], s);
    EXPECT_GE(r["time"].get<double>(), t0 - 1);
    EXPECT_LE(r["time"].get<double>(), now_s() + 1);
    EXPECT_EQ(r["loss"].get<double>(), want["loss"].get<double>());  // shortest round-trip repr
    EXPECT_EQ(r["lr"].get<double>(), want["lr"].get<double>());
    EXPECT_EQ(r["tokens"].get<int64_t>(), 1000 * s + 17);
    EXPECT_EQ(r["ok"], s % 2 == 0);
    EXPECT_EQ(r["phase"], "train");
    if (s == 2) EXPECT_TRUE(r["inf_value"].is_null());
    else EXPECT_EQ(r["inf_value"].get<double>(), 1.25 * double(s));
  }
}

TEST(Metrics, RejectsNonObjectAndReservedKeys) {
  MetricsTempDir dir;
  MetricsLog log(dir.str(), false);
  EXPECT_THROW(log.write(1, json::array({1, 2})), Error);
  EXPECT_THROW(log.write(1, json{{"step", 3}}), Error);
  EXPECT_THROW(log.write(1, json{{"time", 3}}), Error);
  log.write(1, json::object());  // an empty record is a valid line
  EXPECT_EQ(MetricsLog::read(log.jsonl_path()).size(), 1u);
}

TEST(Metrics, WithoutTensorboardWritesOnlyJsonl) {
  MetricsTempDir dir;
  {
    MetricsLog log(dir.str() + "/nested/run", false);
    EXPECT_TRUE(log.event_path().empty());
    log.write(1, record_for(1));
  }
  EXPECT_FALSE(fs::exists(dir.path / "nested/run/tensorboard"));
  EXPECT_EQ(MetricsLog::read(dir.str() + "/nested/run/metrics.jsonl").size(), 1u);
}

TEST(Metrics, TwoLogsInOneSecondGetDistinctEventFiles) {
  MetricsTempDir dir;
  MetricsLog a(dir.str()), b(dir.str());
  EXPECT_NE(a.event_path(), b.event_path());
  EXPECT_EQ(event_files(dir.path).size(), 2u);
}

// The run directory deleted while the run goes on (session 16: every later record went to the
// deleted files without a word): metrics.jsonl and the TensorBoard file are created again at
// their paths, the TensorBoard one starting with its version event, and the log file too.
TEST(Metrics, FilesDeletedUnderARunAreCreatedAgain) {
  MetricsTempDir dir;
  const std::string run = dir.str() + "/run";
  MetricsLog log(run);
  set_log_file(run + "/train.log");
  log.write(1, record_for(1));
  log_info("before the deletion");
  fs::remove_all(run);
  log.write(2, record_for(2));
  log_info("after the deletion");
  set_log_file("");
  const auto recs = MetricsLog::read(run + "/metrics.jsonl");
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0]["step"], 2);
  std::vector<test::DecodedEvent> events;
  ASSERT_TRUE(test::read_events(log.event_path(), &events));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[1].step, 2);
  const std::string text = test::slurp(run + "/train.log");
  EXPECT_NE(text.find("was deleted"), std::string::npos) << text;
  EXPECT_NE(text.find("after the deletion"), std::string::npos) << text;
  EXPECT_EQ(text.find("before the deletion"), std::string::npos) << text;
}

TEST(Metrics, TornLastLineIsSkippedCountedAndRepairedOnReopen) {
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  {
    MetricsLog log(dir.str(), false);
    for (int64_t s = 1; s <= 3; ++s) log.write(s, record_for(s));
  }
  const std::string good = test::slurp(path);
  test::spit(path, good + "{\"step\":4,\"time\":17123.5,\"lo");  // a crash mid-line
  int64_t torn = 0;
  auto recs = MetricsLog::read(path, &torn);
  EXPECT_EQ(recs.size(), 3u);
  EXPECT_EQ(torn, 1);
  EXPECT_NO_THROW(MetricsLog::read(path));  // the count is optional

  // Reopening cuts the torn tail, so the next record starts on its own line.
  {
    MetricsLog log(dir.str(), false);
    log.write(4, record_for(4));
  }
  recs = MetricsLog::read(path, &torn);
  EXPECT_EQ(torn, 0);
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(recs[3]["step"], 4);
  EXPECT_EQ(test::slurp(path).substr(0, good.size()), good);
}

TEST(Metrics, CompleteLastLineWithoutNewlineIsKept) {
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  test::spit(path, "{\"step\":1,\"time\":1.5,\"loss\":0.75}\n{\"step\":2,\"time\":2.5,\"loss\":0.5}");
  int64_t torn = -1;
  EXPECT_EQ(MetricsLog::read(path, &torn).size(), 2u);
  EXPECT_EQ(torn, 0);
  {
    MetricsLog log(dir.str(), false);
    log.write(3, json{{"loss", 0.25}});
  }
  const auto recs = MetricsLog::read(path, &torn);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[1]["loss"], 0.5);
  EXPECT_EQ(recs[2]["step"], 3);
}

TEST(Metrics, DamagedMiddleLineIsAnError) {
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  test::spit(path, "{\"step\":1,\"loss\":0.75}\n{\"step\":2,\"lo\n{\"step\":3,\"loss\":0.5}\n");
  try {
    MetricsLog::read(path);
    FAIL() << "expected InvalidData";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl:2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(MetricsLog::read(dir.str() + "/missing.jsonl"), Error);
}

TEST(Metrics, EmptyFileReadsAsNoRecords) {
  MetricsTempDir dir;
  MetricsLog log(dir.str(), false);
  int64_t torn = -1;
  EXPECT_TRUE(MetricsLog::read(log.jsonl_path(), &torn).empty());
  EXPECT_EQ(torn, 0);
}

TEST(Metrics, TruncateAfterKeepsEarlierStepsAndDropsTornLine) {
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  {
    MetricsLog log(dir.str());
    for (int64_t s = 1; s <= 6; ++s) log.write(s, record_for(s));
  }
  test::spit(path, test::slurp(path) + "{\"step\":7,\"ti");  // the crash that forced the resume
  std::string event_path;
  {
    MetricsLog log(dir.str());  // resumed process, checkpoint at step 3
    event_path = log.event_path();
    log.truncate_after(3);
    auto recs = MetricsLog::read(path);
    ASSERT_EQ(recs.size(), 3u);
    for (int64_t s = 1; s <= 3; ++s) EXPECT_EQ(recs[s - 1]["step"], s);
    // Writes after the atomic rewrite land in the new file (the descriptor was reopened).
    for (int64_t s = 4; s <= 5; ++s) log.write(s, record_for(s, 100.0));
  }
  int64_t torn = -1;
  const auto recs = MetricsLog::read(path, &torn);
  EXPECT_EQ(torn, 0);
  ASSERT_EQ(recs.size(), 5u);
  for (int64_t s = 1; s <= 5; ++s) EXPECT_EQ(recs[s - 1]["step"], s);
  EXPECT_EQ(recs[3]["loss"].get<double>(), record_for(4, 100.0)["loss"].get<double>());
  EXPECT_FALSE(fs::exists(path + ".tmp-" + std::to_string(::getpid())));

  // The resumed event file: file_version, SessionLog START at step 4, then steps 4 and 5.
  std::vector<test::DecodedEvent> ev;
  ASSERT_TRUE(test::read_events(event_path, &ev));
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0].file_version, "brain.Event:2");
  EXPECT_TRUE(ev[1].session_start);
  EXPECT_EQ(ev[1].step, 4);
  EXPECT_EQ(ev[2].step, 4);
  EXPECT_EQ(ev[3].step, 5);
}

TEST(Metrics, TruncateAfterZeroAndPastTheEnd) {
  MetricsTempDir dir;
  MetricsLog log(dir.str(), false);
  for (int64_t s = 1; s <= 3; ++s) log.write(s, record_for(s));
  log.truncate_after(10);
  EXPECT_EQ(MetricsLog::read(log.jsonl_path()).size(), 3u);
  log.truncate_after(0);
  EXPECT_TRUE(MetricsLog::read(log.jsonl_path()).empty());
  log.write(1, record_for(1));
  EXPECT_EQ(MetricsLog::read(log.jsonl_path()).size(), 1u);
}

// A resume cuts what follows the checkpoint's step off in place: the log is neither copied nor
// replaced (same inode), and a log with nothing to drop is left as it is.
TEST(Metrics, TruncateAfterCutsTheTailInPlace) {
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  MetricsLog log(dir.str(), false);
  for (int64_t s = 1; s <= 6; ++s) log.write(s, record_for(s));
  const auto inode = [&] {
    struct stat st{};
    EXPECT_EQ(::stat(path.c_str(), &st), 0);
    return st.st_ino;
  };
  const auto before = inode();
  const std::string whole = test::slurp(path);
  log.truncate_after(6);
  EXPECT_EQ(test::slurp(path), whole);
  EXPECT_EQ(inode(), before);
  log.truncate_after(4);
  EXPECT_EQ(inode(), before);
  const auto recs = MetricsLog::read(path);
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(recs[3]["step"], 4);
  EXPECT_EQ(whole.substr(0, test::slurp(path).size()), test::slurp(path));
  log.write(5, record_for(5, 1.0));  // appended after the cut
  ASSERT_EQ(MetricsLog::read(path).size(), 5u);
  EXPECT_EQ(MetricsLog::read(path)[4]["loss"].get<double>(), record_for(5, 1.0)["loss"].get<double>());
}

// Out of order (a later line of an earlier step, e.g. written by hand): the kept lines are
// rewritten in file order through a temp file, which does not stay behind.
TEST(Metrics, TruncateAfterKeepsAnEarlierStepThatFollowsADroppedOne) {
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  test::spit(path, "{\"step\":1,\"loss\":1}\n{\"step\":5,\"loss\":5}\n\n{\"step\":2,\"loss\":2}\n"
                   "{\"note\":\"no step\"}\n{\"step\":6,\"loss\":6}\n{\"step\":3,\"lo");
  MetricsLog log(dir.str(), false);  // cuts the torn tail
  log.truncate_after(3);
  const auto recs = MetricsLog::read(path);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0]["step"], 1);
  EXPECT_EQ(recs[1]["step"], 2);
  EXPECT_EQ(recs[2]["note"], "no step");
  log.write(4, record_for(4));
  ASSERT_EQ(MetricsLog::read(path).size(), 4u);  // the descriptor follows the new file
  EXPECT_EQ(MetricsLog::read(path)[3]["step"], 4);
  for (const auto& e : fs::directory_iterator(dir.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  // A damaged line before the last is refused, and the log is left as it was.
  const std::string damaged = "{\"step\":1}\n{\"step\":5,\"lo\n{\"step\":6}\n";
  test::spit(path, damaged);
  try {
    log.truncate_after(3);
    FAIL() << "expected InvalidData";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl:2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::slurp(path), damaged);
}

int64_t status_kib(const char* field) {  // a "VmXXX:" line of /proc/self/status
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field)));
  return -1;
}

// metrics.jsonl grows with the run (~0.7 KB a step): a resume must not hold it in memory. It
// used to be read whole and parsed line by line into one vector, ~6x its size at peak (a
// 90 MB log of a 125k-step run: 785 MB). Peak RSS (VmHWM, reset through clear_refs) over one
// truncate of a 24 MB log stays within 12 MB, for the in-place cut and for the rewrite (before
// the fix: 172 MB and 124 MB).
TEST(Metrics, TruncateAfterMemoryDoesNotGrowWithTheLog) {
#if defined(__SANITIZE_ADDRESS__)
  // ASan keeps freed blocks in its quarantine (256 MB by default), so the peak RSS of a pass that
  // parses 60,000 lines one at a time measures the quarantine, not opd (105 MB here on the
  // streamed code); the plain build of this suite runs the check.
  GTEST_SKIP() << "ASan's quarantine holds freed memory: RSS does not measure opd's use here";
#endif
  if (!std::ofstream("/proc/self/clear_refs").good()) GTEST_SKIP() << "no /proc/self/clear_refs";
  MetricsTempDir dir;
  const std::string path = dir.str() + "/metrics.jsonl";
  std::string lines;
  const int64_t steps = 60000;
  for (int64_t s = 1; s <= steps; ++s) {
    json r = record_for(s);
    for (int k = 0; k < 12; ++k) r["time/phase_" + std::to_string(k) + "_s"] = 0.001 * double(s % 97 + k);
    lines += "{\"step\":" + std::to_string(s) + "," + r.dump().substr(1) + "\n";
  }
  ASSERT_GT(lines.size(), 20u << 20);
  for (const bool rewrite : {false, true}) {
    // rewrite: a line of step 1 at the end makes the dropped lines a middle part.
    test::spit(path, lines + (rewrite ? "{\"step\":1,\"late\":1}\n" : ""));
    MetricsLog log(dir.str(), false);
    { std::ofstream("/proc/self/clear_refs") << "5"; }
    const int64_t rss0 = status_kib("VmRSS:");
    log.truncate_after(steps / 2);
    const int64_t peak = status_kib("VmHWM:");
    ASSERT_GT(rss0, 0);
    EXPECT_LT(peak - rss0, 12 * 1024) << (rewrite ? "rewrite" : "in-place cut") << ": peak RSS grew by "
                                      << (peak - rss0) << " KiB over a " << (lines.size() >> 20)
                                      << " MiB log";
    const auto recs = MetricsLog::read(path);
    ASSERT_EQ(recs.size(), static_cast<size_t>(steps / 2 + (rewrite ? 1 : 0)));
    EXPECT_EQ(recs[steps / 2 - 1]["step"], steps / 2);
  }
}

// A rewrite killed between its write and its rename leaves metrics.jsonl.tmp-PID, a copy of the
// log: the next writer of the run directory removes it (50 kill/resume cycles could leave 50).
TEST(Metrics, TempFilesOfAKilledRewriteAreRemovedWhenTheLogOpens) {
  MetricsTempDir dir;
  test::spit(dir.str() + "/metrics.jsonl", "{\"step\":1}\n");
  test::spit(dir.str() + "/metrics.jsonl.tmp-4194301", "{\"step\":1}\n{\"step\":2}\n");
  test::spit(dir.str() + "/metrics.jsonl.tmp-77", "{\"step\":1}\n");
  test::spit(dir.str() + "/metrics.jsonl.tmp-notes", "kept: not a PID");
  test::spit(dir.str() + "/config.json.tmp-77", "{}");  // another file's: not the log's business
  MetricsLog log(dir.str(), false);
  EXPECT_FALSE(fs::exists(dir.path / "metrics.jsonl.tmp-4194301"));
  EXPECT_FALSE(fs::exists(dir.path / "metrics.jsonl.tmp-77"));
  EXPECT_TRUE(fs::exists(dir.path / "metrics.jsonl.tmp-notes"));
  EXPECT_TRUE(fs::exists(dir.path / "config.json.tmp-77"));
  EXPECT_EQ(MetricsLog::read(log.jsonl_path()).size(), 1u);
}

// tensorboard's EventAccumulator (the reader behind TensorBoard's scalars) must see exactly
// the scalars written, including after a resume that rewound the run (START purge).
TEST(Metrics, TensorboardEventAccumulatorReadsEveryScalar) {
  const std::string python = test::find_program("OPD_PYTHON", {"python3"});
  if (python.empty()) OPD_SKIP_OR_FAIL_MISSING_TOOL("python3 not found in PATH (or $OPD_PYTHON)");
  MetricsTempDir dir;
  json expected = json::object();  // tag -> [[step, value or null for NaN], ...]
  auto expect = [&](const std::string& tag, int64_t step, double v) {
    expected[tag].push_back(json::array({step, std::isnan(v) ? json(nullptr) : json(static_cast<float>(v))}));
  };
  {
    MetricsLog log(dir.str());
    for (int64_t s = 1; s <= 6; ++s) {
      json r = record_for(s);
      r["grad_norm"] = s == 2 ? NAN : 0.3 * double(s);
      log.write(s, r);
      if (s > 3) continue;  // overwritten by the resumed run below
      expect("grad_norm", s, r["grad_norm"].is_null() ? NAN : r["grad_norm"].get<double>());
      expect("loss", s, r["loss"].get<double>());
      expect("lr", s, r["lr"].get<double>());
      expect("tokens", s, double(r["tokens"].get<int64_t>()));
    }
  }
  {
    MetricsLog log(dir.str());
    log.truncate_after(3);
    for (int64_t s = 4; s <= 7; ++s) {
      json r = record_for(s, 10.0);
      r["grad_norm"] = 0.7 * double(s);
      log.write(s, r);
      expect("grad_norm", s, r["grad_norm"].get<double>());
      expect("loss", s, r["loss"].get<double>());
      expect("lr", s, r["lr"].get<double>());
      expect("tokens", s, double(r["tokens"].get<int64_t>()));
    }
  }
  const std::string expected_path = dir.str() + "/expected.json";
  test::spit(expected_path, expected.dump());
  const std::string script = test::source_dir() + "/tests/train/tb_oracle.py";
  const test::ToolRun run = test::run_tool(
      "timeout 300 " + test::sh_quote(python) + " " + test::sh_quote(script) + " " +
          test::sh_quote(dir.str() + "/tensorboard") + " " + test::sh_quote(expected_path),
      dir.str());
  if (run.exit_code == 3) OPD_SKIP_OR_FAIL_MISSING_TOOL(run.err);
  ASSERT_EQ(run.exit_code, 0) << "stdout:\n" << run.out << "\nstderr:\n" << run.err;
  EXPECT_NE(run.out.find("OK 4 tags 28 scalars"), std::string::npos) << run.out;
}

}  // namespace
}  // namespace opd
