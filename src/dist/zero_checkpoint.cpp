// Sharded ZeRO checkpoints (zero_checkpoint.h): the save protocol over the store (rank 0 opens the
// temp folder, every rank writes and reports its shard, every rank learns the outcome) and the
// re-sharding reader (dist/reshard.h plans over mmapped shard files).
#include "dist/zero_checkpoint.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/log.h"
#include "dist/reshard.h"
#include "model/safetensors.h"

namespace opd::dist {
namespace fs = std::filesystem;

namespace {

const char* const kShardTensors[] = {"master", "exp_avg", "exp_avg_sq"};

// OPD_TEST_CKPT_FAULT="die:R:S" / "fail:R:S" (test-only, zero_checkpoint.h): the action for this
// rank at this step, or "".
std::string test_fault(int rank, int64_t step) {
  const char* v = std::getenv("OPD_TEST_CKPT_FAULT");
  if (!v) return "";
  char what[8] = {0};
  int r = -1;
  long long s = -1;
  if (std::sscanf(v, "%4[a-z]:%d:%lld", what, &r, &s) != 3) {
    log_warn("OPD_TEST_CKPT_FAULT='", v, "' is not die:RANK:STEP or fail:RANK:STEP; ignored");
    return "";
  }
  return (r == rank && s == step) ? std::string(what) : std::string();
}

// "ok\n<value>" or "error\n<message>" through the store, from rank 0 to everyone.
std::string agree_from_root(Store& store, bool root, const std::optional<std::string>& value,
                            const std::string& error, const char* what) {
  const std::string msg = store.broadcast(
      root ? (error.empty() ? "ok\n" + value.value_or("") : "error\n" + error) : "", 0, what);
  if (msg.rfind("ok\n", 0) == 0) return msg.substr(3);
  throw CheckpointNotWritten(msg.size() > 6 ? msg.substr(6) : msg);
}

Tensor shard_tensor(const SafetensorsFile& f, const char* name, int64_t numel) {
  OPD_CHECK(f.contains(name), InvalidData, "checkpoint shard ", f.path(), " has no tensor '", name,
            "'");
  Tensor t = f.get(name);
  OPD_CHECK(t.dtype() == DType::F32 && t.shape() == Shape{numel}, InvalidData, "checkpoint shard ",
            f.path(), ": '", name, "' is ", t.describe(), ", the layout needs f32[", numel, "]");
  return t;
}

// The old layout and shard file names of a sharded checkpoint, validated.
struct ShardedSource {
  ShardLayout layout;
  std::vector<std::string> files;
};

ShardedSource sharded_source(const CheckpointData& ck, const std::vector<std::string>& names,
                             const std::vector<Shape>& shapes) {
  const std::string where = ck.dir + "/state.json";
  const auto& zs = ck.state.at("zero_shards");
  OPD_CHECK(zs.is_object() && zs.contains("layout") && zs.contains("files") && zs["files"].is_array(),
            InvalidData, where, ": 'zero_shards' needs 'layout' and 'files'");
  ShardedSource s;
  s.layout = shard_layout_from_json(zs["layout"], names, shapes, where);
  OPD_CHECK(zs["files"].size() == static_cast<size_t>(s.layout.world_size), InvalidData, where,
            ": ", zs["files"].size(), " shard files for ", s.layout.world_size, " ranks");
  for (const auto& f : zs["files"]) {
    OPD_CHECK(f.is_string(), InvalidData, where, ": a shard file name is not a string");
    const std::string n = f.get<std::string>();
    OPD_CHECK(!n.empty() && n.find('/') == std::string::npos && n != "." && n != "..", InvalidData,
              where, ": shard file name '", n, "' is not a plain file name");
    s.files.push_back(n);
  }
  return s;
}

int64_t optimizer_steps(const CheckpointData& ck) {
  const auto it = ck.state.find("optimizer_steps");
  OPD_CHECK(it != ck.state.end() && it->is_number_integer() && it->get<int64_t>() >= 0,
            InvalidData, ck.dir, "/state.json: 'optimizer_steps' missing or not a count");
  return it->get<int64_t>();
}

// Builds `to_rank`'s shard of `to` for each of the three state tensors from a sharded checkpoint:
// only the old shard files the plan touches are opened (mmapped), and only their needed pages read.
ZeroOptimizer::ShardState read_resharded(const CheckpointData& ck, const ShardedSource& src,
                                         const ShardLayout& to, int to_rank) {
  const auto copies = plan_reshard(src.layout, to, to_rank);
  std::vector<std::optional<SafetensorsFile>> files(src.layout.world_size);
  for (const auto& c : copies)
    if (!files[c.src_rank]) files[c.src_rank] = SafetensorsFile::open(ck.dir + "/" + src.files[c.src_rank]);
  ZeroOptimizer::ShardState st;
  Tensor* dst[] = {&st.master, &st.exp_avg, &st.exp_avg_sq};
  for (int k = 0; k < 3; ++k) {
    std::vector<Tensor> sources(src.layout.world_size);
    for (int r = 0; r < src.layout.world_size; ++r)
      if (files[r]) sources[r] = shard_tensor(*files[r], kShardTensors[k], src.layout.shard_numel);
    *dst[k] = Tensor::empty({to.shard_numel}, DType::F32);
    apply_reshard(copies, sources, *dst[k]);
  }
  st.steps = optimizer_steps(ck);
  return st;
}

// The same from a full checkpoint (model.safetensors: master weights by name; optimizer.safetensors:
// exp_avg.<name>, exp_avg_sq.<name>), slicing each parameter's mmapped tensor.
ZeroOptimizer::ShardState read_full_as_shard(const CheckpointData& ck, const ShardLayout& to,
                                             int to_rank, const std::vector<std::string>& names) {
  const SafetensorsFile model = SafetensorsFile::open(ck.dir + "/model.safetensors");
  const SafetensorsFile opt = SafetensorsFile::open(ck.dir + "/optimizer.safetensors");
  auto param = [&](const SafetensorsFile& f, const std::string& name, size_t i) {
    OPD_CHECK(f.contains(name), InvalidData, "checkpoint ", f.path(), " has no tensor ", name,
              " (a checkpoint of another model?)");
    Tensor t = f.get(name);
    OPD_CHECK(t.shape() == to.params[i].shape && t.dtype() == DType::F32, InvalidData,
              "checkpoint tensor ", name, " in ", f.path(), " is ", t.describe(),
              ", the model needs f32 ", shape_str(to.params[i].shape));
    return t.reshape({to.params[i].numel});
  };
  ZeroOptimizer::ShardState st;
  Tensor* dst[] = {&st.master, &st.exp_avg, &st.exp_avg_sq};
  for (Tensor* d : dst) *d = Tensor::zeros({to.shard_numel}, DType::F32);
  for (const ParamSegment& seg : shard_param_segments(to, to_rank)) {
    const std::string& n = names[seg.param];
    const Tensor srcs[] = {param(model, n, seg.param), param(opt, "exp_avg." + n, seg.param),
                           param(opt, "exp_avg_sq." + n, seg.param)};
    for (int k = 0; k < 3; ++k) {
      Tensor d = dst[k]->slice_rows(seg.shard_offset, seg.shard_offset + seg.count);
      d.copy_from(srcs[k].slice_rows(seg.param_offset, seg.param_offset + seg.count));
    }
  }
  st.steps = optimizer_steps(ck);
  return st;
}

}  // namespace

namespace {
std::string write_and_commit(ZeroOptimizer& zero, const std::string& root, const std::string& tmp,
                             const CheckpointData& data, const std::vector<std::string>& names,
                             int keep_last);
}  // namespace

std::string zero_shard_file_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "optimizer.rank-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

std::string save_zero_checkpoint(ZeroOptimizer& zero, const std::string& root,
                                 const CheckpointData& data, const std::vector<std::string>& names,
                                 int keep_last) {
  Store& store = zero.comm().store();
  const bool root_rank = zero.comm().rank() == 0;
  const ShardLayout& L = zero.layout();
  OPD_CHECK(names.size() == L.params.size(), InvalidArgument, "sharded checkpoint: ", names.size(),
            " names for ", L.params.size(), " parameters");
  OPD_CHECK(data.tensor_files.empty(), InvalidArgument,
            "sharded checkpoint: tensor files are written by the ranks, not passed in");
  const std::string step_what = cat("checkpoint step ", data.step);

  // 1. Rank 0 opens the temp folder; everyone learns where it is (or why there is none).
  std::string tmp, error;
  if (root_rank) {
    try {
      tmp = begin_checkpoint(root, data.step);
    } catch (const Error& e) {
      error = cat(step_what, ": rank 0 could not create the folder: ", e.what());
    }
  }
  tmp = agree_from_root(store, root_rank, tmp, error, "checkpoint folder");
  try {
    return write_and_commit(zero, root, tmp, data, names, keep_last);
  } catch (...) {
    // A collective failed (a peer died or aborted) or the outcome was a failure: the temp folder
    // never becomes a checkpoint. (After a successful rename it no longer exists.)
    if (root_rank) abandon_checkpoint(tmp);
    throw;
  }
}

namespace {

std::string write_and_commit(ZeroOptimizer& zero, const std::string& root, const std::string& tmp,
                             const CheckpointData& data, const std::vector<std::string>& names,
                             int keep_last) {
  Communicator& comm = zero.comm();
  Store& store = comm.store();
  const int rank = comm.rank(), world = comm.world_size();
  const bool root_rank = rank == 0;
  const ShardLayout& L = zero.layout();
  const std::string step_what = cat("checkpoint step ", data.step);
  std::string error;

  // 2. Every rank writes its shard and fsyncs it (save_safetensors), then hashes it.
  const std::string shard_name = zero_shard_file_name(rank, world);
  CheckpointFile shard_file;
  error.clear();
  try {
    ZeroOptimizer::ShardState st = zero.shard_state();
    const std::string fault = test_fault(rank, data.step);
    if (fault == "fail") OPD_FAIL(Io, "OPD_TEST_CKPT_FAULT: simulated write failure");
    save_safetensors(tmp + "/" + shard_name,
                     {{"master", st.master}, {"exp_avg", st.exp_avg}, {"exp_avg_sq", st.exp_avg_sq}},
                     {{"format", "opd-zero-shard-1"}, {"rank", std::to_string(rank)},
                      {"world_size", std::to_string(world)}, {"steps", std::to_string(st.steps)}});
    shard_file = describe_checkpoint_file(tmp, shard_name);
    if (fault == "die") {
      log_error("OPD_TEST_CKPT_FAULT: rank ", rank, " dies after writing ", shard_name);
      ::raise(SIGKILL);
    }
  } catch (const Error& e) {
    error = cat("rank ", rank, " could not write ", tmp, "/", shard_name, ": ", e.what());
  }

  // 3. The model export: master weights all-gathered bucket by bucket (collective, so every rank
  //    runs the loop even after an error), written by rank 0 as they arrive.
  CheckpointFile model_file;
  {
    std::optional<SafetensorsStreamWriter> writer;
    std::string model_error;
    const std::string model_path = tmp + "/model.safetensors";
    if (root_rank) {
      try {
        std::vector<SafetensorsStreamWriter::Entry> entries;
        for (size_t i = 0; i < names.size(); ++i)
          entries.push_back({names[i], DType::F32, L.params[i].shape});
        writer.emplace(model_path, std::move(entries), std::map<std::string, std::string>{{"format", "pt"}});
      } catch (const Error& e) {
        model_error = e.what();
      }
    }
    for (size_t b = 0; b < L.buckets.size(); ++b) {
      Tensor full = zero.gather_master_bucket(static_cast<int>(b), root_rank && model_error.empty());
      if (!root_rank || !model_error.empty()) continue;
      const auto& bk = L.buckets[b];
      try {
        for (size_t i = bk.first_param; i < bk.end_param; ++i) {
          const auto& p = L.params[i];
          writer->write(names[i], full.slice_rows(p.offset - bk.offset, p.offset - bk.offset + p.numel)
                                      .reshape(p.shape));
        }
      } catch (const Error& e) {
        model_error = e.what();
      }
    }
    if (root_rank && model_error.empty()) {
      try {
        writer->finish();
        model_file = describe_checkpoint_file(tmp, "model.safetensors");
      } catch (const Error& e) {
        model_error = e.what();
      }
    }
    if (!model_error.empty())
      error += cat(error.empty() ? "" : "; ", "rank 0 could not write ", model_path, ": ", model_error);
  }

  // 4. Every rank reports its file (or its error); all learn whether every shard is there.
  nlohmann::json report = error.empty()
      ? nlohmann::json{{"ok", true}, {"name", shard_file.name}, {"bytes", shard_file.bytes},
                       {"sha256", shard_file.sha256}}
      : nlohmann::json{{"ok", false}, {"error", error}};
  const auto reports = store.exchange("checkpoint shards", report.dump());
  std::vector<CheckpointFile> written;
  std::string failures;
  std::vector<std::string> shard_names;
  for (int r = 0; r < world; ++r) {
    const auto j = nlohmann::json::parse(reports[r], nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.value("ok", false)) {
      failures += cat(failures.empty() ? "" : "; ",
                      j.is_object() ? j.value("error", std::string("?")) : cat("rank ", r, ": malformed report"));
      continue;
    }
    written.push_back({j.at("name").get<std::string>(), j.at("bytes").get<uint64_t>(),
                       j.at("sha256").get<std::string>()});
    shard_names.push_back(written.back().name);
  }
  if (!failures.empty())  // every rank read the same reports: an agreed outcome
    throw CheckpointNotWritten(
        cat(step_what, " failed (the previous checkpoint stays the latest): ", failures));

  // 5. Rank 0 writes state.json and the manifest over every rank's files, renames, updates LATEST.
  std::string final_path;
  error.clear();
  if (root_rank) {
    try {
      CheckpointData ck = data;
      ck.state["optimizer_steps"] = zero.steps();
      ck.state["zero_shards"] = {{"layout", shard_layout_to_json(L, names)},
                                 {"files", shard_names},
                                 {"tensors", {"master", "exp_avg", "exp_avg_sq"}}};
      written.push_back(model_file);
      final_path = commit_checkpoint(root, tmp, ck, written, keep_last);
    } catch (const Error& e) {
      error = cat(step_what, ": rank 0 could not commit ", tmp, ": ", e.what());
    }
  }
  return agree_from_root(store, root_rank, final_path, error, "checkpoint commit");
}

}  // namespace

std::optional<CheckpointData> load_checkpoint_collectively(Store& store, const std::string& root,
                                                           const std::string& explicit_path) {
  const int rank = store.rank(), world = store.world_size();
  std::vector<std::string> candidates;
  if (!explicit_path.empty()) {
    candidates.push_back(explicit_path);
  } else {
    // Rank 0's listing is the one every rank works through (the same shared folder).
    nlohmann::json list = nlohmann::json::array();
    if (rank == 0) {
      auto all = list_checkpoints(root);
      for (auto it = all.rbegin(); it != all.rend(); ++it) list.push_back(*it);
    }
    list = nlohmann::json::parse(store.broadcast(list.dump(), 0, "resume candidates"));
    for (const auto& p : list) candidates.push_back(p.get<std::string>());
  }
  for (const std::string& path : candidates) {
    std::optional<CheckpointData> ck;
    std::string error;
    try {
      ck = load_checkpoint(path, {true, false, world, rank});
    } catch (const Error& e) {
      error = e.what();
    }
    const auto reports = store.exchange("resume verification", error);
    std::string failures;
    for (int r = 0; r < world; ++r)
      if (!reports[r].empty()) failures += cat(failures.empty() ? "" : "; ", "rank ", r, ": ", reports[r]);
    if (failures.empty()) return ck;
    OPD_CHECK(explicit_path.empty(), InvalidData, "cannot resume from ", path, ": ", failures);
    if (rank == 0) log_warn("skipping checkpoint ", path, ": ", failures);
  }
  return std::nullopt;
}

bool is_sharded_checkpoint(const CheckpointData& ck) {
  return ck.state.is_object() && ck.state.contains("zero_shards");
}

void load_zero_checkpoint(ZeroOptimizer& zero, const CheckpointData& ck,
                          const std::vector<std::string>& names, const std::vector<Shape>& shapes) {
  const int rank = zero.comm().rank();
  ZeroOptimizer::ShardState st;
  std::string error;
  try {
    st = is_sharded_checkpoint(ck)
             ? read_resharded(ck, sharded_source(ck, names, shapes), zero.layout(), rank)
             : read_full_as_shard(ck, zero.layout(), rank, names);
  } catch (const Error& e) {
    error = e.what();
  }
  // Every rank learns whether all could read their part before the collective below.
  const auto reports = zero.comm().store().exchange("checkpoint load", error);
  std::string failures;
  for (size_t r = 0; r < reports.size(); ++r)
    if (!reports[r].empty()) failures += cat(failures.empty() ? "" : "; ", "rank ", r, ": ", reports[r]);
  OPD_CHECK(failures.empty(), InvalidData, "cannot resume from ", ck.dir, ": ", failures);
  zero.load_shard_state(st);
}

ZeroOptimizer::FullState read_full_state(const CheckpointData& ck,
                                         const std::vector<std::string>& names,
                                         const std::vector<Shape>& shapes) {
  // One rank, no padding: the single shard is every parameter back to back.
  const ShardLayout one = make_shard_layout(shapes, 1, int64_t{1} << 62, 1);
  const ZeroOptimizer::ShardState st =
      is_sharded_checkpoint(ck) ? read_resharded(ck, sharded_source(ck, names, shapes), one, 0)
                                : read_full_as_shard(ck, one, 0, names);
  ZeroOptimizer::FullState full;
  full.steps = st.steps;
  for (const auto& p : one.params) {
    full.master.push_back(st.master.slice_rows(p.offset, p.offset + p.numel).reshape(p.shape));
    full.exp_avg.push_back(st.exp_avg.slice_rows(p.offset, p.offset + p.numel).reshape(p.shape));
    full.exp_avg_sq.push_back(st.exp_avg_sq.slice_rows(p.offset, p.offset + p.numel).reshape(p.shape));
  }
  return full;
}

}  // namespace opd::dist
