// Atomic checkpoint folders with a SHA-256 manifest (format and guarantees in checkpoint.h).
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>  // renameat2, RENAME_EXCHANGE
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/file_write.h"
#include "core/log.h"
#include "core/text_io.h"
#include "core/sha256.h"
#include "model/safetensors.h"

namespace opd {
namespace fs = std::filesystem;

namespace {

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

// A checkpoint's JSON files (MANIFEST.json, state.json): bounded reads, bounded nesting.
std::string read_all(const std::string& path) {
  std::string text = read_text_file(path, int64_t{256} << 20);
  check_json_depth(text, path);
  return text;
}

std::string file_sha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) OPD_FAIL(Io, "cannot read ", path, ": ", std::strerror(errno));
  Sha256 h;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h.update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  return h.hex_digest();
}

std::optional<int64_t> parse_step(const std::string& name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

}  // namespace

void write_file_synced(const std::string& path, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) OPD_FAIL(Io, "cannot create ", path, ": ", std::strerror(errno));
  try {
    write_fully(fd, bytes.data(), bytes.size(), path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::fsync(fd) != 0) {
    int e = errno;
    ::close(fd);
    OPD_FAIL(Io, "fsync of ", path, " failed: ", std::strerror(e));
  }
  ::close(fd);
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) OPD_FAIL(Io, "cannot open ", path, " to fsync: ", std::strerror(errno));
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0 && e != EINVAL) OPD_FAIL(Io, "fsync of ", path, " failed: ", std::strerror(e));
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  try {
    write_file_synced(tmp, bytes);
  } catch (...) {
    ::unlink(tmp.c_str());  // a full disk must not leave X.tmp-PID files beside X
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    OPD_FAIL(Io, "rename ", tmp, " -> ", path, " failed: ", std::strerror(e));
  }
  fsync_path(fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string());
}

void remove_stale_temp_files(const std::string& path) noexcept {
  const fs::path p(path);
  const std::string prefix = p.filename().string() + ".tmp-";
  const std::string mine = prefix + std::to_string(::getpid());
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(p.parent_path().empty() ? fs::path(".") : p.parent_path(), ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) != 0 || n == mine || n.size() == prefix.size() ||
        n.find_first_not_of("0123456789", prefix.size()) != std::string::npos)
      continue;
    std::error_code rm;
    if (e.is_regular_file(rm) && fs::remove(e.path(), rm))
      log_warn("removed ", e.path().string(), ", left by an interrupted write of ", path);
  }
}

std::string begin_checkpoint(const std::string& root, int64_t step) {
  OPD_CHECK(step >= 0 && step <= 99999999, InvalidArgument, "checkpoint step ", step,
            " outside [0, 99999999]");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) OPD_FAIL(Io, "cannot create checkpoint root ", root, ": ", ec.message());
  const fs::path tmp_dir = fs::path(root) / (step_name(step) + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) OPD_FAIL(Io, "cannot create ", tmp_dir.string(), ": ", ec.message());
  return tmp_dir.string();
}

void abandon_checkpoint(const std::string& tmp_dir) noexcept {
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  if (ec) log_warn("could not remove abandoned checkpoint folder ", tmp_dir, ": ", ec.message());
}

CheckpointFile describe_checkpoint_file(const std::string& dir, const std::string& name) {
  const fs::path p = fs::path(dir) / name;
  std::error_code ec;
  const auto bytes = fs::file_size(p, ec);
  if (ec) OPD_FAIL(Io, "cannot stat ", p.string(), ": ", ec.message());
  return {name, static_cast<uint64_t>(bytes), file_sha256(p.string())};
}

