// The activation specs the tests sweep: every row of activation.h's table, the clamped ones at
// limits where their clamps fire on the tests' O(1)-to-O(10) values (2.5, 0.75) and where they
// fire only on large values (10) or never (inf). One list, so a new activation is swept
// everywhere once it is added here.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "cpumoe/activation.h"

namespace cpumoe_test {

inline const std::vector<cpumoe::ActivationSpec>& activation_specs() {
  using cpumoe::Activation;
  using cpumoe::ActivationSpec;
  static const std::vector<ActivationSpec> specs = {
      Activation::silu,
      Activation::gelu,
      Activation::gelu_tanh,
      Activation::swigluoai,
      {Activation::swigluoai, 2.5f, 1.5f},
      ActivationSpec::with_limit(Activation::silu_clamp, 10.0f),
      ActivationSpec::with_limit(Activation::silu_clamp, 2.5f),
      ActivationSpec::with_limit(Activation::silu_clamp, std::numeric_limits<float>::infinity()),
      ActivationSpec::with_limit(Activation::silu_clamp_post, 10.0f),
      ActivationSpec::with_limit(Activation::silu_clamp_post, 0.75f),
  };
  return specs;
}

/// One spec per row of the table, from activation_specs(): the first of each activation whose
/// clamp (if it has one) is inside the MoE tests' GEMM1 range (about [-8, 8]), so it fires: the
/// MoE grids' activations.
inline const std::vector<cpumoe::ActivationSpec>& moe_activation_specs() {
  static const std::vector<cpumoe::ActivationSpec> specs = [] {
    std::vector<cpumoe::ActivationSpec> out;
    for (int k = 0; k < cpumoe::kNumActivations; ++k) {
      for (const cpumoe::ActivationSpec& a : activation_specs()) {
        const bool fires = !cpumoe::kActivationTable[k].has_limit || a.limit < 8.0f;
        if (int(a.kind) == k && fires) {
          out.push_back(a);
          break;
        }
      }
    }
    return out;
  }();
  return specs;
}

/// A spec's canonical text, for SCOPED_TRACE.
inline std::string spec_name(const cpumoe::ActivationSpec& a) {
  return cpumoe::activation_spec_str(a);
}

/// The same as a test-name part (letters, digits and '_' only).
inline std::string spec_id(const cpumoe::ActivationSpec& a) {
  std::string s = spec_name(a);
  for (char& c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))) c = '_';
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}

}  // namespace cpumoe_test
