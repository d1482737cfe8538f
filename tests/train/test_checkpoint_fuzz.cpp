// Deterministic mutation fuzzing of checkpoint loading (checkpoint.cpp): a saved checkpoint whose
// MANIFEST.json is mutated structurally (wrong types, odd file names, huge sizes) or bytewise,
// whose shard or state.json is truncated or flipped, or whose state.json is rewritten with a
// manifest that matches it (a consistent but hostile checkpoint). load_checkpoint must return or
// throw opd::Error, and load_latest_checkpoint must fall back to the older, intact checkpoint.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/fuzz_util.h"
#include "common/test_util.h"
#include "core/sha256.h"
#include "train/checkpoint.h"

namespace opd {
namespace {
namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

CheckpointData sample(int64_t step) {
  CheckpointData d;
  d.step = step;
  d.tensor_files["model"]["w"] = test::random_uniform({3, 5}, DType::F32, 10 + step);
  d.tensor_files["optimizer"]["m"] = test::random_uniform({4}, DType::F64, 20 + step);
  d.state["rng"] = {{"seed", 1234}, {"counter", step * 7}};
  d.files["config.json"] = "{\"a\": 1}";
  return d;
}

TEST(CheckpointFuzz, RandomMutations) {
  const fs::path root = fs::temp_directory_path() / ("opd_ckpt_fuzz_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const std::string good = save_checkpoint(root.string(), sample(1), 0);
  const std::string victim = save_checkpoint(root.string(), sample(2), 0);
  const fs::path pristine = root / "pristine";
  fs::copy(victim, pristine, fs::copy_options::recursive);
  const std::vector<std::string> dict = {"{", "}", "\"", ":", ",", "null", "-1", "1e999", "\"..\"", "\"\"", "\"/\""};
  const int iters = test::fuzz_iters(200);
  int loaded = 0;
  for (int c = 0; c < iters; ++c) {
    test::FuzzRng rng(0xc4e00000u + static_cast<uint64_t>(c));
    std::string log = "case " + std::to_string(c) + ": ";
    fs::remove_all(victim);
    fs::copy(pristine, victim, fs::copy_options::recursive);
    const fs::path manifest = fs::path(victim) / "MANIFEST.json";
    switch (rng.below(4)) {
      case 0: {  // manifest structure
        nlohmann::json j = nlohmann::json::parse(slurp(manifest));
        for (size_t k = 0, n = 1 + rng.below(2); k < n; ++k) test::mutate_json(j, rng, &log);
        spit(manifest, test::dump_raw(j));
        break;
      }
      case 1: {  // manifest bytes
        std::string m = slurp(manifest);
        test::mutate_bytes(m, rng, dict, &log);
        spit(manifest, m);
        break;
      }
      case 2: {  // a data file truncated or flipped
        std::vector<fs::path> files;
        for (const auto& e : fs::directory_iterator(victim))
          if (e.path().filename() != "MANIFEST.json") files.push_back(e.path());
        std::sort(files.begin(), files.end());
        const fs::path f = files[rng.below(files.size())];
        std::string b = slurp(f);
        test::mutate_bytes(b, rng, dict, &log);
        spit(f, b);
        log += f.filename().string();
        break;
      }
      default: {  // state.json rewritten and re-hashed: only the content checks stand
        nlohmann::json st = nlohmann::json::parse(slurp(fs::path(victim) / "state.json"));
        test::mutate_json(st, rng, &log);
        const std::string bytes = test::dump_raw(st);
        spit(fs::path(victim) / "state.json", bytes);
        nlohmann::json m = nlohmann::json::parse(slurp(manifest));
        m["files"]["state.json"] = {{"bytes", bytes.size()}, {"sha256", sha256_hex(bytes)}};
        spit(manifest, m.dump());
        log += "state.json";
        break;
      }
    }
    if (test::accepts(log, [&] { load_checkpoint(victim); })) ++loaded;
    std::string path;
    std::optional<CheckpointData> latest;
    ASSERT_TRUE(test::accepts(log + " (latest)", [&] { latest = load_latest_checkpoint(root.string(), &path); }))
        << "load_latest_checkpoint must skip a corrupt checkpoint, not throw: " << log;
    ASSERT_TRUE(latest.has_value()) << log;
    ASSERT_TRUE(path == good || path == victim) << path;
  }
  fs::remove_all(root);
  std::cout << "[ fuzz     ] " << iters << " mutated checkpoints: " << loaded << " still loaded\n";
}

TEST(CheckpointFuzz, Regressions) {
  const fs::path root = fs::temp_directory_path() / ("opd_ckpt_fuzz_r_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const std::string good = save_checkpoint(root.string(), sample(1), 0);
  const std::string dir = save_checkpoint(root.string(), sample(2), 0);
  const fs::path manifest = fs::path(dir) / "MANIFEST.json";
  const std::string original = slurp(manifest);
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> edit;
    std::string want;
  };
  const std::vector<Case> cases = {
      // json::value("bytes", uint64) threw nlohmann::type_error, which load_latest_checkpoint
      // did not catch: one bad manifest stopped every resume.
      {"bytes as a string", [](nlohmann::json& m) { m["files"]["state.json"]["bytes"] = "12"; }, "non-negative integer \"bytes\""},
      {"negative bytes", [](nlohmann::json& m) { m["files"]["state.json"]["bytes"] = -1; }, "non-negative integer \"bytes\""},
      {"sha256 as a number", [](nlohmann::json& m) { m["files"]["state.json"]["sha256"] = 7; }, "\"sha256\" string"},
      {"format as a number", [](nlohmann::json& m) { m["format"] = 1; }, "not an opd checkpoint manifest"},
      // "" and "." named the folder: fs::file_size threw std::filesystem_error.
      {"empty file name", [](nlohmann::json& m) { m["files"][""] = {{"bytes", 0}, {"sha256", ""}}; }, "not a plain name"},
      {"dot file name", [](nlohmann::json& m) { m["files"]["."] = {{"bytes", 0}, {"sha256", ""}}; }, "not a plain name"},
      // A name past NAME_MAX made fs::exists throw (ENAMETOOLONG).
      {"long file name", [](nlohmann::json& m) { m["files"][std::string(5000, 'a')] = {{"bytes", 0}, {"sha256", ""}}; }, "not a plain name"},
      {"NUL in a file name", [](nlohmann::json& m) { m["files"][std::string("state.json\0x", 12)] = {{"bytes", 0}, {"sha256", ""}}; }, "not a plain name"},
  };
  for (const Case& c : cases) {
    nlohmann::json m = nlohmann::json::parse(original);
    c.edit(m);
    spit(manifest, m.dump());
    const std::string err = test::error_of([&] { load_checkpoint(dir); });
    EXPECT_NE(err.find(c.want), std::string::npos) << c.name << ": " << err;
    std::string path;
    std::optional<CheckpointData> latest;
    EXPECT_TRUE(test::accepts(c.name, [&] { latest = load_latest_checkpoint(root.string(), &path); })) << c.name;
    EXPECT_EQ(path, good) << c.name;
  }
  // A step past INT64_MAX in a consistent state.json wrapped to a negative step.
  {
    spit(manifest, original);
    const std::string bytes = "{\"step\": 18446744073709551615}";
    spit(fs::path(dir) / "state.json", bytes);
    nlohmann::json m = nlohmann::json::parse(original);
    m["files"]["state.json"] = {{"bytes", bytes.size()}, {"sha256", sha256_hex(bytes)}};
    spit(manifest, m.dump());
    const std::string err = test::error_of([&] { load_checkpoint(dir); });
    EXPECT_NE(err.find("step is not a non-negative integer"), std::string::npos) << err;
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace opd
