/// @file amx_tile_model.h
/// A plain C++ model of the AMX tile instructions the kernels use, for the tests only: the Tiles
/// class of csrc/ukernels/common/x86/amx_gemm.h with per-thread tile registers and configuration
/// in memory, so the AMX kernels' tiling, packing, edges and epilogue run (and are checked bit for
/// bit) on CPUs without AMX. Semantics, from the instruction set reference:
///  - ldtilecfg: palette 0 releases the tiles; palette 1 takes the rows / bytes-per-row of each
///    tile (at most 16 x 64) and zeroes all tile data. sttilecfg of an unconfigured thread stores
///    64 zero bytes. tilerelease returns to that state.
///  - tileloadd / tilestored: `rows` rows of `colsb` bytes at p + r * stride; rows past the
///    configured ones read as zero.
///  - tdpbusd: C.s32[m][n] += sum over k groups of 4 of u8(A[m][4k+i]) * s8(B[k][4n+i]), in
///    wrapping 32-bit arithmetic, exact; tdpbssd the same with s8(A[m][4k+i]).
///  - tdpbf16ps: for each k pair, C.f32[m][n] += fp32(a0 b0 + a1 b1) with the pair's two exact
///    products summed in one rounding (round to nearest even), bf16 subnormal inputs and fp32
///    subnormal results flushed to zero. Measured on Sapphire Rapids: bit-identical to the
///    hardware for one k pair (every element of 200 random tiles); over a whole tile of 16 pairs
///    the hardware groups its roundings otherwise and agrees with this model within the fp32
///    summation bound, not bit for bit. That is why the bf16 kernel tests compare with the
///    tester's bound (and exactly on integer data, where every order is exact).
/// Shape rules the hardware enforces with #UD (rows/colsb beyond the palette, mismatched
/// operand shapes, an unconfigured thread) abort the test process here.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ukernels/common/x86/amx_gemm.h"

namespace cpumoe_test {
// Internal linkage: the including file is built with AVX-512 flags (see amx_model_kernels.cpp).
namespace {

struct AmxTileModel {
  struct Tile {
    int rows = 0, colsb = 0;
    uint8_t data[16][64];
  };
  struct State {
    bool configured = false;
    uint8_t cfg[64] = {};
    Tile t[8];
  };
  struct Saved {
    uint8_t cfg[64];
  };

  static State& state() {
    thread_local State s;
    return s;
  }
  [[noreturn]] static void fault(const char* what) {
    std::fprintf(stderr, "AMX tile model: %s (the hardware raises #UD)\n", what);
    std::abort();
  }

  // --- the instructions --------------------------------------------------------------------------
  static void loadconfig(const void* p) {
    State& s = state();
    std::memcpy(s.cfg, p, 64);
    if (s.cfg[0] == 0) {
      release();
      return;
    }
    if (s.cfg[0] != 1) fault("ldtilecfg: unsupported palette");
    for (int i = 1; i < 16; ++i)  // start_row and the reserved bytes must be zero
      if (s.cfg[i] != 0) fault("ldtilecfg: reserved bytes not zero");
    for (int t = 0; t < 8; ++t) {
      uint16_t colsb;
      std::memcpy(&colsb, s.cfg + 16 + 2 * t, 2);
      const int rows = s.cfg[48 + t];
      if (colsb > 64 || rows > 16) fault("ldtilecfg: tile larger than palette 1 allows");
      if ((colsb == 0) != (rows == 0)) fault("ldtilecfg: tile with rows but no bytes (or back)");
      s.t[t].rows = rows;
      s.t[t].colsb = colsb;
      std::memset(s.t[t].data, 0, sizeof(s.t[t].data));
    }
    s.configured = true;
  }
  static void storeconfig(void* p) {
    const State& s = state();
    if (s.configured) std::memcpy(p, s.cfg, 64);
    else std::memset(p, 0, 64);
  }
  static void release() {
    State& s = state();
    s = State();
  }
  static Tile& tile(int t) {
    State& s = state();
    if (!s.configured) fault("tile instruction on an unconfigured thread");
    if (s.t[t].rows == 0) fault("tile instruction on a tile the configuration leaves empty");
    return s.t[t];
  }

  // --- amx_gemm.h's Tiles interface ------------------------------------------------------------
  static void begin(Saved& saved, const cpumoe::amx::TileConfig& cfg) {
    storeconfig(saved.cfg);
    loadconfig(&cfg);
  }
  static void end(const Saved& saved) {
    if (saved.cfg[0] != 0) loadconfig(saved.cfg);
    else release();
  }
  template <int T>
  static void zero() {
    std::memset(tile(T).data, 0, sizeof(Tile::data));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    Tile& d = tile(T);
    std::memset(d.data, 0, sizeof(d.data));
    for (int r = 0; r < d.rows; ++r)
      std::memcpy(d.data[r], static_cast<const uint8_t*>(p) + r * stride, size_t(d.colsb));
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    const Tile& d = tile(T);
    for (int r = 0; r < d.rows; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, d.data[r], size_t(d.colsb));
  }
  template <int C, int A, int B>
  static void dpbusd() { dot_i8<C, A, B, false>(); }
  template <int C, int A, int B>
  static void dpbssd() { dot_i8<C, A, B, true>(); }
  template <int C, int A, int B>
  static void dpbf16ps() {
    Tile &c = tile(C), &a = tile(A), &b = tile(B);
    check_shapes(c, a, b);
    for (int m = 0; m < c.rows; ++m)
      for (int n = 0; n < c.colsb / 4; ++n) {
        float acc;
        std::memcpy(&acc, c.data[m] + 4 * n, 4);
        for (int k = 0; k < a.colsb / 4; ++k) {
          const double p0 = double(bf16(a.data[m], 2 * k)) * double(bf16(b.data[k], 2 * n));
          const double p1 = double(bf16(a.data[m], 2 * k + 1)) * double(bf16(b.data[k], 2 * n + 1));
          acc = ftz(acc + ftz(float(p0 + p1)));  // products exact in double; one rounding each
        }
        std::memcpy(c.data[m] + 4 * n, &acc, 4);
      }
  }

 private:
  // tdpbusd (A unsigned) or tdpbssd (A signed); B signed in both.
  template <int C, int A, int B, bool SignedA>
  static void dot_i8() {
    Tile &c = tile(C), &a = tile(A), &b = tile(B);
    check_shapes(c, a, b);
    for (int m = 0; m < c.rows; ++m)
      for (int n = 0; n < c.colsb / 4; ++n) {
        uint32_t acc;
        std::memcpy(&acc, c.data[m] + 4 * n, 4);
        for (int k = 0; k < a.colsb / 4; ++k)
          for (int i = 0; i < 4; ++i) {
            const uint8_t x = a.data[m][4 * k + i];
            const int32_t av = SignedA ? int32_t(int8_t(x)) : int32_t(x);
            acc += uint32_t(av * int32_t(int8_t(b.data[k][4 * n + i])));
          }
        std::memcpy(c.data[m] + 4 * n, &acc, 4);
      }
  }
  static void check_shapes(const Tile& c, const Tile& a, const Tile& b) {
    if (a.rows != c.rows || b.colsb != c.colsb || a.colsb != 4 * b.rows)
      fault("tile dot product with mismatched shapes");
  }
  static float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
  static float bf16(const uint8_t* row, int idx) {
    uint16_t h;
    std::memcpy(&h, row + 2 * idx, 2);
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return ftz(f);
  }
};

}  // namespace
}  // namespace cpumoe_test
