// The naive oracle. Semantics of the op, per token t and routed slot j (e = topk_ids[t, j]):
//   s_t = max(max|x_t|, 1e-7) / 127, q_t = round_half_even(x_t / s_t) clamped to [-127, 127]
//   h = (q_t . w13[e]^T) * s_t * s13[e] + b13[e]      int32 dot products, fp32 afterwards
//   gate/up = halves of h (swigluoai: even/odd columns); a = act(gate, up) rounded to the dtype
//   s_a, q_a = quantize(a);  y = (q_a . w2[e]^T) * s_a * s2[e] + b2[e]
//   out[t] = sum_j w[t, j] * y_j (w = 1 with skip_weighted), fp32, stored in the input dtype.
#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace cpumoe_ref {

void gemm_s32(int64_t m, int64_t n, int64_t k, const int8_t* a, int64_t lda, const int8_t* b,
              int64_t ldb, int32_t* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      int64_t acc = 0;
      for (int64_t x = 0; x < k; ++x) acc += int64_t(a[i * lda + x]) * int64_t(b[j * ldb + x]);
      if (acc > std::numeric_limits<int32_t>::max() || acc < std::numeric_limits<int32_t>::min()) {
        std::fprintf(stderr, "reference gemm_s32: sum %lld does not fit int32\n", (long long)acc);
        std::abort();
      }
      c[i * ldc + j] = int32_t(acc);
    }
  }
}

float quantize_row(const float* x, int64_t n, int8_t* q) {
  // A NaN or inf anywhere makes the scale NaN / inf (non-finite input propagates to the output).
  bool nan = false;
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    amax = std::fmax(amax, std::fabs(x[i]));
  }
  const float s = nan ? std::numeric_limits<float>::quiet_NaN() : std::fmax(amax, 1e-7f) / 127.0f;
  for (int64_t i = 0; i < n; ++i) {
    // nearbyint rounds half to even in the default rounding mode; NaN (x / NaN, inf / inf) is 0.
    const float r = std::nearbyint(x[i] / s);
    q[i] = std::isnan(r) ? int8_t(0) : int8_t(std::fmin(127.0f, std::fmax(-127.0f, r)));
  }
  return s;
}

double activation(const cpumoe::ActivationSpec& a, double g, double u) {
  // Clamps that keep NaN (as torch.clamp and np.minimum do; std::fmin would drop it), at the
  // fp32 limit the op is given.
  const double L = a.limit;
  auto min_l = [L](double v) { return v > L ? L : v; };
  auto clamp_l = [L](double v) { return v > L ? L : (v < -L ? -L : v); };
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  switch (a.kind) {
    case Activation::silu: return g / (1.0 + std::exp(-g)) * u;
    case Activation::gelu: return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))) * u;
    case Activation::gelu_tanh:
      return 0.5 * g * (1.0 + std::tanh(0.7978845608 * (g + 0.044715 * g * g * g))) * u;
    case Activation::swigluoai: {
      const double gc = min_l(g);
      return (clamp_l(u) + 1.0) * gc / (1.0 + std::exp(-double(a.alpha) * gc));
    }
    case Activation::silu_clamp: return silu(min_l(g)) * clamp_l(u);
    case Activation::silu_clamp_post: return min_l(silu(g)) * clamp_l(u);
  }
  std::abort();
}

namespace {

float load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f16: return cpumoe::f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::bf16: return cpumoe::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  std::abort();
}

float round_to(float v, DType dt) {
  switch (dt) {
    case DType::f32: return v;
    case DType::f16: return cpumoe::f16_to_f32(cpumoe::f32_to_f16(v));
    case DType::bf16: return cpumoe::bf16_to_f32(cpumoe::f32_to_bf16(v));
  }
  std::abort();
}

