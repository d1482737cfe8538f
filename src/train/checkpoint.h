// Atomic, complete, verifiable checkpoints (DESIGN.md invariant 2: nothing is lost).
//
// Layout under a run's checkpoint root:
//   step-00000123/             one complete checkpoint
//     <name>.safetensors       tensor groups (e.g. model, optimizer), written by save_safetensors
//     state.json               everything else: step, RNG state, data cursor, config, counters
//     MANIFEST.json            written last: every file with its size and SHA-256
//   LATEST                     name of the newest complete checkpoint (atomically replaced)
//
// A checkpoint is written into "step-00000123.tmp-<pid>", every file fsync'ed, then the folder
// is renamed into place and the root fsync'ed: a crash at any instant leaves either the old set
// or the old set plus one complete new checkpoint, never a half-written one under a final name.
// Loading verifies the manifest (sizes and hashes); a corrupt checkpoint is refused with an
// error naming the file, and `load_latest_checkpoint` falls back to the newest one that verifies.
//
// Sharded checkpoints (data parallel with ZeRO, dist/zero_checkpoint.h) use the same folder with
// several writers: rank 0 opens the temp folder (begin_checkpoint), every rank writes its own
// optimizer shard into it (optimizer.rank-00001-of-00004.safetensors: its master, exp_avg and
// exp_avg_sq shard buffers), fsyncs it and reports name, size and SHA-256 to rank 0; rank 0
// writes the model export (model.safetensors, config.json, tokenizer files), state.json (with the
// shard layout) and the MANIFEST covering every rank's files, then renames (commit_checkpoint).
// A checkpoint whose manifest misses a shard is never renamed into place; a corrupt or missing
// shard file makes the whole checkpoint corrupt. The root must be on a file system every rank
// sees (one node, or a shared file system across nodes).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace opd {

struct CheckpointData {
  int64_t step = 0;
  std::map<std::string, std::map<std::string, Tensor>> tensor_files;  // file stem -> tensors
  nlohmann::json state = nlohmann::json::object();
  // Other files stored verbatim (e.g. config.json and tokenizer files, which make the
  // checkpoint folder a Hugging Face model directory); covered by the manifest like the rest.
  std::map<std::string, std::string> files;  // plain file name -> bytes
  // The folder it was loaded from (set by load_checkpoint): tensor files that were verified but
  // not loaded (load_tensors = false) are read from there, e.g. by byte range through an mmap.
  std::string dir;
};

struct CheckpointLoadOptions {
  bool verify = true;        // check every manifest file's size and SHA-256 (streamed, O(1) memory)
  bool load_tensors = true;  // read *.safetensors into tensor_files; false: leave them on disk
  // Hash only the manifest's files i (in name order) with i % verify_stride == verify_offset
  // (state.json always): several processes verify one checkpoint in parallel, each its share.
  int verify_stride = 1, verify_offset = 0;
};

// Writes step-<step> under root (created if needed), updates LATEST, then deletes all but the
// newest `keep_last` complete checkpoints (0 = keep all). Returns the checkpoint's path.
std::string save_checkpoint(const std::string& root, const CheckpointData& data, int keep_last);

// Loads and verifies one checkpoint folder; throws InvalidData naming the bad file.
CheckpointData load_checkpoint(const std::string& dir, const CheckpointLoadOptions& options = {});

// Complete checkpoint folders under root, oldest first (by step; temp folders ignored).
std::vector<std::string> list_checkpoints(const std::string& root);

// The newest checkpoint that verifies, or nullopt when there is none. Corrupt ones are
// logged (with the reason) and skipped.
std::optional<CheckpointData> load_latest_checkpoint(const std::string& root,
                                                     std::string* path = nullptr,
                                                     const CheckpointLoadOptions& options = {});

// Multi-writer checkpoints (sharded, see the top). A file some writer put into the temp folder:
struct CheckpointFile {
  std::string name;  // plain file name inside the checkpoint folder
  uint64_t bytes = 0;
  std::string sha256;
};
// Size and SHA-256 of dir/name (the writer computes them after its fsync).
CheckpointFile describe_checkpoint_file(const std::string& dir, const std::string& name);
// Creates root (if needed) and an empty temp folder for step `step`; returns the folder's path.
std::string begin_checkpoint(const std::string& root, int64_t step);
// Writes data's tensor files, extra files and state.json into tmp_dir, checks that every file in
// `written` exists there with its reported size (a writer on a file system rank 0 does not see is
// an error saying so), writes MANIFEST.json over all of them last, renames the folder into place,
// updates LATEST and prunes to keep_last. On any error the temp folder is removed and the error
// rethrown (LATEST still names the previous checkpoint). Once the folder is renamed into place
// the checkpoint is complete: a LATEST that cannot be rewritten then is only a warning (nothing
// reads LATEST to resume). save_checkpoint is begin + commit.
std::string commit_checkpoint(const std::string& root, const std::string& tmp_dir,
                              const CheckpointData& data, const std::vector<CheckpointFile>& written,
                              int keep_last);
// Removes a temp folder of an abandoned checkpoint (errors are logged, never thrown).
void abandon_checkpoint(const std::string& tmp_dir) noexcept;

// One safetensors file whose tensors arrive in any order (e.g. bucket by bucket from an
// all-gather, so the writer never holds more than one bucket): the header is fixed up front from
// the names, dtypes and shapes, each tensor is written at its offset (pwrite), finish() checks that
// every tensor was written, fsyncs and closes. Byte-identical to save_safetensors of the same
// tensors (data in descending element size then name order, 8-byte aligned header).
class SafetensorsStreamWriter {
 public:
  struct Entry {
    std::string name;
    DType dtype = DType::F32;
    Shape shape;
  };
  SafetensorsStreamWriter(const std::string& path, std::vector<Entry> entries,
                          const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsStreamWriter();  // an unfinished file is closed and removed
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;
  // Writes tensor `name` (host, its declared dtype and shape); each exactly once.
  void write(const std::string& name, const Tensor& t);
  void finish();

 private:
  struct Slot {
    DType dtype;
    Shape shape;
    uint64_t offset = 0;  // in the file
    bool written = false;
  };
  std::string path_;
  int fd_ = -1;
  bool finished_ = false;
  std::map<std::string, Slot> slots_;
};

// fsync helpers shared with other atomic writers.
void fsync_path(const std::string& path);            // a file or a directory
void write_file_atomic(const std::string& path, const std::string& bytes);
// Removes PATH.tmp-<pid> files of other processes: what a write_file_atomic (or a rewrite of
// metrics.jsonl) left when its process was killed between the write and the rename. Each holds a
// copy of PATH and nothing else removed it, so a run killed and resumed many times could pile them
// up. For files with one writer per run directory (config.json, metrics.jsonl), called when the
// writer starts; errors are ignored.
void remove_stale_temp_files(const std::string& path) noexcept;
void write_file_synced(const std::string& path, const std::string& bytes);  // create/truncate + fsync

}  // namespace opd
