// The AMX kernels over the tile model (amx_model_kernels.h). Built with the avx512_bf16 level's
// flags (the kernels' epilogue and few-row paths are AVX-512), never with AMX ones: no tile
// instruction can be in this object. Like the kernel files, it instantiates no library template
// that other objects share (plain arrays, no std::vector): an out-of-line copy built with these
// flags could be the one the linker keeps (the IsaObjects test checks this object too).
#if defined(__AMX_TILE__)
#error "amx_model_kernels.cpp must be built without AMX flags (it runs the tile model)"
#endif

#include "amx/amx_model_kernels.h"
#include "amx/amx_probe.h"

#include "amx/amx_tile_model.h"
#include "ukernels/bgemm/x86/bgemm_amx.h"
#include "ukernels/f8gemm/x86/f8gemm_amx.h"
#include "ukernels/q4gemm/x86/q4gemm_amx.h"
#include "ukernels/qgemm/x86/qgemm_amx.h"

namespace cpumoe_test {

extern const cpumoe::QGemmUkernel qgemm_amx_tilemodel =
    cpumoe::make_qgemm<cpumoe::qgemm_amx::Packing>(
        "qgemm_qu8r_qs8ci16x4s_16x16_amx_tilemodel", cpumoe::Isa::avx512_vnni,
        cpumoe::qgemm_amx::kMr, cpumoe::qgemm_amx::pack_lhs, cpumoe::qgemm_amx::pack_rhs,
        cpumoe::qgemm_amx::run_f32<AmxTileModel>);
extern const cpumoe::BGemmUkernel bgemm_amx_tilemodel =
    cpumoe::make_bgemm<cpumoe::bgemm_amx::Packing>(
        "bgemm_bf16r_bf16ci16x2_16x16_amx_tilemodel", cpumoe::Isa::avx512_bf16,
        cpumoe::bgemm_amx::kMr, cpumoe::pack_lhs_bf16r<cpumoe::bgemm_amx::Packing>,
        cpumoe::pack_rhs_bf16c<cpumoe::bgemm_amx::Packing, 2>,
        cpumoe::bgemm_amx::run_f32<AmxTileModel>);

extern const cpumoe::F8GemmUkernel f8gemm_amx_tilemodel =
    cpumoe::make_f8gemm<cpumoe::f8_amx::Packing>(
        "f8gemm_bf16r_f8ci32x2_16x32_amx_tilemodel", cpumoe::Isa::avx512_bf16,
        cpumoe::f8_amx::kMr, cpumoe::pack_lhs_bf16r<cpumoe::f8_amx::Packing>,
        cpumoe::pack_rhs_f8<cpumoe::f8_amx::Packing, cpumoe::f8_bf16::Arrange>,
        cpumoe::f8_amx::run_f32<AmxTileModel>, cpumoe::f8_amx::scratch_bytes);

extern const cpumoe::Q4GemmUkernel q4gemm_amx_tilemodel =
    cpumoe::make_q4gemm<cpumoe::q4_amx::LhsPacking, cpumoe::q4_amx::Packing>(
        "q4gemm_qs8rs_q4cio32x4_16x32_amx_tilemodel", cpumoe::Isa::avx512_vnni,
        cpumoe::q4_amx::kMr, cpumoe::q4_amx::pack_lhs,
        cpumoe::pack_rhs_q4<cpumoe::q4_amx::Packing, cpumoe::q4_vnni::HalvesInNibbles,
                            cpumoe::q4_vnni::OffsetInt4>,
        cpumoe::q4_amx::run_f32<AmxTileModel>, cpumoe::q4_amx::scratch_bytes);

float amx_model_run_int8_once() {
  constexpr int64_t m = 32, n = 32, k = 64;
  static int8_t a[m * k], b[n * k];
  static const int8_t* rows[m];
  alignas(64) static uint8_t lhs[m * k], rhs[2 * (16 * k + 64)];
  static float ones[m], out[m * n];
  for (int64_t x = 0; x < m * k; ++x) a[x] = b[x] = 1;
  for (int64_t i = 0; i < m; ++i) rows[i] = a + i * k, ones[i] = 1.0f;
  const cpumoe::QGemmUkernel& kn = qgemm_amx_tilemodel;
  if (kn.lhs_packed_size(m, k) > sizeof(lhs) || kn.rhs_packed_size(n, k) > sizeof(rhs)) return -1;
  kn.pack_lhs(m, k, rows, lhs);
  kn.pack_rhs(n, k, b, k, rhs);
  kn.run_f32(m, n, k, lhs, rhs, out, n, {ones, ones, nullptr});
  return out[0];
}

void amx_model_storeconfig(void* cfg64) { AmxTileModel::storeconfig(cfg64); }
void amx_model_loadconfig(const void* cfg64) { AmxTileModel::loadconfig(cfg64); }

}  // namespace cpumoe_test

namespace cpumoe_test {
namespace {
// The probe's shapes on the model: tmm0 C, tmm1 A (a_colsb bytes per row), tmm2 B.
void model_configure(int a_colsb) {
  cpumoe::amx::TileConfig cfg = cpumoe::amx::kernel_tile_config();
  cfg.colsb[1] = uint16_t(a_colsb);
  cfg.rows[2] = uint8_t(a_colsb / 4);
  AmxTileModel::loadconfig(&cfg);
}
}  // namespace

void amx_model_dpbusd(const void* a, const void* b, void* c) {
  model_configure(64);
  AmxTileModel::load<0>(c, 64);
  AmxTileModel::load<1>(a, 64);
  AmxTileModel::load<2>(b, 64);
  AmxTileModel::dpbusd<0, 1, 2>();
  AmxTileModel::store<0>(c, 64);
  AmxTileModel::release();
}

void amx_model_dpbssd(const void* a, const void* b, void* c) {
  model_configure(64);
  AmxTileModel::load<0>(c, 64);
  AmxTileModel::load<1>(a, 64);
  AmxTileModel::load<2>(b, 64);
  AmxTileModel::dpbssd<0, 1, 2>();
  AmxTileModel::store<0>(c, 64);
  AmxTileModel::release();
}

void amx_model_dpbf16ps(const void* a, const void* b, void* c, int pairs) {
  model_configure(4 * pairs);
  AmxTileModel::load<0>(c, 64);
  AmxTileModel::load<1>(a, 64);
  AmxTileModel::load<2>(b, 64);
  AmxTileModel::dpbf16ps<0, 1, 2>();
  AmxTileModel::store<0>(c, 64);
  AmxTileModel::release();
}

}  // namespace cpumoe_test