// y[j] = float(q . w[j]) * s * ws[j] (+ b[j]), in exactly that order, in fp32.
void dequant_gemv(const int8_t* q, float s, const int8_t* w, const float* ws, const float* b,
                  int64_t n, int64_t k, float* y) {
  std::vector<int32_t> acc(static_cast<size_t>(n));
  gemm_s32(1, n, k, q, k, w, k, acc.data(), n);
  for (int64_t j = 0; j < n; ++j) {
    float v = float(acc[size_t(j)]) * s;
    v = v * ws[j];
    if (b != nullptr) v = v + b[j];
    y[j] = v;
  }
}

}  // namespace

namespace {

// The W8A8 pipeline around its two GEMVs, gemv13(e, q, s, gs, h) and gemv2(e, q, s, gs, y):
// each fills the expert's dequantized outputs (biases included) for one quantized row. act_group
// > 0 (ActQuant::group): the rows are quantized per act_group values, their scales in gs, s = 1;
// else one scale s per row and gs nullptr.
template <class Gemv13, class Gemv2>
std::vector<float> int8_pipeline(int64_t E, int64_t H, int64_t I, const MoeInputs& in,
                                 ActivationFn act_override, const Gemv13& gemv13,
                                 const Gemv2& gemv2, int64_t act_group = 0) {
  std::vector<float> gx(act_group ? size_t(H / act_group) : 0),
      ga(act_group ? size_t(I / act_group) : 0);
  auto quantize = [&](const float* v, int64_t n, int8_t* q, std::vector<float>& gs) {
    if (act_group == 0) return quantize_row(v, n, q);
    for (int64_t gi = 0; gi < n / act_group; ++gi)
      gs[size_t(gi)] = quantize_row(v + gi * act_group, act_group, q + gi * act_group);
    return 1.0f;
  };
  float* gxp = act_group ? gx.data() : nullptr;
  float* gap = act_group ? ga.data() : nullptr;
  const size_t h_sz = static_cast<size_t>(H), i_sz = static_cast<size_t>(I);
  std::vector<float> out(static_cast<size_t>(in.T * H), 0.0f);
  std::vector<float> xf(h_sz), h(2 * i_sz), a(i_sz), y(h_sz), acc(h_sz);
  std::vector<int8_t> qx(h_sz), qa(i_sz);
  for (int64_t t = 0; t < in.T; ++t) {
    for (int64_t c = 0; c < H; ++c) xf[size_t(c)] = load(in.x, in.dtype, t * in.x_stride + c);
    const float sx = quantize(xf.data(), H, qx.data(), gx);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < in.k; ++j) {
      const int64_t e = in.topk_ids[t * in.ids_stride + j];
      if (e < 0 || e >= E) std::abort();  // the tests only give the oracle valid routes
      gemv13(e, qx.data(), sx, gxp, h.data());
      const bool interleaved = in.activation.kind == Activation::swigluoai;
      for (int64_t i = 0; i < I; ++i) {
        const float g = interleaved ? h[size_t(2 * i)] : h[size_t(i)];
        const float u = interleaved ? h[size_t(2 * i + 1)] : h[size_t(I + i)];
        const float v = act_override ? act_override(in.activation, g, u)
                                     : float(activation(in.activation, g, u));
        a[size_t(i)] = round_to(v, in.dtype);
      }
      const float sa = quantize(a.data(), I, qa.data(), ga);
      gemv2(e, qa.data(), sa, gap, y.data());
      const float w = in.skip_weighted ? 1.0f : in.topk_weights[t * in.weights_stride + j];
      for (int64_t c = 0; c < H; ++c) acc[size_t(c)] = acc[size_t(c)] + w * y[size_t(c)];
    }
    for (int64_t c = 0; c < H; ++c) out[size_t(t * H + c)] = round_to(acc[size_t(c)], in.dtype);
  }
  return out;
}

}  // namespace

std::vector<float> fused_moe(const MoeProblem& p, const MoeInputs& in, ActivationFn act_override) {
  const int64_t H = p.H, I = p.I;
  return int8_pipeline(
      p.E, H, I, in, act_override,
      [&](int64_t e, const int8_t* q, float s, const float*, float* h) {
        dequant_gemv(q, s, p.w13.data() + e * 2 * I * H, p.s13.data() + e * 2 * I,
                     p.b13.empty() ? nullptr : p.b13.data() + e * 2 * I, 2 * I, H, h);
      },
      [&](int64_t e, const int8_t* q, float s, const float*, float* y) {
        dequant_gemv(q, s, p.w2.data() + e * H * I, p.s2.data() + e * H,
                     p.b2.empty() ? nullptr : p.b2.data() + e * H, H, I, y);
      });
}