std::string commit_checkpoint(const std::string& root, const std::string& tmp_dir_s,
                              const CheckpointData& data, const std::vector<CheckpointFile>& written,
                              int keep_last) {
  OPD_CHECK(data.step >= 0 && data.step <= 99999999, InvalidArgument, "checkpoint step ",
            data.step, " outside [0, 99999999]");
  const std::string name = step_name(data.step);
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = tmp_dir_s;
  std::error_code ec;
  try {
    nlohmann::json manifest;
    manifest["format"] = "opd-checkpoint-1";
    manifest["step"] = data.step;
    auto record = [&](const CheckpointFile& f) {
      OPD_CHECK(!f.name.empty() && f.name.find('/') == std::string::npos &&
                    f.name != "MANIFEST.json" && !manifest["files"].contains(f.name),
                InvalidArgument, "checkpoint file name '", f.name, "' is not allowed or repeated");
      manifest["files"][f.name] = {{"bytes", f.bytes}, {"sha256", f.sha256}};
    };
    auto add = [&](const std::string& file) { record(describe_checkpoint_file(tmp_dir.string(), file)); };
    for (const auto& f : written) {
      // Written by another process (another rank): it must be here, whole, on this file system.
      const fs::path p = tmp_dir / f.name;
      const auto got = fs::file_size(p, ec);
      OPD_CHECK(!ec, Io, "checkpoint file ", p.string(), " reported by another writer is not "
                "visible here (", ec.message(), "); with several nodes --out must be on a "
                "file system shared by every node");
      OPD_CHECK(got == f.bytes, Io, "checkpoint file ", p.string(), " has ", got,
                " bytes here, its writer reported ", f.bytes);
      record(f);
    }
    for (const auto& [stem, tensors] : data.tensor_files) {
      const std::string file = stem + ".safetensors";
      save_safetensors((tmp_dir / file).string(), tensors, {{"format", "pt"}});
      add(file);
    }
    for (const auto& [file, bytes] : data.files) {
      OPD_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "state.json" &&
                    file != "MANIFEST.json" && !file.ends_with(".safetensors"),
                InvalidArgument, "checkpoint extra file name '", file, "' is not allowed");
      write_file_synced((tmp_dir / file).string(), bytes);
      add(file);
    }
    nlohmann::json state = data.state;
    state["step"] = data.step;
    write_file_synced((tmp_dir / "state.json").string(), state.dump(2));
    add("state.json");
    write_file_synced((tmp_dir / "MANIFEST.json").string(), manifest.dump(2));
    fsync_path(tmp_dir.string());
    // An older checkpoint of the same step (a re-run) is replaced so that step-N always names a
    // complete checkpoint: the two folders swap names in one atomic renameat2(RENAME_EXCHANGE),
    // then the old one (now under the temp name) is deleted. Where the file system cannot
    // exchange, the old folder moves aside first and is deleted only after the new one is in
    // place (a crash between the two renames leaves both folders whole; .old- folders are
    // cleaned up by the next save). It used to be deleted before the new one was renamed in.
    if (fs::exists(final_dir)) {
      if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
        fsync_path(root);
        fs::remove_all(tmp_dir, ec);
        if (ec) log_warn("could not delete the replaced checkpoint ", tmp_dir.string(), ": ", ec.message());
      } else {
        const fs::path old = fs::path(root) / (name + ".old-" + std::to_string(::getpid()));
        fs::rename(final_dir, old);
        fs::rename(tmp_dir, final_dir);
        fsync_path(root);
        fs::remove_all(old, ec);
        if (ec) log_warn("could not delete the replaced checkpoint ", old.string(), ": ", ec.message());
      }
    } else {
      fs::rename(tmp_dir, final_dir);
      fsync_path(root);
    }
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  // The checkpoint is complete once renamed (resume lists the folders, it never reads LATEST):
  // a LATEST that cannot be updated (a disk full to the last block) is worth a warning only.
  try {
    write_file_atomic((fs::path(root) / "LATEST").string(), name + "\n");
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Io) throw;
    log_warn("checkpoint ", final_dir.string(), " is complete but ", root, "/LATEST could not be ",
             "updated: ", e.what());
  }
  // Temp folders of saves that died (a crash, a killed rank) are never checkpoints: once a newer
  // one is complete they only hold disk space. The same for the temp file of an interrupted
  // LATEST update.
  remove_stale_temp_files((fs::path(root) / "LATEST").string());
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    auto tmp_at = n.find(".tmp-");
    if (tmp_at == std::string::npos) tmp_at = n.find(".old-");  // a replaced one (see above)
    if (!e.is_directory() || tmp_at == std::string::npos || !parse_step(n.substr(0, tmp_at))) continue;
    log_warn("removing the temp folder of an unfinished or replaced checkpoint: ", e.path().string());
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
  if (keep_last > 0) {
    auto all = list_checkpoints(root);
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) {
      if (fs::path(all[i]).filename() == name) continue;
      fs::remove_all(all[i], ec);
      if (ec) log_warn("could not delete old checkpoint ", all[i], ": ", ec.message());
    }
  }
  return final_dir.string();
}

std::string save_checkpoint(const std::string& root, const CheckpointData& data, int keep_last) {
  OPD_CHECK(data.step >= 0 && data.step <= 99999999, InvalidArgument, "checkpoint step ",
            data.step, " outside [0, 99999999]");
  const std::string tmp = begin_checkpoint(root, data.step);
  return commit_checkpoint(root, tmp, data, {}, keep_last);
}

