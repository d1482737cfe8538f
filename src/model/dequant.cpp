// Block dequantization (see dequant.h for the formulas). All arithmetic is float32 in the order
// the format's definition states it (d*sc first, then times q, minus dmin*mn), so results are
// reproducible by a float32 reference (tools/make_dequant_fixtures.py). Scales d, dmin, m are
// IEEE half floats stored little-endian.
#include "model/dequant.h"

#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace opd {

namespace {

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return f16_to_float(bits);
}

// Q8_0, 34 bytes: d (f16) | qs[32] int8.  x_j = d * qs_j.
void q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// Q4_0, 18 bytes: d (f16) | qs[16]; element j < 16 is the low nibble of qs[j], element j + 16
// the high nibble.  x = d * (nibble - 8).
void q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// Q4_1, 20 bytes: d (f16) | m (f16) | qs[16], nibbles as Q4_0.  x = d * nibble + m.
void q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K super-block, packed in 12 bytes:
// bytes 0-3: low 6 bits = scale 0-3, top 2 bits = bits 4-5 of scale 4-7;
// bytes 4-7: low 6 bits = min 0-3,   top 2 bits = bits 4-5 of min 4-7;
// bytes 8-11: low nibble = bits 0-3 of scale 4-7, high nibble = bits 0-3 of min 4-7.
void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K, 144 bytes: d (f16) | dmin (f16) | scales[12] | qs[128]. Four groups of 64 elements;
// group g uses bytes qs[32g .. 32g+31]: low nibbles are sub-block 2g, high nibbles 2g+1.
// x = (d*sc) * q - (dmin*mn).
void q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 4; ++g) {
    int sc0, mn0, sc1, mn1;
    k_scale_min(scales, 2 * g, &sc0, &mn0);
    k_scale_min(scales, 2 * g + 1, &sc1, &mn1);
    const float d0 = d * static_cast<float>(sc0), m0 = dmin * static_cast<float>(mn0);
    const float d1 = d * static_cast<float>(sc1), m1 = dmin * static_cast<float>(mn1);
    const uint8_t* q = qs + 32 * g;
    for (int l = 0; l < 32; ++l) {
      y[64 * g + l] = d0 * static_cast<float>(q[l] & 0x0F) - m0;
      y[64 * g + 32 + l] = d1 * static_cast<float>(q[l] >> 4) - m1;
    }
  }
}

// Q5_K, 176 bytes: d | dmin | scales[12] | qh[32] | qs[128]. As Q4_K, plus a 5th bit (value 16):
// for sub-block s (0..7), element l (0..31) of it takes bit s of qh[l].
void q5_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 4; ++g) {
    int sc0, mn0, sc1, mn1;
    k_scale_min(scales, 2 * g, &sc0, &mn0);
    k_scale_min(scales, 2 * g + 1, &sc1, &mn1);
    const float d0 = d * static_cast<float>(sc0), m0 = dmin * static_cast<float>(mn0);
    const float d1 = d * static_cast<float>(sc1), m1 = dmin * static_cast<float>(mn1);
    const uint8_t* q = qs + 32 * g;
    for (int l = 0; l < 32; ++l) {
      const int lo = (q[l] & 0x0F) + (((qh[l] >> (2 * g)) & 1) << 4);
      const int hi = (q[l] >> 4) + (((qh[l] >> (2 * g + 1)) & 1) << 4);
      y[64 * g + l] = d0 * static_cast<float>(lo) - m0;
      y[64 * g + 32 + l] = d1 * static_cast<float>(hi) - m1;
    }
  }
}

// Q6_K, 210 bytes: ql[128] | qh[64] | scales[16] int8 | d (f16). Two halves of 128 elements;
// half h uses ql[64h..], qh[32h..], scales[8h..]. Within a half, for l in 0..31 the four
// 6-bit values at l, l+32, l+64, l+96 are
//   (ql[l] & 15), (ql[l+32] & 15), (ql[l] >> 4), (ql[l+32] >> 4)   (low 4 bits)
//   with bits 0-1, 2-3, 4-5, 6-7 of qh[l] as their bits 4-5; minus 32.
// Element e of the half (0..127) uses scale scales[e / 16].  x = (d*sc) * q.
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql_all = b;
  const uint8_t* qh_all = b + 128;
  const int8_t* sc_all = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = ql_all + 64 * h;
    const uint8_t* qh = qh_all + 32 * h;
    const int8_t* sc = sc_all + 8 * h;
    float* out = y + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const int q[4] = {
          ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32,
          ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32,
          ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32,
          ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32,
      };
      for (int k = 0; k < 4; ++k) {
        const int e = l + 32 * k;
        out[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q[k]);
      }
    }
  }
}

}  // namespace

bool dequant_supported(GgmlType type) {
  switch (type) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0:
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q4_K: case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

std::string dequant_supported_list() { return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"; }

void dequantize_blocks(GgmlType type, std::span<const uint8_t> src, std::span<float> out) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  OPD_CHECK(info != nullptr, InvalidArgument, "dequantize: unknown ggml type ",
            static_cast<uint32_t>(type));
  OPD_CHECK(dequant_supported(type), Unsupported, "dequantize: ggml type ", info->name,
            " is not supported (supported: ", dequant_supported_list(), ")");
  const size_t be = static_cast<size_t>(info->block_elems);
  const size_t bb = static_cast<size_t>(info->block_bytes);
  OPD_CHECK(out.size() % be == 0 && src.size() == out.size() / be * bb, InvalidArgument,
            "dequantize ", info->name, ": ", out.size(), " output elements need ",
            out.size() / be * bb, " bytes in whole ", be, "-element blocks, got ", src.size(),
            " bytes");
  const uint8_t* s = src.data();
  float* y = out.data();
  const size_t n = out.size();
  switch (type) {
    case GgmlType::F32:
      std::memcpy(y, s, n * 4);
      return;
    case GgmlType::F16:
      for (size_t i = 0; i < n; ++i) y[i] = half_at(s + 2 * i);
      return;
    case GgmlType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, s + 2 * i, 2);
        y[i] = bf16_to_float(bits);
      }
      return;
    default:
      break;
  }
  void (*block_fn)(const uint8_t*, float*) = nullptr;
  switch (type) {
    case GgmlType::Q8_0: block_fn = q8_0; break;
    case GgmlType::Q4_0: block_fn = q4_0; break;
    case GgmlType::Q4_1: block_fn = q4_1; break;
    case GgmlType::Q4_K: block_fn = q4_k; break;
    case GgmlType::Q5_K: block_fn = q5_k; break;
    case GgmlType::Q6_K: block_fn = q6_k; break;
    default: OPD_FAIL(Internal, "dequantize: no block function for ", info->name);
  }
  for (size_t blk = 0; blk < n / be; ++blk) block_fn(s + blk * bb, y + blk * be);
}

}  // namespace opd