int8_t w4_value(W4Format f, uint8_t code) {
  if (f == W4Format::int8_affine) return int8_t(int(code) - 128);
  code &= 15;
  if (f == W4Format::int4) return int8_t(code < 8 ? code : int(code) - 16);
  if (f == W4Format::int4_affine) return int8_t(int(code) - 8);
  // E2M1: exponent 0 is subnormal (0 or 0.5); otherwise (1 + m / 2) * 2^(exp - 1). Doubled.
  const int exp = (code >> 1) & 3, man = code & 1;
  const double mag = exp == 0 ? 0.5 * man : (1.0 + 0.5 * man) * std::ldexp(1.0, exp - 1);
  return int8_t((code & 8 ? -2.0 : 2.0) * mag);
}

float w4_scale(W4Format f, const void* scales, int64_t idx) {
  if (f != W4Format::mxfp4) return static_cast<const float*>(scales)[idx];
  const int e = static_cast<const uint8_t*>(scales)[idx];
  return e == 255 ? std::numeric_limits<float>::quiet_NaN() : float(std::ldexp(1.0, e - 128));
}

namespace {

// gemm_w4_kernel and gemm_w4 in one: with @p pairs, the scales are (scale, min) pairs and the
// offsets' term is added.
void gemm_w4_impl(int64_t m, int64_t n, int64_t k, W4Format f, int64_t g, const int8_t* a,
                  int64_t lda, const uint8_t* codes, int64_t ldc, const void* scales,
                  int64_t lds, const float* lhs_scale, const float* bias, float* dst,
                  int64_t ldd, const float* lhs_group_scale, bool pairs) {
  const int64_t groups = k / g;
  // The activations' scale of row i, group g0 / g (1 and unused without group scales).
  auto ga = [&](int64_t i, int64_t g0) { return lhs_group_scale[i * groups + g0 / g]; };
  int8_t value[256];  // the definition above, evaluated once per call
  for (int c = 0; c < 256; ++c) value[c] = w4_value(f, uint8_t(c));
  const float* pf = static_cast<const float*>(scales);
  auto scale = [&](int64_t idx) { return pairs ? pf[2 * idx] : w4_scale(f, scales, idx); };
  const float half = f == W4Format::int8_affine ? 128.0f : 8.0f;  // the codes' offset
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t g0 = 0; g0 < k; g0 += g) {
        int64_t isum = 0;
        for (int64_t x = g0; x < g0 + g; ++x)
          isum += int64_t(a[i * lda + x]) * value[codes[j * ldc + x]];
        const float term = float(isum) * scale(j * lds + g0 / g);
        acc = acc + (lhs_group_scale ? term * ga(i, g0) : term);
      }
      float v = acc * lhs_scale[i];
      if (bias != nullptr) v = v + bias[j];
      if (pairs) {  // + (sum_g float(asum_g) * (min + half * scale)) * lhs_scale
        const float* pr = pf + 2 * j * lds;
        float corr = 0.0f;
        for (int64_t g0 = 0; g0 < k; g0 += g) {
          int64_t asum = 0;
          for (int64_t x = g0; x < g0 + g; ++x) asum += a[i * lda + x];
          const float offset = pr[2 * (g0 / g) + 1] + half * pr[2 * (g0 / g)];
          const float as = lhs_group_scale ? float(asum) * ga(i, g0) : float(asum);
          corr = corr + as * offset;
        }
        v = v + corr * lhs_scale[i];
      }
      dst[i * ldd + j] = v;
    }
  }
}

}  // namespace

