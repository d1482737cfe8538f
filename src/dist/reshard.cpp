// Re-sharding plans between ShardLayouts of different world sizes and the layout's JSON form
// (reshard.h): parameter coordinates (i, j) are the common ground between two layouts.
#include "dist/reshard.h"

#include <algorithm>
#include <limits>

namespace opd::dist {

std::vector<ParamSegment> shard_param_segments(const ShardLayout& L, int rank) {
  OPD_CHECK(rank >= 0 && rank < L.world_size, InvalidArgument, "reshard: rank ", rank,
            " outside [0, ", L.world_size, ")");
  std::vector<ParamSegment> out;
  for (size_t b = 0; b < L.buckets.size(); ++b) {
    const auto& bk = L.buckets[b];
    const int64_t begin = L.shard_begin(static_cast<int>(b), rank);
    const int64_t end = begin + bk.shard_numel;
    for (size_t i = bk.first_param; i < bk.end_param; ++i) {
      const auto& p = L.params[i];
      const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
      if (lo < hi) out.push_back({i, lo - p.offset, bk.shard_offset + (lo - begin), hi - lo});
    }
  }
  return out;
}

std::vector<ReshardCopy> plan_reshard(const ShardLayout& from, const ShardLayout& to, int to_rank) {
  OPD_CHECK(from.params.size() == to.params.size(), InvalidArgument, "reshard: ",
            from.params.size(), " parameters in the old layout, ", to.params.size(), " in the new");
  for (size_t i = 0; i < from.params.size(); ++i)
    OPD_CHECK(from.params[i].shape == to.params[i].shape, InvalidArgument, "reshard: parameter ",
              i, " is ", shape_str(from.params[i].shape), " in the old layout, ",
              shape_str(to.params[i].shape), " in the new");
  std::vector<ReshardCopy> out;
  auto emit = [&](int src, int64_t src_off, int64_t dst_off, int64_t n) {
    if (!out.empty()) {
      ReshardCopy& last = out.back();
      if (last.src_rank == src && last.src_offset + last.count == src_off &&
          last.dst_offset + last.count == dst_off) {
        last.count += n;
        return;
      }
    }
    out.push_back({src, src_off, dst_off, n});
  };
  for (const ParamSegment& seg : shard_param_segments(to, to_rank)) {
    const auto& p = from.params[seg.param];
    const auto& bk = from.buckets[p.bucket];
    int64_t x = p.offset + seg.param_offset;  // old flat offset
    int64_t dst = seg.shard_offset;
    int64_t left = seg.count;
    while (left > 0) {
      const int r = static_cast<int>((x - bk.offset) / bk.shard_numel);
      const int64_t shard_end = bk.offset + (r + 1) * bk.shard_numel;
      const int64_t n = std::min(left, shard_end - x);
      emit(r, bk.shard_offset + (x - from.shard_begin(p.bucket, r)), dst, n);
      x += n;
      dst += n;
      left -= n;
    }
  }
  return out;
}

void apply_reshard(const std::vector<ReshardCopy>& copies, const std::vector<Tensor>& sources,
                   Tensor& dst) {
  OPD_CHECK(dst.defined() && dst.dtype() == DType::F32 && dst.ndim() == 1, InvalidArgument,
            "reshard: the destination must be a 1-D f32 tensor, got ",
            dst.defined() ? dst.describe() : std::string("undefined"));
  dst.fill_zero();
  for (const ReshardCopy& c : copies) {
    OPD_CHECK(c.src_rank >= 0 && c.src_rank < static_cast<int>(sources.size()), InvalidArgument,
              "reshard: copy from rank ", c.src_rank, " of ", sources.size(), " shards");
    const Tensor& src = sources[c.src_rank];
    OPD_CHECK(src.defined() && src.dtype() == DType::F32 && src.ndim() == 1, InvalidArgument,
              "reshard: shard of rank ", c.src_rank, " must be a 1-D f32 tensor");
    OPD_CHECK(c.count >= 0 && c.src_offset >= 0 && c.dst_offset >= 0 &&
                  c.src_offset + c.count <= src.numel() && c.dst_offset + c.count <= dst.numel(),
              InvalidArgument, "reshard: copy of ", c.count, " elements from ", c.src_offset,
              " (rank ", c.src_rank, ", ", src.numel(), " elements) to ", c.dst_offset, " (",
              dst.numel(), " elements) is out of bounds");
    if (c.count == 0) continue;
    Tensor d = dst.slice_rows(c.dst_offset, c.dst_offset + c.count);
    d.copy_from(src.slice_rows(c.src_offset, c.src_offset + c.count));
  }
}

nlohmann::json shard_layout_to_json(const ShardLayout& L, const std::vector<std::string>& names) {
  OPD_CHECK(names.size() == L.params.size(), InvalidArgument, "shard layout: ", names.size(),
            " names for ", L.params.size(), " parameters");
  nlohmann::json j;
  j["world_size"] = L.world_size;
  j["align"] = L.align;
  j["bucket_numel"] = L.bucket_numel;
  j["shard_numel"] = L.shard_numel;
  j["total_numel"] = L.total_numel;
  j["buckets"] = nlohmann::json::array();
  for (const auto& b : L.buckets)
    j["buckets"].push_back({{"offset", b.offset}, {"numel", b.numel}, {"shard_numel", b.shard_numel},
                            {"shard_offset", b.shard_offset}, {"first_param", b.first_param},
                            {"end_param", b.end_param}});
  j["params"] = nlohmann::json::array();
  for (size_t i = 0; i < L.params.size(); ++i) {
    const auto& p = L.params[i];
    j["params"].push_back({{"name", names[i]}, {"shape", p.shape}, {"offset", p.offset},
                           {"numel", p.numel}, {"bucket", p.bucket}});
  }
  return j;
}

namespace {

// Sizes and offsets from a file are bounded well below int64 overflow (2^52 elements = 16 PiB
// of f32) so the sums and products below cannot wrap.
constexpr int64_t kMaxElements = int64_t{1} << 52;

int64_t get_int(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi,
                const std::string& where) {
  OPD_CHECK(j.is_object() && j.contains(key) && j[key].is_number_integer(), InvalidData, where,
            ": '", key, "' is missing or not an integer");
  const int64_t v = j[key].get<int64_t>();
  OPD_CHECK(v >= lo && v <= hi, InvalidData, where, ": '", key, "' = ", v, " outside [", lo, ", ",
            hi, "]");
  return v;
}

}  // namespace

ShardLayout shard_layout_from_json(const nlohmann::json& j, const std::vector<std::string>& names,
                                   const std::vector<Shape>& shapes, const std::string& source) {
  OPD_CHECK(names.size() == shapes.size(), InvalidArgument, "shard layout: ", names.size(),
            " names for ", shapes.size(), " shapes");
  const std::string where = source + " shard layout";
  OPD_CHECK(j.is_object(), InvalidData, where, ": not an object");
  ShardLayout L;
  L.world_size = static_cast<int>(get_int(j, "world_size", 1, 1 << 20, where));
  L.align = get_int(j, "align", 1, kMaxElements, where);
  L.bucket_numel = get_int(j, "bucket_numel", 1, kMaxElements, where);
  L.shard_numel = get_int(j, "shard_numel", 0, kMaxElements, where);
  L.total_numel = get_int(j, "total_numel", 0, kMaxElements, where);
  OPD_CHECK(j.contains("buckets") && j["buckets"].is_array() && j.contains("params") &&
                j["params"].is_array(),
            InvalidData, where, ": 'buckets' or 'params' is missing or not an array");
  const auto& jp = j["params"];
  OPD_CHECK(jp.size() == shapes.size(), InvalidData, where, ": ", jp.size(),
            " parameters, the model has ", shapes.size());
  const int64_t nparams = static_cast<int64_t>(shapes.size());
  int64_t flat = 0, shard = 0, param = 0;
  for (size_t b = 0; b < j["buckets"].size(); ++b) {
    const auto& jb = j["buckets"][b];
    const std::string bw = cat(where, " bucket ", b);
    ShardLayout::Bucket bk;
    bk.offset = get_int(jb, "offset", 0, kMaxElements, bw);
    bk.numel = get_int(jb, "numel", 0, kMaxElements, bw);
    bk.shard_numel = get_int(jb, "shard_numel", 0, kMaxElements, bw);
    bk.shard_offset = get_int(jb, "shard_offset", 0, kMaxElements, bw);
    bk.first_param = static_cast<size_t>(get_int(jb, "first_param", 0, nparams, bw));
    bk.end_param = static_cast<size_t>(get_int(jb, "end_param", 0, nparams, bw));
    OPD_CHECK(bk.offset == flat && bk.shard_offset == shard &&
                  static_cast<int64_t>(bk.first_param) == param && bk.end_param > bk.first_param,
              InvalidData, bw, ": not contiguous with the previous bucket (offset ", bk.offset,
              ", shard_offset ", bk.shard_offset, ", parameters [", bk.first_param, ", ",
              bk.end_param, "))");
    OPD_CHECK(bk.shard_numel > 0 && bk.numel == bk.shard_numel * L.world_size, InvalidData, bw,
              ": ", bk.numel, " elements are not ", L.world_size, " shards of ", bk.shard_numel);
    flat += bk.numel;
    shard += bk.shard_numel;
    param = static_cast<int64_t>(bk.end_param);
    OPD_CHECK(flat <= kMaxElements, InvalidData, bw, ": too large");
    L.buckets.push_back(bk);
  }
  OPD_CHECK(param == nparams && flat == L.total_numel && shard == L.shard_numel, InvalidData,
            where, ": buckets cover ", param, " parameters, ", flat, " flat and ", shard,
            " shard elements; expected ", nparams, ", ", L.total_numel, ", ", L.shard_numel);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& p = jp[i];
    const std::string pw = cat(where, " parameter ", i);
    OPD_CHECK(p.is_object() && p.contains("name") && p["name"].is_string() &&
                  p["name"].get<std::string>() == names[i],
              InvalidData, pw, ": name is not '", names[i], "' (a checkpoint of another model?)");
    Shape sh;
    try {
      sh = p.at("shape").get<Shape>();
    } catch (const nlohmann::json::exception&) {
      OPD_FAIL(InvalidData, pw, " (", names[i], "): 'shape' is missing or not a list of integers");
    }
    OPD_CHECK(sh == shapes[i], InvalidData, pw, " (", names[i], ") is ", shape_str(sh),
              ", the model needs ", shape_str(shapes[i]));
    ShardLayout::Param q;
    q.shape = sh;
    q.numel = get_int(p, "numel", 0, kMaxElements, pw);
    OPD_CHECK(q.numel == shape_numel(sh), InvalidData, pw, ": numel ", q.numel, " for shape ",
              shape_str(sh));
    q.offset = get_int(p, "offset", 0, kMaxElements, pw);
    q.bucket = static_cast<int>(get_int(p, "bucket", 0, static_cast<int64_t>(L.buckets.size()) - 1, pw));
    const auto& bk = L.buckets[q.bucket];
    OPD_CHECK(i >= bk.first_param && i < bk.end_param, InvalidData, pw, ": bucket ", q.bucket,
              " holds parameters [", bk.first_param, ", ", bk.end_param, ")");
    OPD_CHECK(q.offset >= bk.offset && q.offset + q.numel <= bk.offset + bk.numel, InvalidData,
              pw, ": elements [", q.offset, ", ", q.offset + q.numel, ") outside bucket ",
              q.bucket, " [", bk.offset, ", ", bk.offset + bk.numel, ")");
    if (i > bk.first_param) {
      const auto& prev = L.params[i - 1];
      OPD_CHECK(q.offset >= prev.offset + prev.numel, InvalidData, pw,
                ": overlaps the previous parameter");
    }
    L.params.push_back(q);
  }
  return L;
}

}  // namespace opd::dist