CheckpointData load_checkpoint(const std::string& dir, const CheckpointLoadOptions& options) {
  const std::string manifest_path = dir + "/MANIFEST.json";
  OPD_CHECK(fs::is_directory(dir), InvalidArgument, "checkpoint ", dir,
            " does not exist (or is not a directory)");
  OPD_CHECK(fs::exists(manifest_path), InvalidData, "checkpoint ", dir,
            " has no MANIFEST.json (incomplete or not a checkpoint)");
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_all(manifest_path));
  } catch (const nlohmann::json::exception& e) {
    OPD_FAIL(InvalidData, manifest_path, ": not valid JSON: ", e.what());
  }
  // Every field is type-checked before use: json::value() and get<>() throw nlohmann's own
  // exceptions on a wrong type, which load_latest_checkpoint (catching opd::Error) would not
  // survive, so one corrupt manifest would stop a resume instead of being skipped.
  OPD_CHECK(manifest.is_object() && manifest.contains("format") && manifest["format"].is_string() &&
                manifest["format"].get<std::string>() == "opd-checkpoint-1" &&
                manifest.contains("files") && manifest["files"].is_object(),
            InvalidData, manifest_path, ": not an opd checkpoint manifest");
  CheckpointData out;
  OPD_CHECK(options.verify_stride >= 1 && options.verify_offset >= 0 &&
                options.verify_offset < options.verify_stride,
            InvalidArgument, "checkpoint verification share ", options.verify_offset, " of ",
            options.verify_stride);
  size_t index = 0;
  for (const auto& [file, info] : manifest["files"].items()) {
    const bool my_share = index++ % static_cast<size_t>(options.verify_stride) ==
                          static_cast<size_t>(options.verify_offset);
    const std::string path = dir + "/" + file;
    // "" and "." would name the folder itself, a NUL would cut the path short, and a name past
    // NAME_MAX makes the file system calls throw.
    OPD_CHECK(!file.empty() && file != "." && file.size() <= 255 &&
                  file.find('/') == std::string::npos && file.find("..") == std::string::npos &&
                  file.find('\0') == std::string::npos,
              InvalidData, manifest_path, ": file name ",
              nlohmann::json(file.substr(0, 300)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
              " is not a plain name");  // JSON-escaped: a NUL would cut the message short
    OPD_CHECK(info.is_object(), InvalidData, manifest_path, ": entry '", file, "' is not an object");
    OPD_CHECK(info.contains("bytes") && info["bytes"].is_number_unsigned(), InvalidData, manifest_path,
              ": entry '", file, "' has no non-negative integer \"bytes\"");
    OPD_CHECK(info.contains("sha256") && info["sha256"].is_string(), InvalidData, manifest_path,
              ": entry '", file, "' has no \"sha256\" string");
    std::error_code ec;
    OPD_CHECK(fs::is_regular_file(path, ec), InvalidData, "checkpoint file ", path,
              " is missing or not a regular file");
    const uint64_t want_bytes = info["bytes"].get<uint64_t>();
    const uint64_t got_bytes = fs::file_size(path, ec);
    OPD_CHECK(!ec, Io, "cannot stat checkpoint file ", path, ": ", ec.message());
    OPD_CHECK(got_bytes == want_bytes, InvalidData, "checkpoint file ", path, " has ", got_bytes,
              " bytes, the manifest says ", want_bytes, " (truncated or modified)");
    const bool is_tensors = file.size() > 12 && file.substr(file.size() - 12) == ".safetensors";
    // state.json is always checked: it is small and says how to read everything else.
    if ((options.verify && my_share) || file == "state.json") {
      const std::string got_sha = file_sha256(path);
      OPD_CHECK(got_sha == info["sha256"].get<std::string>(), InvalidData, "checkpoint file ", path,
                " does not match its SHA-256 in the manifest (corrupted)");
    }
    if (is_tensors && !options.load_tensors) continue;
    if (file == "state.json") {
      try {
        out.state = nlohmann::json::parse(read_all(path));
      } catch (const nlohmann::json::exception& e) {
        OPD_FAIL(InvalidData, path, ": not valid JSON: ", e.what());
      }
    } else if (is_tensors) {
      // Copy out of the mapping: the caller may delete old checkpoints while holding tensors.
      SafetensorsFile st = SafetensorsFile::open(path);
      auto& group = out.tensor_files[file.substr(0, file.size() - 12)];
      for (const auto& n : st.names()) group[n] = st.get(n).clone();
    } else {
      out.files[file] = read_text_file(path);
    }
  }
  OPD_CHECK(manifest["files"].contains("state.json"), InvalidData, manifest_path,
            ": lists no state.json (every checkpoint has one)");
  OPD_CHECK(out.state.is_object() && out.state.contains("step"), InvalidData, "checkpoint ", dir,
            ": state.json has no step");
  OPD_CHECK(out.state["step"].is_number_integer() &&
                (out.state["step"].is_number_unsigned() ? out.state["step"].get<uint64_t>() <= INT64_MAX
                                                        : out.state["step"].get<int64_t>() >= 0),
            InvalidData, "checkpoint ", dir, ": state.json's step is not a non-negative integer");
  out.step = out.state["step"].get<int64_t>();
  // The step is written three times (state.json, MANIFEST.json, the directory's name): they
  // must agree, or the checkpoint was edited or moved and its step cannot be trusted.
  if (manifest.contains("step"))
    OPD_CHECK(manifest["step"].is_number_integer() && manifest["step"].get<int64_t>() == out.step,
              InvalidData, "checkpoint ", dir, ": state.json says step ", out.step,
              ", MANIFEST.json says ", manifest["step"].dump());
  const std::string name = fs::path(dir).lexically_normal().filename().string().empty()
                               ? fs::path(dir).lexically_normal().parent_path().filename().string()
                               : fs::path(dir).lexically_normal().filename().string();
  if (name.size() == 13 && name.rfind("step-", 0) == 0 &&
      name.find_first_not_of("0123456789", 5) == std::string::npos)
    OPD_CHECK(std::stoll(name.substr(5)) == out.step, InvalidData, "checkpoint ", dir,
              ": state.json says step ", out.step, " but the directory is named ", name);
  out.dir = dir;
  return out;
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory()) continue;
    auto step = parse_step(e.path().filename().string());
    if (step) found.push_back({*step, e.path().string()});
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