void gemm_w4_kernel(int64_t m, int64_t n, int64_t k, W4Format f, int64_t g, const int8_t* a,
                    int64_t lda, const uint8_t* codes, int64_t ldc, const void* scales,
                    int64_t lds, const float* lhs_scale, const float* bias, float* dst,
                    int64_t ldd, const float* lhs_group_scale) {
  gemm_w4_impl(m, n, k, f, g, a, lda, codes, ldc, scales, lds, lhs_scale, bias, dst, ldd,
               lhs_group_scale, false);
}

void gemm_w4(int64_t m, int64_t n, int64_t k, W4Format f, int64_t g, const int8_t* a, int64_t lda,
             const uint8_t* codes, int64_t ldc, const void* scales, int64_t lds,
             const float* lhs_scale, const float* bias, float* dst, int64_t ldd,
             const float* lhs_group_scale, bool int8_planes) {
  if (f == W4Format::int8_affine && int8_planes) {
    // Two int4_affine planes, code = 16 hi + lo: hi with (16 scale, min) and the bias, lo with
    // (scale, 0); dst = hi + lo (fp32).
    std::vector<uint8_t> hi(size_t(n * k)), lo(size_t(n * k));
    std::vector<float> phi(size_t(n * (k / g) * 2)), plo(phi.size());
    std::vector<float> tmp(size_t(m * n));
    const auto* pairs = static_cast<const float*>(scales);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < k; ++x) {
        hi[size_t(j * k + x)] = uint8_t(codes[j * ldc + x] >> 4);
        lo[size_t(j * k + x)] = uint8_t(codes[j * ldc + x] & 15);
      }
      for (int64_t gi = 0; gi < k / g; ++gi) {
        const float sc = pairs[2 * (j * lds + gi)], mn = pairs[2 * (j * lds + gi) + 1];
        const size_t o = size_t(2 * (j * (k / g) + gi));
        phi[o] = 16.0f * sc, phi[o + 1] = mn;
        plo[o] = sc, plo[o + 1] = 0.0f;
      }
    }
    gemm_w4(m, n, k, W4Format::int4_affine, g, a, lda, hi.data(), k, phi.data(), k / g, lhs_scale,
            bias, dst, ldd, lhs_group_scale);
    gemm_w4(m, n, k, W4Format::int4_affine, g, a, lda, lo.data(), k, plo.data(), k / g,
            lhs_scale, nullptr, tmp.data(), n, lhs_group_scale);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) dst[i * ldd + j] = dst[i * ldd + j] + tmp[size_t(i * n + j)];
    return;
  }
  gemm_w4_impl(m, n, k, f, g, a, lda, codes, ldc, scales, lds, lhs_scale, bias, dst, ldd,
               lhs_group_scale, f == W4Format::int4_affine || f == W4Format::int8_affine);
}

std::vector<float> fused_moe_w4(const MoeProblemW4& p, const MoeInputs& in,
                                ActivationFn act_override) {
  const int64_t H = p.H, I = p.I, g = p.group;
  const int64_t sb = p.format == W4Format::mxfp4                                     ? 1
                     : p.format == W4Format::int4_affine || p.format == W4Format::int8_affine ? 8
                                                                                       : 4;
  return int8_pipeline(
      p.E, H, I, in, act_override,
      [&](int64_t e, const int8_t* q, float s, const float* gs, float* h) {
        gemm_w4(1, 2 * I, H, p.format, g, q, H, p.w13.data() + e * 2 * I * H, H,
                p.s13.data() + e * 2 * I * (H / g) * sb, H / g, &s,
                p.b13.empty() ? nullptr : p.b13.data() + e * 2 * I, h, 2 * I, gs, p.int8_planes);
      },
      [&](int64_t e, const int8_t* q, float s, const float* gs, float* y) {
        gemm_w4(1, H, I, p.format, g, q, I, p.w2.data() + e * H * I, I,
                p.s2.data() + e * H * (I / g) * sb, I / g, &s,
                p.b2.empty() ? nullptr : p.b2.data() + e * H, y, H, gs, p.int8_planes);
      },
      p.act_quant == cpumoe::ActQuant::group ? g : 0);
}

