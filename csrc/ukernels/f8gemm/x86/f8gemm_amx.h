// The logic of f8gemm_bf16r_f8ci32x2_16x32_amx, the W8A16 FP8 GEMM on AMX-BF16 tiles, over
// amx_gemm.h's Tiles class: the kernel file instantiates it with the hardware tiles (amx_hw.h),
// the tests with the tile model (tests_cpp/amx/amx_tile_model.h), so both run exactly this code.
//
// Packing: the AVX-512 BF16 kernel's codes (`f8ci32x2`, f8gemm_bf16_x86.h) with kr = 32 (a group
// padded to whole 32-k tile steps) and A (`bf16r`) padded to kp = round_up(k, 32) and to whole
// 16-row tiles (zero rows), so every A tile is a full 16 x 64-byte tile.
//
// 4-bit codes (W4A16) expand through f8_bf16::Codes<4> into the same panels.
// Per block of 32 columns, group by group (q4gemm_amx.h's walk, with bf16 instead of int8):
//   1. expand the group's codes (one 64-byte step per k pair) into a panel of two halves of
//      16 columns with f8_bf16::decode16x2: each half is `bf16ci16x2`, so every 32 k is one 1 KB
//      B tile (16 k pairs x 16 columns x 2 bf16). The panel (64 gp bytes: 8 KB for 128-k groups)
//      stays in L1 while the row tiles pass; the next group is expanded into a second panel
//      before this one's tiles run (a tile load of what vector stores have just written waits
//      for them), and each code line prefetches the next block's (to L2).
//   2. per pair of 16-row tiles: the accumulators zeroed, then per 32 k an A tile, the two B
//      tiles and tdpbf16ps, so each accumulator holds the group's sum S' (of the values times
//      2^-8); stored, and with AVX-512 acc = acc + (S' * 256) * s into the rows' fp32
//      accumulators (f8gemm.h's order, no FMA), in the call's scratch. A call of at most 16 rows
//      (decode, most experts at prefill) configures only its rows and alternates two accumulator
//      sets, so one group's dot products overlap the other's stores and epilogue.
// After the last group: + bias and masked stores (nothing past n); the padding rows' results
// are dropped. Every call runs on the tiles, decode's too: the hardware groups a tile's bf16
// roundings its own way, so handing few-row calls to the AVX-512 BF16 kernel would make a row's
// bits depend on the rows that share its call (the tester's calls at offsets). A one-row call
// decodes each weight once, as the AVX-512 kernel's direct path, and its tile work is one row
// (configured rows); not measured on AMX hardware (none on the development machines).
// Numerics: per k pair the two exact products summed and added to the fp32 sum, bf16 subnormals
// and fp32 subnormal results flushed (the weights are bf16 normals, f8gemm_bf16_x86.h); the sum
// order within 32 k is the hardware's, deterministic for a given depth.
// Features used: AMX-TILE, AMX-BF16 (through Tiles), AVX-512 F/BW/VL/BF16.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpumoe/f8gemm.h"
#include "ukernels/common/x86/amx_gemm.h"
#include "ukernels/common/x86/avx512_common.h"
#include "ukernels/f8gemm/x86/f8gemm_bf16_x86.h"

namespace cpumoe {
namespace {
namespace f8_amx {

constexpr int64_t kMr = 16;             // rows of one A tile; lhs offsets are taken at multiples
constexpr int64_t kNr = f8_bf16::kNr;   // 32: one block gives the two B tiles of a k step
constexpr int64_t kStepK = 32;          // k of one tile step (64 bytes of an A row)
using Packing = F8Packing<kNr, /*Kr=*/kStepK, /*LhsBytes=*/2, /*LhsRows=*/kMr, /*NibbleSpan=*/32>;
using f8_bf16::kPairBytes;

/// Palette 1 with the accumulators (0-3) and A tiles (4, 5) of @p rows rows (a call of at most
/// 16 rows configures just its rows: tile loads, stores and dot products take time by the row),
/// B tiles (6, 7) of 16 k pairs x 64 bytes.
inline amx::TileConfig tile_config(int64_t rows) {
  amx::TileConfig cfg = amx::kernel_tile_config();
  for (int t : {0, 1, 2, 3, 4, 5}) cfg.rows[t] = uint8_t(rows);
  return cfg;
}

/// Bytes of a group panel of padded depth @p gp (two halves of gp / 2 pairs x 64 bytes).
inline int64_t panel_bytes(int64_t gp) { return 64 * gp; }

/// The group at @p grp (gp / 2 steps of Codes<Bits>::kStep code bytes) into @p panel (the file
/// comment); each code line's counterpart @p ahead bytes on (the next block's) is prefetched to
/// L2.
template <int Bits>
inline void expand_group(const f8_bf16::Codes<Bits>& codes, const uint8_t* grp, int64_t gp,
                         uint8_t* panel, int64_t ahead) {
  uint8_t* hi = panel + 32 * gp;
  for (int64_t q = 0; q < gp / 2; ++q) {
    const uint8_t* p = grp + q * f8_bf16::Codes<Bits>::kStep;
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
    __m512i b0, b1;
    codes.decode(p, b0, b1);
    _mm512_store_si512(panel + q * kPairBytes, b0);
    _mm512_store_si512(hi + q * kPairBytes, b1);
  }
}

/// group_dots, then acc[i][0..32) = acc + (S' * 256) * s for the rows < m (s: the group's 32
/// scales at @p scales).
template <class Tiles, int RT, int S>
inline void group_tiles(int64_t i0, int64_t m, const uint8_t* a, int64_t lda, const uint8_t* panel,
                        int64_t gp, const uint8_t* scales, float* acc, float (*buf)[16][16]) {
  constexpr int C0 = 2 * S;
  amx::group_dots<Tiles, amx::DotBf16, RT, S>(a, lda, panel, 2 * gp, 2 * kStepK, buf);
  const __m512 slo = _mm512_loadu_ps(scales), shi = _mm512_loadu_ps(scales + 64);
  const __m512 k256 = _mm512_set1_ps(256.0f);
  const int64_t rows = std::min<int64_t>(kMr * RT, m - i0);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = C0 + 2 * (i / kMr), r = i % kMr;
    float* ar = acc + (i0 + i) * kNr;
    const __m512 fl = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(buf[t][r]), k256), slo);
    const __m512 fh = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(buf[t + 1][r]), k256), shi);
    _mm512_store_ps(ar, _mm512_add_ps(_mm512_load_ps(ar), fl));
    _mm512_store_ps(ar + 16, _mm512_add_ps(_mm512_load_ps(ar + 16), fh));
  }
}