std::optional<CheckpointData> load_latest_checkpoint(const std::string& root, std::string* path,
                                                     const CheckpointLoadOptions& options) {
  auto all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      CheckpointData d = load_checkpoint(*it, options);
      if (path) *path = *it;
      return d;
    } catch (const Error& e) {
      log_warn("skipping checkpoint ", *it, ": ", e.what());
    }
  }
  return std::nullopt;
}

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::string& path, std::vector<Entry> entries,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(path) {
  // save_safetensors' order: descending element size, then name.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (dtype_size(a.dtype) != dtype_size(b.dtype)) return dtype_size(a.dtype) > dtype_size(b.dtype);
    return a.name < b.name;
  });
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& e : entries) {
    OPD_CHECK(e.name != "__metadata__" && !slots_.count(e.name), InvalidArgument,
              "safetensors stream ", path, ": tensor name '", e.name, "' reserved or repeated");
    for (int64_t d : e.shape)
      OPD_CHECK(d >= 0, InvalidArgument, "safetensors stream ", path, ": ", e.name, " has shape ",
                shape_str(e.shape));
    const uint64_t n = static_cast<uint64_t>(shape_numel(e.shape)) * dtype_size(e.dtype);
    header[e.name] = {{"dtype", safetensors_dtype_name(e.dtype)}, {"shape", e.shape},
                      {"data_offsets", {offset, offset + n}}};
    slots_[e.name] = Slot{e.dtype, e.shape, offset, n == 0};
    offset += n;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();
  for (auto& [name, slot] : slots_) slot.offset += 8 + header_len;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) OPD_FAIL(Io, "cannot create ", path, ": ", std::strerror(errno));
  pwrite_fully(fd_, &header_len, 8, 0, path_);
  pwrite_fully(fd_, text.data(), text.size(), 8, path_);
  if (::ftruncate(fd_, static_cast<off_t>(8 + header_len + offset)) != 0)
    OPD_FAIL(Io, "cannot size ", path, ": ", std::strerror(errno));
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(path_.c_str());
}

void SafetensorsStreamWriter::write(const std::string& name, const Tensor& t) {
  auto it = slots_.find(name);
  OPD_CHECK(it != slots_.end(), InvalidArgument, "safetensors stream ", path_, ": no tensor '",
            name, "' was declared");
  Slot& s = it->second;
  OPD_CHECK(!s.written || t.numel() == 0, InvalidArgument, "safetensors stream ", path_, ": '",
            name, "' written twice");
  OPD_CHECK(t.defined() && t.dtype() == s.dtype && t.shape() == s.shape && t.device() == Device::CPU,
            InvalidArgument, "safetensors stream ", path_, ": '", name, "' is ",
            t.defined() ? t.describe() : std::string("undefined"), ", declared ",
            dtype_name(s.dtype), shape_str(s.shape), " cpu");
  OPD_CHECK(fd_ >= 0 && !finished_, InvalidArgument, "safetensors stream ", path_, " is closed");
  pwrite_fully(fd_, t.raw(), t.nbytes(), s.offset, path_);
  s.written = true;
}

void SafetensorsStreamWriter::finish() {
  for (const auto& [name, s] : slots_)
    OPD_CHECK(s.written, InvalidArgument, "safetensors stream ", path_, ": tensor '", name,
              "' was never written");
  if (::fsync(fd_) != 0) OPD_FAIL(Io, "fsync of ", path_, " failed: ", std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) OPD_FAIL(Io, "close of ", path_, " failed: ", std::strerror(errno));
  finished_ = true;
}

}  // namespace opd
