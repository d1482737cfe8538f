// Atomic checkpoint folders with a SHA-256 manifest (format and guarantees in checkpoint.h).
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/log.h"
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

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) OPD_FAIL(Io, "cannot read ", path, ": ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
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

void write_file_synced(const std::string& path, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) OPD_FAIL(Io, "cannot create ", path, ": ", std::strerror(errno));
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      OPD_FAIL(Io, "write to ", path, " failed: ", std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int e = errno;
    ::close(fd);
    OPD_FAIL(Io, "fsync of ", path, " failed: ", std::strerror(e));
  }
  ::close(fd);
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
  write_file_synced(tmp, bytes);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    OPD_FAIL(Io, "rename ", tmp, " -> ", path, " failed: ", std::strerror(e));
  }
  fsync_path(fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string());
}

std::string save_checkpoint(const std::string& root, const CheckpointData& data, int keep_last) {
  OPD_CHECK(data.step >= 0 && data.step <= 99999999, InvalidArgument, "checkpoint step ",
            data.step, " outside [0, 99999999]");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) OPD_FAIL(Io, "cannot create checkpoint root ", root, ": ", ec.message());
  const std::string name = step_name(data.step);
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = fs::path(root) / (name + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) OPD_FAIL(Io, "cannot create ", tmp_dir.string(), ": ", ec.message());
  try {
    nlohmann::json manifest;
    manifest["format"] = "opd-checkpoint-1";
    manifest["step"] = data.step;
    auto add = [&](const std::string& file) {
      const fs::path p = tmp_dir / file;
      manifest["files"][file] = {{"bytes", fs::file_size(p)}, {"sha256", file_sha256(p.string())}};
    };
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
    // An older checkpoint of the same step (a re-run) is replaced: move it aside first.
    if (fs::exists(final_dir)) {
      const fs::path old = fs::path(root) / (name + ".old-" + std::to_string(::getpid()));
      fs::rename(final_dir, old);
      fs::remove_all(old);
    }
    fs::rename(tmp_dir, final_dir);
    fsync_path(root);
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  write_file_atomic((fs::path(root) / "LATEST").string(), name + "\n");
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

CheckpointData load_checkpoint(const std::string& dir) {
  const std::string manifest_path = dir + "/MANIFEST.json";
  OPD_CHECK(fs::exists(manifest_path), InvalidData, "checkpoint ", dir,
            " has no MANIFEST.json (incomplete or not a checkpoint)");
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_all(manifest_path));
  } catch (const nlohmann::json::exception& e) {
    OPD_FAIL(InvalidData, manifest_path, ": not valid JSON: ", e.what());
  }
  OPD_CHECK(manifest.is_object() && manifest.value("format", "") == "opd-checkpoint-1" &&
                manifest.contains("files") && manifest["files"].is_object(),
            InvalidData, manifest_path, ": not an opd checkpoint manifest");
  CheckpointData out;
  for (const auto& [file, info] : manifest["files"].items()) {
    const std::string path = dir + "/" + file;
    OPD_CHECK(file.find('/') == std::string::npos && file.find("..") == std::string::npos,
              InvalidData, manifest_path, ": file name '", file, "' is not a plain name");
    OPD_CHECK(fs::exists(path), InvalidData, "checkpoint file ", path, " is missing");
    const auto want_bytes = info.value("bytes", static_cast<uint64_t>(0));
    const auto got_bytes = fs::file_size(path);
    OPD_CHECK(got_bytes == want_bytes, InvalidData, "checkpoint file ", path, " has ", got_bytes,
              " bytes, the manifest says ", want_bytes, " (truncated or modified)");
    const std::string got_sha = file_sha256(path);
    OPD_CHECK(got_sha == info.value("sha256", ""), InvalidData, "checkpoint file ", path,
              " does not match its SHA-256 in the manifest (corrupted)");
    if (file == "state.json") {
      try {
        out.state = nlohmann::json::parse(read_all(path));
      } catch (const nlohmann::json::exception& e) {
        OPD_FAIL(InvalidData, path, ": not valid JSON: ", e.what());
      }
    } else if (file.size() > 12 && file.substr(file.size() - 12) == ".safetensors") {
      // Copy out of the mapping: the caller may delete old checkpoints while holding tensors.
      SafetensorsFile st = SafetensorsFile::open(path);
      auto& group = out.tensor_files[file.substr(0, file.size() - 12)];
      for (const auto& n : st.names()) group[n] = st.get(n).clone();
    } else {
      out.files[file] = read_all(path);
    }
  }
  OPD_CHECK(out.state.is_object() && out.state.contains("step"), InvalidData, "checkpoint ", dir,
            ": state.json missing or without a step");
  out.step = out.state["step"].get<int64_t>();
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

std::optional<CheckpointData> load_latest_checkpoint(const std::string& root, std::string* path) {
  auto all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      CheckpointData d = load_checkpoint(*it);
      if (path) *path = *it;
      return d;
    } catch (const Error& e) {
      log_warn("skipping checkpoint ", *it, ": ", e.what());
    }
  }
  return std::nullopt;
}

}  // namespace opd