float e4m3(uint8_t code) {
  const uint32_t sign = uint32_t(code >> 7), exp = uint32_t(code >> 3) & 15, man = code & 7u;
  if (exp == 15 && man == 7) return std::numeric_limits<float>::quiet_NaN();
  float v;
  if (exp == 0) {
    v = float(std::ldexp(double(man), -9));  // 0.m * 2^(1 - 7)
  } else {
    // fp32 fields: exponent exp - 7 + 127, the 3 mantissa bits at the top of the 23.
    const uint32_t bits = (exp + 120) << 23 | man << 20;
    std::memcpy(&v, &bits, 4);
  }
  return sign ? -v : v;
}

uint8_t e4m3_code(float v) {
  // By search over the 127 non-negative finite codes (their values increase with the code).
  const float a = std::fabs(v);
  uint8_t lo = 0, hi = 0x7E;
  while (lo < hi) {  // the first code whose value is >= a
    const uint8_t mid = uint8_t((lo + hi) / 2);
    if (e4m3(mid) < a) lo = uint8_t(mid + 1); else hi = mid;
  }
  uint8_t c = lo;
  if (c > 0) {
    const float below = e4m3(uint8_t(c - 1)), above = e4m3(c);
    if (a - below < above - a || (a - below == above - a && (c - 1) % 2 == 0)) c = uint8_t(c - 1);
  }
  return uint8_t(c | (std::signbit(v) ? 0x80 : 0));
}

void gemm_f8(int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n, const uint16_t* a,
             int64_t lda, const uint8_t* codes, int64_t ldc, const float* scales, int64_t lds,
             const float* bias, float* dst, int64_t ldd, double* mag) {
  const int64_t gk = group >= k ? k : group;
  float value[256];  // the definition above, evaluated once per call
  for (int c = 0; c < 256; ++c) value[c] = e4m3(uint8_t(c));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      double bound = 0.0;
      for (int64_t k0 = 0, g = 0; k0 < k; k0 += gk, ++g) {
        double sum = 0.0, abs_sum = 0.0;
        for (int64_t x = k0; x < std::min(k, k0 + gk); ++x) {
          // bf16 x E4M3: 8 + 4 significant bits, exact in double (and in fp32).
          const double p = double(cpumoe::bf16_to_f32(a[i * lda + x])) *
                           double(value[codes[j * ldc + x]]);
          sum += p;
          abs_sum += std::fabs(p);
        }
        const float s = scales[(j / block_n) * lds + g];
        acc = acc + float(sum) * s;
        bound += abs_sum * std::fabs(double(s));
      }
      if (bias != nullptr) acc = acc + bias[j];
      dst[i * ldd + j] = acc;
      if (mag != nullptr) mag[i * ldd + j] = bound;
    }
  }
}

namespace {

// y[j] = float(sum_x bf16(a[x]) * w[j][x]) (+ b[j]): exact products, double sum.
void bf16_gemv(const float* a, const uint16_t* w, const float* b, int64_t n, int64_t k, float* y) {
  for (int64_t j = 0; j < n; ++j) {
    double acc = 0.0;
    for (int64_t x = 0; x < k; ++x)
      acc += double(round_to(a[x], DType::bf16)) * double(cpumoe::bf16_to_f32(w[j * k + x]));
    y[j] = b != nullptr ? float(acc) + b[j] : float(acc);
  }
}

}  // namespace

