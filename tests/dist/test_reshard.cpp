// Re-sharding between ZeRO layouts (dist/reshard.h), without processes: shards of every rank of
// one layout are built from per-parameter data, re-sharded into another world size, and compared
// exactly with the shards built directly in the new layout (padding zero, every element covered
// once); the layout's JSON round trip and its validation of hostile values; the streaming
// safetensors writer of the model export (train/checkpoint.h) against save_safetensors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/test_util.h"
#include "dist/reshard.h"
#include "model/safetensors.h"
#include "train/checkpoint.h"

namespace opd::dist {
namespace {

const std::vector<Shape> kShapes = {{7, 5}, {13}, {3, 4, 2}, {1}, {100}, {2, 33}, {0}, {9}};

std::vector<std::string> names_of(const std::vector<Shape>& shapes) {
  std::vector<std::string> n;
  for (size_t i = 0; i < shapes.size(); ++i) n.push_back(cat("p", i));
  return n;
}

// Rank r's shard buffer of layout L holding `params` (padding zero).
Tensor build_shard(const ShardLayout& L, int rank, const std::vector<Tensor>& params) {
  Tensor flat = Tensor::zeros({L.total_numel}, DType::F32);
  for (size_t i = 0; i < L.params.size(); ++i)
    if (L.params[i].numel > 0)
      flat.slice_rows(L.params[i].offset, L.params[i].offset + L.params[i].numel)
          .copy_from(params[i].reshape({L.params[i].numel}));
  Tensor shard = Tensor::zeros({L.shard_numel}, DType::F32);
  for (size_t b = 0; b < L.buckets.size(); ++b) {
    const auto& bk = L.buckets[b];
    const int64_t begin = L.shard_begin(static_cast<int>(b), rank);
    shard.slice_rows(bk.shard_offset, bk.shard_offset + bk.shard_numel)
        .copy_from(flat.slice_rows(begin, begin + bk.shard_numel));
  }
  return shard;
}

void expect_bitwise(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  ASSERT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << what;
}

TEST(Reshard, EveryWorldSizeToEveryOther) {
  std::vector<Tensor> params;
  for (size_t i = 0; i < kShapes.size(); ++i)
    params.push_back(test::random_uniform(kShapes[i], DType::F32, 300 + i, 0.5, 1.5));  // no zeros
  for (int64_t bucket : {int64_t{1}, int64_t{40}, int64_t{1000}}) {
    for (int64_t align : {int64_t{1}, int64_t{4}, int64_t{64}}) {
      for (int from_w : {1, 2, 3, 4}) {
        const ShardLayout from = make_shard_layout(kShapes, from_w, bucket, align);
        std::vector<Tensor> old_shards;
        for (int r = 0; r < from_w; ++r) old_shards.push_back(build_shard(from, r, params));
        for (int to_w : {1, 2, 3, 5}) {
          // The new layout may use other bucket and alignment settings too.
          const ShardLayout to = make_shard_layout(kShapes, to_w, bucket == 40 ? 1000 : 40, 4);
          for (int r = 0; r < to_w; ++r) {
            SCOPED_TRACE(cat("bucket ", bucket, " align ", align, " ", from_w, " -> ", to_w, " rank ", r));
            const auto copies = plan_reshard(from, to, r);
            int64_t covered = 0;
            for (const auto& c : copies) {
              EXPECT_GT(c.count, 0);
              covered += c.count;
            }
            int64_t want = 0;
            for (const auto& s : shard_param_segments(to, r)) want += s.count;
            EXPECT_EQ(covered, want);
            Tensor got = Tensor::poisoned({to.shard_numel}, DType::F32);
            apply_reshard(copies, old_shards, got);
            expect_bitwise(got, build_shard(to, r, params), "resharded shard");
          }
        }
      }
    }
  }
}

TEST(Reshard, ParamSegmentsCoverEachElementOnce) {
  for (int world : {1, 2, 3, 7}) {
    const ShardLayout L = make_shard_layout(kShapes, world, 40, 4);
    std::vector<std::vector<int>> seen(kShapes.size());
    for (size_t i = 0; i < kShapes.size(); ++i) seen[i].assign(shape_numel(kShapes[i]), 0);
    for (int r = 0; r < world; ++r)
      for (const auto& s : shard_param_segments(L, r)) {
        ASSERT_LE(s.shard_offset + s.count, L.shard_numel);
        for (int64_t k = 0; k < s.count; ++k) ++seen[s.param][s.param_offset + k];
      }
    for (size_t i = 0; i < kShapes.size(); ++i)
      for (int v : seen[i]) EXPECT_EQ(v, 1) << "world " << world << " param " << i;
  }
  EXPECT_THROW(shard_param_segments(make_shard_layout(kShapes, 2), 2), Error);
}

TEST(Reshard, RefusesMismatchedModelsAndBadCopies) {
  const ShardLayout a = make_shard_layout(kShapes, 2, 40, 4);
  auto other = kShapes;
  other[2] = {3, 4, 3};
  EXPECT_THROW(plan_reshard(a, make_shard_layout(other, 3, 40, 4), 0), Error);
  EXPECT_THROW(plan_reshard(a, make_shard_layout({{7, 5}}, 3, 40, 4), 0), Error);
  Tensor dst = Tensor::zeros({10}, DType::F32);
  const std::vector<Tensor> src = {Tensor::zeros({10}, DType::F32)};
  EXPECT_THROW(apply_reshard({{1, 0, 0, 1}}, src, dst), Error);   // no such rank
  EXPECT_THROW(apply_reshard({{0, 5, 0, 6}}, src, dst), Error);   // past the source
  EXPECT_THROW(apply_reshard({{0, 0, 5, 6}}, src, dst), Error);   // past the destination
  EXPECT_THROW(apply_reshard({{0, -1, 0, 1}}, src, dst), Error);  // negative offset
  Tensor wrong = Tensor::zeros({10}, DType::F64);
  EXPECT_THROW(apply_reshard({}, src, wrong), Error);
}

TEST(ShardLayoutJson, RoundTripsAndRejectsHostileValues) {
  const auto names = names_of(kShapes);
  for (int world : {1, 3}) {
    const ShardLayout L = make_shard_layout(kShapes, world, 40, 4);
    const nlohmann::json j = shard_layout_to_json(L, names);
    // Through text, as in state.json.
    const ShardLayout back = shard_layout_from_json(nlohmann::json::parse(j.dump()), names, kShapes, "t");
    EXPECT_EQ(back.world_size, L.world_size);
    EXPECT_EQ(back.align, L.align);
    EXPECT_EQ(back.bucket_numel, 40);
    EXPECT_EQ(back.total_numel, L.total_numel);
    EXPECT_EQ(back.shard_numel, L.shard_numel);
    ASSERT_EQ(back.buckets.size(), L.buckets.size());
    for (size_t b = 0; b < L.buckets.size(); ++b) {
      EXPECT_EQ(back.buckets[b].offset, L.buckets[b].offset);
      EXPECT_EQ(back.buckets[b].shard_offset, L.buckets[b].shard_offset);
      EXPECT_EQ(back.buckets[b].first_param, L.buckets[b].first_param);
      EXPECT_EQ(back.buckets[b].end_param, L.buckets[b].end_param);
    }
    for (size_t i = 0; i < L.params.size(); ++i) {
      EXPECT_EQ(back.params[i].offset, L.params[i].offset);
      EXPECT_EQ(back.params[i].bucket, L.params[i].bucket);
    }
  }
  const ShardLayout L = make_shard_layout(kShapes, 3, 40, 4);
  const nlohmann::json good = shard_layout_to_json(L, names);
  auto bad = [&](const char* what, auto mutate) {
    nlohmann::json j = good;
    mutate(j);
    try {
      shard_layout_from_json(j, names, kShapes, "state.json");
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << what;
      EXPECT_NE(std::string(e.what()).find("state.json"), std::string::npos) << what << ": " << e.what();
    }
  };
  bad("world 0", [](auto& j) { j["world_size"] = 0; });
  bad("world as string", [](auto& j) { j["world_size"] = "3"; });
  bad("shard size", [](auto& j) { j["buckets"][0]["shard_numel"] = j["buckets"][0]["shard_numel"].template get<int64_t>() + 1; });
  bad("bucket gap", [](auto& j) { j["buckets"][1]["offset"] = j["buckets"][1]["offset"].template get<int64_t>() + 4; });
  bad("param outside bucket", [](auto& j) { j["params"][0]["offset"] = int64_t{1} << 40; });
  bad("negative offset", [](auto& j) { j["params"][1]["offset"] = -4; });
  bad("overlap", [](auto& j) { j["params"][1]["offset"] = 0; j["params"][1]["bucket"] = 0; });
  bad("wrong bucket", [](auto& j) { j["params"][0]["bucket"] = 99; });
  bad("name", [](auto& j) { j["params"][2]["name"] = "other"; });
  bad("shape", [](auto& j) { j["params"][2]["shape"] = {3, 4, 3}; });
  bad("numel", [](auto& j) { j["params"][2]["numel"] = 23; });
  bad("fewer params", [](auto& j) { j["params"].erase(j["params"].size() - 1); });
  bad("buckets missing", [](auto& j) { j.erase("buckets"); });
  bad("total", [](auto& j) { j["total_numel"] = 1; });
  bad("huge", [](auto& j) { j["bucket_numel"] = int64_t{1} << 62; });
}

TEST(SafetensorsStreamWriter, SameBytesAsSaveSafetensorsInAnyWriteOrder) {
  const std::string dir = cat(::testing::TempDir(), "/opd_stream_writer_", ::getpid());
  std::filesystem::create_directories(dir);
  std::map<std::string, Tensor> tensors = {
      {"b.weight", test::random_uniform({3, 5}, DType::F32, 1)},
      {"a.weight", test::random_uniform({7}, DType::F32, 2)},
      {"c.half", test::random_uniform({4, 2}, DType::F32, 3).to_dtype(DType::BF16)},
      {"empty", Tensor::zeros({0, 3}, DType::F32)}};
  save_safetensors(dir + "/ref.safetensors", tensors, {{"format", "pt"}});
  std::vector<SafetensorsStreamWriter::Entry> entries;
  for (const auto& [n, t] : tensors) entries.push_back({n, t.dtype(), t.shape()});
  {
    SafetensorsStreamWriter w(dir + "/stream.safetensors", entries, {{"format", "pt"}});
    for (const char* n : {"c.half", "b.weight", "a.weight"}) w.write(n, tensors.at(n));
    EXPECT_THROW(w.write("b.weight", tensors.at("b.weight")), Error);   // twice
    EXPECT_THROW(w.write("nope", tensors.at("a.weight")), Error);       // undeclared
    EXPECT_THROW(w.write("a.weight", tensors.at("b.weight")), Error);   // another shape
    w.finish();
  }
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  EXPECT_EQ(read(dir + "/stream.safetensors"), read(dir + "/ref.safetensors"));
  {
    SafetensorsStreamWriter w(dir + "/unfinished.safetensors", entries);
    w.write("a.weight", tensors.at("a.weight"));
    EXPECT_THROW(w.finish(), Error);  // b.weight and c.half never written
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/unfinished.safetensors"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace opd::dist
