// Training metrics of one run: RUN/metrics.jsonl (one JSON object per logged step) and
// TensorBoard event files under RUN/tensorboard/, written without protobuf or TensorFlow.
//
// metrics.jsonl line: {"step": N, "time": unix seconds, ...record}. Non-finite numbers cannot be
// written in JSON and appear as null (readers treat null as a gap). Every line is written with
// one write(2) on an O_APPEND descriptor, so a crashed process loses at most the line it was
// writing; a torn last line is dropped when the log is reopened and skipped by read().
// One writer per run directory (rank 0 of a distributed run); write() is thread-safe.
//
// TensorBoard: events.out.tfevents.<unix time>.<hostname>.<pid> in TFRecord framing
//   uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
// with masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and CRC-32C (Castagnoli). Each
// record is a hand-encoded tensorflow.Event {wall_time = 1 (double), step = 2 (int64),
// file_version = 3 | summary = 5 {value = 1 {tag = 1, simple_value = 2 (float)}} |
// session_log = 7 {status = 1}}; the first event carries file_version "brain.Event:2".
// Resuming at step S writes SessionLog{START} at step S+1, which makes TensorBoard discard the
// events of the earlier run with step > S (its "purge orphaned data" rule for file version 2).
#pragma once

#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace opd {

class MetricsLog {
 public:
  // Creates run_dir (and run_dir/tensorboard when `tensorboard`) if needed. Opens
  // run_dir/metrics.jsonl for appending; a torn last line left by a crash is cut off first.
  explicit MetricsLog(const std::string& run_dir, bool tensorboard = true);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Appends {"step": step, "time": now, ...record} to metrics.jsonl and one TensorBoard event
  // with a scalar per numeric field (tag = key; booleans, strings, null, arrays and objects go to
  // the jsonl only). `record` must be an object without the keys "step" and "time". A write that
  // fails (a full disk) does not throw: metrics are not the run's work, so the record is dropped
  // (the partial bytes cut off, the file stays readable) with a warning naming the file and the
  // cause, once until writing works again.
  void write(int64_t step, const nlohmann::json& record);

  // Resume from a checkpoint at `step`: atomically rewrites metrics.jsonl keeping the lines with
  // step <= `step` (a torn last line is dropped) and tells TensorBoard that later steps are stale.
  void truncate_after(int64_t step);

  // The records of a metrics.jsonl, in file order. A torn last line (no newline, or not a JSON
  // object) is skipped and counted in *torn_lines; a malformed line before it is InvalidData.
  static std::vector<nlohmann::json> read(const std::string& path, int64_t* torn_lines = nullptr);

  const std::string& jsonl_path() const { return jsonl_path_; }
  const std::string& event_path() const { return event_path_; }  // empty without TensorBoard

 private:
  void open_jsonl();
  void write_event(const std::string& event_bytes);
  // Appends bytes; an Io failure (a full disk) is logged (once until writing works again), the
  // partial record cut off and counted in `lost`, and the run goes on: false.
  // A file deleted under the run (st_nlink 0) is created again first (reopen_deleted).
  bool append(int& fd, const std::string& bytes, const std::string& path, int64_t& lost);
  void reopen_deleted(int& fd, const std::string& path);

  std::string run_dir_, jsonl_path_, event_path_;
  int jsonl_fd_ = -1, event_fd_ = -1;
  int64_t jsonl_lost_ = 0, event_lost_ = 0;  // records not written since the last that was
  std::mutex mutex_;
};

// --- TFRecord / Event encoding, exposed for tests and tools ---------------------------------

uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);  // CRC-32C (Castagnoli)
uint32_t masked_crc32c(const void* data, size_t n);
std::string tfrecord_frame(std::string_view data);   // length, crcs, data as one record

struct ScalarValue {
  std::string tag;
  float value = 0;
};
std::string encode_file_version_event(double wall_time, std::string_view version);
std::string encode_scalars_event(double wall_time, int64_t step, const std::vector<ScalarValue>& values);
std::string encode_session_start_event(double wall_time, int64_t step);

}  // namespace opd
