// Sharded checkpoints of the ZeRO optimizer (issue 9; the folder format is in
// train/checkpoint.h): every rank writes only its own shard of the optimizer state, rank 0 writes
// the Hugging Face model export streamed bucket by bucket and commits the folder once every rank
// has reported its file; resuming re-shards onto any number of ranks by reading byte ranges.
//
// Files of step-N/ written by a W-rank job:
//   optimizer.rank-0000r-of-0000W.safetensors  rank r: 1-D f32 "master", "exp_avg", "exp_avg_sq",
//                                              each layout.shard_numel long (dist/zero.h buffers)
//   model.safetensors                          rank 0: full f32 master weights by HF name
//   config.json, tokenizer files               rank 0 (CheckpointData::files)
//   state.json                                 rank 0: the trainer's state plus "optimizer_steps"
//                                              and "zero_shards": {layout (dist/reshard.h JSON),
//                                              files [rank order], tensors}
//   MANIFEST.json                              rank 0, last: every file of every rank
// Memory: the shard on the host (12P/W bytes) per rank, one bucket of f32 on rank 0 for the export.
//
// Test hook (test-only; documented in docs/distributed.md): OPD_TEST_CKPT_FAULT="die:R:S" makes
// rank R SIGKILL itself right after fsyncing its shard of the step-S checkpoint (before it reports
// to rank 0); "fail:R:S" makes that rank's shard write fail with an Io error instead.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dist/tcp_store.h"
#include "dist/zero.h"
#include "train/checkpoint.h"

namespace opd::dist {

// The outcome of a sharded save that every rank learned through the store and agrees on: the
// save failed, but each rank left it at the same collective, so the job may go on training (the
// trainer warns and retries at the next save point). Any other Error out of a save may leave the
// ranks apart and ends the run.
class CheckpointNotWritten : public Error {
 public:
  explicit CheckpointNotWritten(const std::string& message) : Error(ErrorKind::Io, message) {}
};

// The shard file name of `rank` in a `world`-rank checkpoint.
std::string zero_shard_file_name(int rank, int world);

// Collective: every rank calls it with the same step. data (used on rank 0 only, besides step):
// state.json contents and extra files; its tensor_files must be empty. names: the parameters'
// HF names in layout order (the model export's tensor names). Returns the committed folder on
// every rank. When any rank fails to write (or rank 0 to commit), every rank throws
// CheckpointNotWritten (Io) naming the rank(s) and file(s), the temp folder is removed and LATEST
// still names the previous checkpoint. A failed store call (a peer died or aborted, a timeout)
// throws a plain Error instead: then the ranks may not all have reached the same point.
std::string save_zero_checkpoint(ZeroOptimizer& zero, const std::string& root,
                                 const CheckpointData& data, const std::vector<std::string>& names,
                                 int keep_last);

// Collective: the checkpoint a distributed run resumes from, loaded on every rank with its tensor
// files left on disk. Candidates: explicit_path, or (when empty) every complete checkpoint under
// root, newest first (rank 0 lists them). Each rank hashes its share of a candidate's files
// (round robin, so the ranks verify one checkpoint in parallel); the first candidate every rank
// accepts is returned. A corrupt one is logged ("skipping checkpoint ...", naming rank and file)
// and skipped, or with an explicit path makes every rank throw InvalidData naming them.
// nullopt: no checkpoint (auto).
std::optional<CheckpointData> load_checkpoint_collectively(Store& store, const std::string& root,
                                                           const std::string& explicit_path);

// Whether a loaded checkpoint holds ZeRO shards (else it is a full, single-writer checkpoint
// with model.safetensors + optimizer.safetensors).
bool is_sharded_checkpoint(const CheckpointData& ck);

// Collective (the model copy is all-gathered): this rank's shard of `zero`'s layout from a
// checkpoint of any world size (sharded, or full), reading only the byte ranges it needs through
// mmaps of the files in ck.dir (load_checkpoint with load_tensors = false is enough). Throws
// InvalidData naming the file on a malformed layout, a missing tensor or a size mismatch.
void load_zero_checkpoint(ZeroOptimizer& zero, const CheckpointData& ck,
                          const std::vector<std::string>& names, const std::vector<Shape>& shapes);

// The full per-parameter state (host f32, shaped like the parameters) from a checkpoint of any
// kind, for a single process (world size 1: the only case that materializes full m and v).
ZeroOptimizer::FullState read_full_state(const CheckpointData& ck,
                                         const std::vector<std::string>& names,
                                         const std::vector<Shape>& shapes);

}  // namespace opd::dist