std::vector<float> fused_moe_bf16(const MoeProblemBf16& p, const MoeInputs& in) {
  const int64_t H = p.H, I = p.I;
  const size_t h_sz = static_cast<size_t>(H), i_sz = static_cast<size_t>(I);
  std::vector<float> out(static_cast<size_t>(in.T * H), 0.0f);
  std::vector<float> xf(h_sz), h(2 * i_sz), a(i_sz), y(h_sz), acc(h_sz);
  for (int64_t t = 0; t < in.T; ++t) {
    for (int64_t c = 0; c < H; ++c) xf[size_t(c)] = load(in.x, in.dtype, t * in.x_stride + c);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < in.k; ++j) {
      const int64_t e = in.topk_ids[t * in.ids_stride + j];
      if (e < 0 || e >= p.E) std::abort();
      bf16_gemv(xf.data(), p.w13.data() + e * 2 * I * H,
                p.b13.empty() ? nullptr : p.b13.data() + e * 2 * I, 2 * I, H, h.data());
      const bool interleaved = in.activation.kind == Activation::swigluoai;
      for (int64_t i = 0; i < I; ++i) {
        const float g = interleaved ? h[size_t(2 * i)] : h[size_t(i)];
        const float u = interleaved ? h[size_t(2 * i + 1)] : h[size_t(I + i)];
        a[size_t(i)] = float(activation(in.activation, g, u));
      }
      bf16_gemv(a.data(), p.w2.data() + e * H * I, p.b2.empty() ? nullptr : p.b2.data() + e * H, H,
                I, y.data());
      const float w = in.skip_weighted ? 1.0f : in.topk_weights[t * in.weights_stride + j];
      for (int64_t c = 0; c < H; ++c) acc[size_t(c)] = acc[size_t(c)] + w * y[size_t(c)];
    }
    for (int64_t c = 0; c < H; ++c) out[size_t(t * H + c)] = round_to(acc[size_t(c)], in.dtype);
  }
  return out;
}

std::vector<float> fused_moe_fp8(const MoeProblemFp8& p, const MoeInputs& in) {
  const int64_t H = p.H, I = p.I;
  auto groups = [&](int64_t depth) {
    return p.block_k == 0 || p.block_k >= depth ? int64_t{1}
                                                : (depth + p.block_k - 1) / p.block_k;
  };
  auto group = [&](int64_t depth) { return p.block_k == 0 ? depth : p.block_k; };
  const int64_t g13 = groups(H), g2 = groups(I);
  const int64_t rows13 = (2 * I + p.block_n - 1) / p.block_n;
  const int64_t rows2 = (H + p.block_n - 1) / p.block_n;
  std::vector<float> out(size_t(in.T * H), 0.0f);
  std::vector<uint16_t> xb(static_cast<size_t>(H)), ab(static_cast<size_t>(I));
  std::vector<float> h(static_cast<size_t>(2 * I)), y(static_cast<size_t>(H)),
      acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < in.T; ++t) {
    for (int64_t c = 0; c < H; ++c)
      xb[size_t(c)] = cpumoe::f32_to_bf16(load(in.x, in.dtype, t * in.x_stride + c));
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < in.k; ++j) {
      const int64_t e = in.topk_ids[t * in.ids_stride + j];
      if (e < 0 || e >= p.E) std::abort();
      gemm_f8(1, 2 * I, H, group(H), p.block_n, xb.data(), H, p.w13.data() + e * 2 * I * H, H,
              p.s13.data() + e * rows13 * g13, g13,
              p.b13.empty() ? nullptr : p.b13.data() + e * 2 * I, h.data(), 2 * I);
      const bool interleaved = in.activation.kind == Activation::swigluoai;
      for (int64_t i = 0; i < I; ++i) {
        const float g = interleaved ? h[size_t(2 * i)] : h[size_t(i)];
        const float u = interleaved ? h[size_t(2 * i + 1)] : h[size_t(I + i)];
        ab[size_t(i)] = cpumoe::f32_to_bf16(float(activation(in.activation, g, u)));
      }
      gemm_f8(1, H, I, group(I), p.block_n, ab.data(), I, p.w2.data() + e * H * I, I,
              p.s2.data() + e * rows2 * g2, g2, p.b2.empty() ? nullptr : p.b2.data() + e * H,
              y.data(), H);
      const float w = in.skip_weighted ? 1.0f : in.topk_weights[t * in.weights_stride + j];
      for (int64_t c = 0; c < H; ++c) acc[size_t(c)] = acc[size_t(c)] + w * y[size_t(c)];
    }
    for (int64_t c = 0; c < H; ++c) out[size_t(t * H + c)] = round_to(acc[size_t(c)], in.dtype);
  }
  return out;
}

}  // namespace cpumoe_ref
