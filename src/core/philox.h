// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011). Stateless: philox4x32(counter, key) is a pure function, so the CPU and
// every CUDA thread produce the same stream for the same (key, counter) with no shared state.
// Header-only and __host__ __device__ so both backends compile the very same code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define OPD_HD __host__ __device__ __forceinline__
#else
#define OPD_HD inline
#endif

namespace opd {

struct Philox4 {
  uint32_t v[4];
};

OPD_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// 10 rounds of Philox4x32 with the constants of the paper (and of cuRAND / Random123).
OPD_HD Philox4 philox4x32(Philox4 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, ctr.v[0], hi0, lo0);
    philox_mulhilo(kM1, ctr.v[2], hi1, lo1);
    Philox4 next;
    next.v[0] = hi1 ^ ctr.v[1] ^ key0;
    next.v[1] = lo1;
    next.v[2] = hi0 ^ ctr.v[3] ^ key1;
    next.v[3] = lo0;
    ctr = next;
    key0 += kW0;
    key1 += kW1;
  }
  return ctr;
}

// Element i of the stream (seed, stream_id): 4 words per counter, counter = (i/4, stream_id).
OPD_HD uint32_t philox_u32(uint64_t seed, uint64_t stream_id, uint64_t i) {
  Philox4 ctr{{static_cast<uint32_t>(i >> 2), static_cast<uint32_t>(i >> 34),
               static_cast<uint32_t>(stream_id), static_cast<uint32_t>(stream_id >> 32)}};
  Philox4 r = philox4x32(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return r.v[i & 3];
}

// Uniform float in [0, 1): the top 24 bits scaled by 2^-24 (exactly representable).
OPD_HD float philox_uniform(uint64_t seed, uint64_t stream_id, uint64_t i) {
  return static_cast<float>(philox_u32(seed, stream_id, i) >> 8) * (1.0f / 16777216.0f);
}

// Uniform double in [0, 1) from one Philox block: the top 53 bits of words 0..1 of
// philox4x32(ctr, seed) scaled by 2^-53 (exactly representable). The rollout sampler's draw
// (rollout/sampler.h); the CUDA sampler calls the same function so a row draws the same u.
OPD_HD double philox_uniform53(Philox4 ctr, uint64_t seed) {
  Philox4 r = philox4x32(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = ((static_cast<uint64_t>(r.v[0]) << 32) | r.v[1]) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

}  // namespace opd
