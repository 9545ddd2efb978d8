// What the x86 q4gemm (W4A8) kernels share, in plain C++ (each kernel file instantiates it with
// its own ISA flags): their nibble arrangement (`q4ci<nr>x8`), the `qs8rs` lhs layout with its row
// sums, the register-tile walk, and run_q4_f32, the whole run_f32 over a kernel's tile template.
// Internal linkage on purpose (see qgemm/qgemm_common.h).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cpumoe/q4gemm.h"
#include "ukernels/q4gemm/q4gemm_common.h"

namespace cpumoe {
namespace {

/// The nibble arrangement of the x86 kernels (`q4ci<Nr>x8`): per 8 k (slice s of the group), 4 * Nr
/// bytes, byte 4c + t holding column c's k = 8s + t (t < 4) in its low nibble and k = 8s + 4 + t in
/// its high one. One vector of 4 * Nr bytes thus splits (mask, shift + mask) into two vectors of
/// the qgemm `qs8ci<Nr>x4` shape: one int32 lane per column, 4 consecutive k in its bytes.
template <int64_t Nr>
struct NibbleSlices8 {
  static int64_t index(int64_t c, int64_t kk, int64_t /*g*/) {
    const int64_t r = kk % 8;
    return 2 * ((kk / 8) * 4 * Nr + 4 * c + r % 4) + r / 4;
  }
};

/// The `qs8rs` lhs layout: row i at i * row_bytes(k): its k int8 values zero-padded to kp =
/// round_up(k, 32), then kp / 32 int32 sums of the row over 32-k slices. A kernel that decodes
/// the weights to unsigned values v + off (vpdpbusd / vpmaddubsw take u8 x s8) takes the offset
/// back per row and group as off * (sum of the group's slice sums): computed once per row here,
/// so the weights stay 4 bits and the kernel needs no extra dot product per weight vector.
struct Q4LhsRowSums {
  static constexpr int64_t kKr = 8;  // the kernels read A 8 k at a time
  static int64_t padded_k(int64_t k) { return round_up(k, kW4GroupMultiple); }
  static int64_t row_bytes(int64_t k) { return padded_k(k) + padded_k(k) / 8; }
  static size_t lhs_size(int64_t m, int64_t k) { return size_t(m) * size_t(row_bytes(k)); }
  static size_t lhs_offset(int64_t m_idx, int64_t k) {
    return size_t(m_idx) * size_t(row_bytes(k));
  }
  /// The sum of A over group gi (of g k) of the packed row at @p row.
  static int32_t group_sum(const uint8_t* row, int64_t kp, int64_t gi, int64_t g) {
    const uint8_t* s = row + kp + 4 * (gi * g / kW4GroupMultiple);
    uint32_t t = 0;
    for (int64_t x = 0; x < g / kW4GroupMultiple; ++x) {
      int32_t v;
      std::memcpy(&v, s + 4 * x, 4);
      t += uint32_t(v);
    }
    return int32_t(t);
  }
};

/// Q4GemmUkernel::pack_lhs for the `qs8rs` layout.
inline void pack_lhs_qs8rs(int64_t m, int64_t k, const int8_t* const* rows, void* packed) {
  const int64_t kp = Q4LhsRowSums::padded_k(k), rb = Q4LhsRowSums::row_bytes(k);
  auto* dst = static_cast<uint8_t*>(packed);
  for (int64_t i = 0; i < m; ++i) {
    uint8_t* d = dst + i * rb;
    std::memcpy(d, rows[i], size_t(k));
    std::memset(d + k, 0, size_t(kp - k));
    for (int64_t x = 0; x < kp; x += kW4GroupMultiple) {
      int32_t s = 0;
      for (int64_t t = 0; t < kW4GroupMultiple; ++t) s += int8_t(d[x + t]);
      std::memcpy(d + kp + 4 * (x / kW4GroupMultiple), &s, 4);
    }
  }
}

/// The register-tile walk of the x86 kernels (as gemm_tile.h's run): column steps of
/// @p step_blocks blocks of nr columns, each over row tiles of at most @p max_rows rows, rows
/// split evenly over the fewest tiles (7 rows: 4 + 3, not 6 + 1: a tile of one or two rows has
/// too few accumulator chains). Calls of at most @p small.rows rows take small's steps instead,
/// and of at most @p mid.rows mid's (more weight streams where there are fewer rows to feed).
/// The weights of a step stay in L1/L2 while its row tiles pass. Calls tile(rows, nb, i0, jb):
/// rows [i0, i0 + rows) x blocks [jb, jb + nb).
struct Q4Steps {
  int64_t rows, blocks;
};
template <class Tile>
inline void walk_q4_tiles(int64_t m, int64_t n, int64_t nr, Q4Steps small, Q4Steps mid,
                          int64_t max_rows, int64_t step_blocks, const Tile& tile) {
  if (m <= 0 || n <= 0) return;
  if (m <= small.rows) max_rows = small.rows, step_blocks = small.blocks;
  else if (m <= mid.rows) max_rows = mid.rows, step_blocks = mid.blocks;
  const int64_t blocks = (n + nr - 1) / nr, tiles = (m + max_rows - 1) / max_rows;
  for (int64_t jb = 0; jb < blocks; jb += step_blocks) {
    const int64_t nb = std::min(step_blocks, blocks - jb);
    for (int64_t t = 0, i0 = 0; t < tiles; ++t) {
      const int64_t rows = (m - i0 + (tiles - t) - 1) / (tiles - t);
      tile(rows, nb, i0, jb);
      i0 += rows;
    }
  }
}

/// What a tile of an x86 q4gemm kernel reads besides its position: the call's operands and the
/// decode state (built once per call; Decode holds the kernel's vector constants).
template <class Decode>
struct Q4Call {
  const uint8_t* a;  // packed A (`qs8rs`)
  const uint8_t* b;  // packed B
  int64_t lda, bstride, n, k, kp;  // A's row bytes, B's block bytes, the call's n and k, padded k
  const W4Layout& w;
  Decode dec;
  float* dst;
  int64_t ld;
  const Q4GemmEpilogue& ep;
};

/// Where a tile of rows [i0, ...) x blocks [jb, ...) reads (q4_tile_span): its A rows (lda bytes
/// apart) and B blocks (bstride apart), the group size (G when fixed at compile time, else
/// w.group) and count, and a packed group's bytes and code bytes.
struct Q4TileSpan {
  const uint8_t *a, *bp;
  int64_t lda, bstride, g, groups, gbytes, cbytes;
};
template <class Packing, int G, class Decode>
Q4TileSpan q4_tile_span(const Q4Call<Decode>& c, int64_t i0, int64_t jb) {
  const int64_t g = G > 0 ? G : c.w.group;
  return {c.a + i0 * c.lda,  c.b + jb * c.bstride, c.lda, c.bstride, g, c.k / g,
          Packing::group_bytes(c.w), Packing::codes_bytes(c.w)};
}

/// The constants of an x86 kernel K as run_q4_f32 reads them (K derives from this and adds its
/// tile): its packing (P, a Q4Packing), walk_q4_tiles' steps (small, mid, then the main ones;
/// mid equal to small for none), and the decode state's type.
template <class P, int SmallRows, int SmallBlocks, int MidRows, int MidBlocks, int Rows,
          int Blocks, class D>
struct Q4X86Steps {
  static_assert(SmallRows <= MidRows && MidRows < Rows, "regimes by increasing rows");
  using Packing = P;
  static constexpr int64_t kNr = P::kNr;
  static constexpr int kSmallRows = SmallRows, kSmallBlocks = SmallBlocks;
  static constexpr int kMidRows = MidRows, kMidBlocks = MidBlocks;
  static constexpr int kRows = Rows, kBlocks = Blocks;
  using Decode = D;
};

/// What a tile decodes: int4 or mxfp4 nibbles, or int8_affine's 8-bit codes (kernels whose
/// packing has them, Q4Packing::kCodes8).
enum class Q4Codes { int4, mxfp4, bytes };

/// The tile functions of kernel K for one (codes, group) instantiation, [rows - 1][blocks - 1]:
/// K::tile<MR, NB, C, G> where the walk can ask for MR rows x NB blocks, else null.
template <class K, Q4Codes C, int G>
struct Q4TileTable {
  using Fn = void (*)(const Q4Call<typename K::Decode>&, int64_t, int64_t);
  static constexpr int kMaxBlocks = std::max({K::kSmallBlocks, K::kMidBlocks, K::kBlocks});
  template <int MR, int NB>
  static constexpr Fn fn() {
    constexpr int max_nb = MR <= K::kSmallRows ? std::max(K::kSmallBlocks, K::kBlocks)
                           : MR <= K::kMidRows ? std::max(K::kMidBlocks, K::kBlocks)
                                               : K::kBlocks;
    if constexpr (NB <= max_nb) return &K::template tile<MR, NB, C, G>;
    else return nullptr;
  }
  static constexpr auto table = TileFnGrid<Q4TileTable, Fn, K::kRows, kMaxBlocks>::table;
};

/// Q4GemmUkernel::run_f32 of an x86 kernel K over the `qs8rs` A and its Q4Packing B (K::Packing,
/// kNr columns), on walk_q4_tiles. K gives kNr, the walk's steps (Q4X86Steps), a Decode type
/// constructed from the W4Format, and
///   template <int MR, int NB, Q4Codes C, int G>
///   static void tile(const Q4Call<Decode>& c, int64_t i0, int64_t jb);
/// (rows [i0, i0 + MR) x blocks [jb, jb + NB); C: what the codes are; G: the group size when
/// fixed at compile time, else 0 for w.group). G is fixed for mxfp4 (32) and the common groups,
/// 32, 64 and 128: with the loop counts and row sums known, the VNNI kernel at 8 rows took 0.75x
/// (g 128) and 0.94x (g 64) of its time with G = 0 (cpumoe_q4gemm_bench --m 8 --threads 1).
/// The 8-bit codes' tables exist only where K::Packing::kCodes8.
template <class K>
void run_q4_f32(int64_t m, int64_t n, int64_t k, const W4Layout& w, const void* lhs,
                const void* rhs, float* dst, int64_t ld, const Q4GemmEpilogue& ep) {
  const Q4Call<typename K::Decode> c{static_cast<const uint8_t*>(lhs),
                                     static_cast<const uint8_t*>(rhs),
                                     Q4LhsRowSums::row_bytes(k),
                                     int64_t(K::Packing::block_bytes(k, w)),
                                     n, k, Q4LhsRowSums::padded_k(k), w,
                                     typename K::Decode(w.format), dst, ld, ep};
  const auto walk = [&](const auto& table) {
    walk_q4_tiles(m, n, K::kNr, {K::kSmallRows, K::kSmallBlocks}, {K::kMidRows, K::kMidBlocks},
                  K::kRows, K::kBlocks,
                  [&](int64_t rows, int64_t nb, int64_t i0, int64_t jb) {
                    table[size_t(rows - 1)][size_t(nb - 1)](c, i0, jb);
                  });
  };
  const auto by_group = [&](auto codes) {
    constexpr Q4Codes C = decltype(codes)::value;
    if (w.group == 32) walk(Q4TileTable<K, C, 32>::table);
    else if (w.group == 64) walk(Q4TileTable<K, C, 64>::table);
    else if (w.group == 128) walk(Q4TileTable<K, C, 128>::table);
    else walk(Q4TileTable<K, C, 0>::table);
  };
  if (w.format == W4Format::mxfp4) {
    walk(Q4TileTable<K, Q4Codes::mxfp4, 32>::table);
  } else if (w.format == W4Format::int8_affine) {
    if constexpr (K::Packing::kCodes8)
      by_group(std::integral_constant<Q4Codes, Q4Codes::bytes>{});
  } else {
    by_group(std::integral_constant<Q4Codes, Q4Codes::int4>{});
  }
}

}  // namespace
}  // namespace cpumoe
