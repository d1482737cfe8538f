// Re-sharding ZeRO state between world sizes (sharded checkpoints, train/checkpoint.h): where each
// element of one rank's shard buffer under a new ShardLayout lives in the shard buffers of an old
// layout, as a list of contiguous copies, so a resuming rank reads only the byte ranges it needs
// (the old shard files are mmapped safetensors) and never the full flat vectors.
//
// Coordinates: a parameter element (i, j) sits at flat offset params[i].offset + j of a layout;
// the flat offset x in bucket b belongs to rank r = (x - buckets[b].offset) / buckets[b].shard_numel
// and to element buckets[b].shard_offset + (x - shard_begin(b, r)) of r's shard buffer (zero.h).
// Layouts of different world sizes place parameters at different flat offsets (buckets are padded
// to world x align), so the mapping goes through (i, j), never through flat offsets. Padding
// elements of the new shard are not covered by any copy: they stay zero.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/zero.h"

namespace opd::dist {

// A run of `count` elements of `rank`'s shard buffer [shard_offset, +count) that holds
// parameter `param`'s elements [param_offset, +count).
struct ParamSegment {
  size_t param = 0;
  int64_t param_offset = 0;
  int64_t shard_offset = 0;
  int64_t count = 0;
};
// Every piece of `rank`'s shard that holds parameter data, in shard order.
std::vector<ParamSegment> shard_param_segments(const ShardLayout& layout, int rank);

// Copy `count` elements from old rank src_rank's shard buffer at src_offset to the new shard
// buffer at dst_offset.
struct ReshardCopy {
  int src_rank = 0;
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t count = 0;
};
// The copies that build rank to_rank's shard of `to` from the shards of `from` (in destination
// order; adjacent runs merged). Throws InvalidArgument when the layouts' parameter shapes differ.
std::vector<ReshardCopy> plan_reshard(const ShardLayout& from, const ShardLayout& to, int to_rank);

// dst (f32, to.shard_numel elements, any device) := the copies applied to sources[src_rank]
// (host or mmapped f32 vectors of from.shard_numel elements). Elements no copy covers are
// zeroed. Bounds of every copy are checked against both buffers.
void apply_reshard(const std::vector<ReshardCopy>& copies, const std::vector<Tensor>& sources,
                   Tensor& dst);

// The layout as JSON for state.json (world_size, align, bucket_numel, shard_numel, total_numel,
// buckets [{offset, numel, shard_numel, shard_offset, first_param, end_param}], params
// [{name, shape, offset, numel, bucket}]): with it a reader rebuilds the full flat vectors.
nlohmann::json shard_layout_to_json(const ShardLayout& layout, const std::vector<std::string>& names);
// Parses and validates that JSON against the model's parameters (names and shapes, in order):
// every offset and size from the file is checked (buckets contiguous and split evenly into
// world_size shards, parameters inside their bucket, in order, not overlapping) before it is
// used to index anything. Throws InvalidData naming `source` and the field.
ShardLayout shard_layout_from_json(const nlohmann::json& j, const std::vector<std::string>& names,
                                   const std::vector<Shape>& shapes, const std::string& source);

}  // namespace opd::dist