/// The padded depth of the largest group (every group's panel fits in it).
inline int64_t max_group_kp(int64_t k, const F8Layout& w) {
  return Packing::padded_k(Packing::group_k(k, w));
}

// Scratch of a call (ep.scratch, 64-byte aligned): two group panels (see expand_group), then
// m x 32 fp32 accumulators.
inline size_t scratch_bytes(int64_t m, int64_t n, int64_t k, const F8Layout& w) {
  if (m <= 0 || n <= 0) return 0;
  return size_t(2 * panel_bytes(max_group_kp(k, w))) + size_t(m) * kNr * sizeof(float);
}

template <class Tiles, int Bits>
void run(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
         float* dst, int64_t ld, const F8GemmEpilogue& ep) {
  const f8_bf16::Codes<Bits> codes{f8_bf16::codebook_table(w)};
  const F8Call l = f8_call<Packing>(k, w);
  const int64_t lda = 2 * l.kp;  // bf16 A rows
  const auto* a = static_cast<const uint8_t*>(lhs);
  const auto* b = static_cast<const uint8_t*>(rhs);
  const int64_t pbytes = panel_bytes(max_group_kp(k, w));
  auto* scratch = static_cast<uint8_t*>(ep.scratch);
  uint8_t* panels[2] = {scratch, scratch + pbytes};
  auto* acc = reinterpret_cast<float*>(scratch + 2 * pbytes);
  const amx::TileScope<Tiles> scope(tile_config(std::min(m, kMr)));
  const StoreF32Acc store{dst, ld, ep.bias, ep.stream_dst};
  alignas(64) float buf[4][16][16];  // the accumulators on their way to the fp32 epilogue
  for (int64_t j0 = 0; j0 < n; j0 += kNr) {
    const uint8_t* blk = b + (j0 / kNr) * l.block_bytes;
    std::memset(acc, 0, size_t(m) * kNr * sizeof(float));
    expand_group(codes, blk, Packing::group_kp(0, k, w), panels[0], l.block_bytes);
    for (int64_t g = 0; g < l.groups; ++g) {
      const uint8_t* grp = blk + g * l.gstride;
      if (g + 1 < l.groups)
        expand_group(codes, grp + l.gstride, Packing::group_kp(g + 1, k, w),
                     panels[(g + 1) % 2], l.block_bytes);
      const uint8_t* panel = panels[g % 2];
      const int64_t gp = Packing::group_kp(g, k, w);
      const uint8_t* ag = a + 2 * g * l.gk;
      const uint8_t* sc = f8_bf16::group_scales<Packing>(blk, l, g);
      const auto tiles = [&](auto rt, auto set, int64_t i0) {
        group_tiles<Tiles, decltype(rt)::value, decltype(set)::value>(
            i0, m, ag + i0 * lda, lda, panel, gp, sc, acc, buf);
      };
      amx::group_row_tiles(m, g, tiles);
    }
    for (int64_t hf = 0; hf < 2; ++hf) {
      const int64_t c0 = j0 + 16 * hf;
      if (c0 >= n) break;
      const int64_t nc = std::min<int64_t>(16, n - c0);
      for (int64_t i = 0; i < m; ++i) store(i, c0, nc, _mm512_load_ps(acc + i * kNr + 16 * hf));
    }
  }
  if (ep.stream_dst) _mm_sfence();  // the non-temporal stores visible before the call returns
}

/// F8GemmUkernel::run_f32: E4M3 codes, or 4-bit ones (W4A16: f8_bf16::Codes<4>, the same
/// panels from half the bytes).
template <class Tiles>
void run_f32(int64_t m, int64_t n, int64_t k, const F8Layout& w, const void* lhs, const void* rhs,
             float* dst, int64_t ld, const F8GemmEpilogue& ep) {
  if (m <= 0 || n <= 0) return;
  if (w.code_bits == 4) run<Tiles, 4>(m, n, k, w, lhs, rhs, dst, ld, ep);
  else run<Tiles, 8>(m, n, k, w, lhs, rhs, dst, ld, ep);
}

}  // namespace f8_amx
}  // namespace
}  // namespace cpumoe
