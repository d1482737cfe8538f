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
};

// Writes step-<step> under root (created if needed), updates LATEST, then deletes all but the
// newest `keep_last` complete checkpoints (0 = keep all). Returns the checkpoint's path.
std::string save_checkpoint(const std::string& root, const CheckpointData& data, int keep_last);

// Loads and verifies one checkpoint folder; throws InvalidData naming the bad file.
CheckpointData load_checkpoint(const std::string& dir);

// Complete checkpoint folders under root, oldest first (by step; temp folders ignored).
std::vector<std::string> list_checkpoints(const std::string& root);

// The newest checkpoint that verifies, or nullopt when there is none. Corrupt ones are
// logged (with the reason) and skipped.
std::optional<CheckpointData> load_latest_checkpoint(const std::string& root,
                                                     std::string* path = nullptr);

// fsync helpers shared with other atomic writers.
void fsync_path(const std::string& path);            // a file or a directory
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace opd
