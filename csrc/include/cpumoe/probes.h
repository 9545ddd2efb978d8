/// @file probes.h
/// Peak-throughput probes for the benchmarks: what this CPU's matrix units reach on a loop that
/// only multiplies tiles already in registers (no memory traffic), the yardstick against which
/// `cpumoe bench` reports a GEMM's TOP/s.
#pragma once

namespace cpumoe {

/// Peak of the AMX tile units, from a tile-only loop (4 accumulators fed by 2 x 2 operand tiles
/// already loaded) run on @p threads threads at once for about @p seconds.
struct AmxPeak {
  double int8_ops = 0;    ///< tdpbusd: int8 operations (2 per multiply-add) per second, all threads
  double bf16_flops = 0;  ///< tdpbf16ps: bf16 flops (2 per multiply-add) per second, all threads
};

/// Measures the AMX peak into @p out. Returns false (and leaves @p out alone) when this build
/// has no AMX code or cpu_supports(Isa::amx) is false. Features used: AMX-TILE, -INT8, -BF16.
/// @pre threads >= 1, seconds > 0.
bool measure_amx_peak(int threads, double seconds, AmxPeak* out);

}  // namespace cpumoe
