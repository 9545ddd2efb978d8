// cpumoe._C: the pybind11 module. It takes tensors as (address, strides) already checked by the
// Python layer (python/cpumoe/_tensors.py), so it depends on neither torch nor numpy and the same
// module serves both. The kernels run with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "cpumoe/bgemm.h"
#include "cpumoe/cpu_features.h"
#include "cpumoe/moe.h"
#include "cpumoe/probes.h"
#include "cpumoe/q4gemm.h"
#include "cpumoe/qgemm.h"
#include "cpumoe/weight_format.h"

namespace py = pybind11;
using namespace cpumoe;

namespace {

template <class T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

DType parse_dtype(const std::string& name, const char* what) {
  if (name == "float32") return DType::f32;
  if (name == "float16") return DType::f16;
  if (name == "bfloat16") return DType::bf16;
  throw py::type_error(std::string(what) + ": dtype must be float32, float16 or bfloat16, got " +
                       name);
}

// An activation spec ("silu", "silu_clamp(limit=10)", ...): parsed and checked, or an
// ArgumentError that says why.
ActivationSpec parse_act(const std::string& text) {
  ActivationSpec spec;
  std::string why;
  if (!parse_activation_spec(text, &spec, &why)) throw ArgumentError("activation: " + why);
  why = activation_spec_problem(spec);
  if (!why.empty()) throw ArgumentError("activation: " + why);
  return spec;
}

// A table of rows for Python: one dict per row, {"name": row.name} and what fill(row, d) adds.
template <class Row, size_t N, class Fill>
py::list table_list(const Row (&rows)[N], const Fill& fill) {
  py::list out;
  for (const Row& row : rows) {
    py::dict d;
    d["name"] = row.name;
    fill(row, d);
    out.append(d);
  }
  return out;
}

// The activation table (activation.h) for Python: one dict per activation.
py::list activations_list() {
  return table_list(kActivationTable, [](const ActivationInfo& info, py::dict& d) {
    d["interleaved"] = info.interleaved;
    py::dict params;
    auto dflt = [](float v) -> py::object {
      return std::isnan(v) ? py::object(py::none()) : py::object(py::float_(v));
    };
    if (info.has_limit) params["limit"] = dflt(info.default_limit);
    if (info.has_alpha) params["alpha"] = dflt(info.default_alpha);
    d["params"] = params;  // name -> default (None: required)
    d["formula"] = info.formula;
  });
}

// The chain (kernel, row ops, tile policy) of a family that prepack builds under the cap `isa`:
// prepack, select_kernel and select_bf16_kernel all go through here.
template <class Kernel>
MoeConfig<Kernel> config_for(const std::optional<std::string>& isa,
                             MoeConfig<Kernel> (*build)(const Kernel*, const Isa*)) {
  if (!isa) return build(nullptr, nullptr);
  const Isa cap = parse_isa(*isa, "isa");
  return build(nullptr, &cap);
}

// The format table (weight_format.h) for Python: one dict per format.
py::list formats_list() {
  return table_list(kWeightFormatTable, [](const WeightFormatInfo& info, py::dict& d) {
    d["bits"] = info.bits;
    d["value_code"] = info.value_code;
    d["scale"] = scale_kind_name(info.scale);
    d["scale_bytes"] = info.scale_bytes;
    d["group"] = group_rule_name(info.group);
    d["group_size"] = info.group_size;
    d["group_max"] = info.group_max;
    d["zero_point"] = info.zero_point;
    d["family"] = kernel_family_name(info.family);
    d["activations"] = info.activations;
    d["prepack"] = info.prepack;
  });
}

// Python names of the packed kinds and the family each packs for.
template <class P>
struct PackedNames;
template <>
struct PackedNames<PackedMoe> {
  static constexpr const char* cls = "PackedMoe";
  static constexpr KernelFamily family = KernelFamily::qgemm;
};
template <>
struct PackedNames<PackedMoeBf16> {
  static constexpr const char* cls = "PackedMoeBf16";
  static constexpr KernelFamily family = KernelFamily::bgemm;
};
template <>
struct PackedNames<PackedMoeW4> {
  static constexpr const char* cls = "PackedMoeW4";
  static constexpr KernelFamily family = KernelFamily::q4gemm;
};
template <>
struct PackedNames<PackedMoeFp8> {
  static constexpr const char* cls = "PackedMoeFp8";
  static constexpr KernelFamily family = KernelFamily::f8gemm;
};

// "cpumoe.prepack_int4() or ...": the prepack functions of the table's rows
// of @p family.
std::string makers(KernelFamily family) {
  std::string out;
  for (const WeightFormatInfo& info : kWeightFormatTable)
    if (info.family == family)
      out += (out.empty() ? "cpumoe." : " or cpumoe.") + std::string(info.prepack) + "()";
  return out;
}

// packed.weight_format: the name of its row of the format table.
template <class P>
const char* weight_format(const P& p) {
  return weight_format_name(p.weight_format());
}

// The packed weights behind a Python object. An instance whose C++ object was never constructed
// (PackedMoe.__new__ without prepack, a subclass skipping __init__) has no holder: refuse it with
// a TypeError naming the argument, instead of reading uninitialised memory.
template <class P>
std::shared_ptr<const P> packed_of(py::handle h) {
  std::shared_ptr<P> p;
  try {
    p = py::cast<std::shared_ptr<P>>(h);
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("packed: not an initialised cpumoe.") + PackedNames<P>::cls +
                         " (create it with " + makers(PackedNames<P>::family) + ")");
  }
  if (!p) throw py::type_error("packed: is None");
  return p;
}

// Immutable and self-contained (prepack copies everything it needs): copies share the object,
// it cannot be subclassed, and it is not picklable (prepack again from the checkpoint).
template <class P>
py::class_<P, std::shared_ptr<P>> def_packed(py::module_& m) {
  return py::class_<P, std::shared_ptr<P>>(m, PackedNames<P>::cls, py::is_final())
      .def_property_readonly("num_experts",
                             [](py::handle h) { return packed_of<P>(h)->num_experts(); })
      .def_property_readonly("hidden", [](py::handle h) { return packed_of<P>(h)->hidden(); })
      .def_property_readonly("intermediate",
                             [](py::handle h) { return packed_of<P>(h)->intermediate(); })
      .def_property_readonly("has_bias13",
                             [](py::handle h) { return packed_of<P>(h)->has_bias13(); })
      .def_property_readonly("has_bias2", [](py::handle h) { return packed_of<P>(h)->has_bias2(); })
      .def_property_readonly("kernel", [](py::handle h) { return packed_of<P>(h)->kernel().name; })
      .def_property_readonly("rowops",
                             [](py::handle h) { return packed_of<P>(h)->config().rowops->name; })
      .def_property_readonly("path",
                             [](py::handle h) { return isa_name(packed_of<P>(h)->kernel().isa); })
      .def_property_readonly("packed_bytes",
                             [](py::handle h) { return packed_of<P>(h)->packed_bytes(); })
      .def_property_readonly("weight_format",
                             [](py::handle h) { return weight_format(*packed_of<P>(h)); })
      .def("__copy__", [](py::handle h) {
        packed_of<P>(h);
        return py::reinterpret_borrow<py::object>(h);
      })
      .def("__deepcopy__", [](py::handle h, py::handle) {
        packed_of<P>(h);
        return py::reinterpret_borrow<py::object>(h);
      })
      .def("__repr__", [](py::handle h) {
        const auto p = packed_of<P>(h);
        return std::string(PackedNames<P>::cls) + "(E=" + std::to_string(p->num_experts()) +
               ", H=" + std::to_string(p->hidden()) + ", I=" + std::to_string(p->intermediate()) +
               ", weight_format=" + weight_format(*p) + ", path=" + isa_name(p->kernel().isa) +
               ", kernel=" + p->kernel().name + ")";
      });
}

template <class Kernel>
py::list kernel_list(const std::vector<const Kernel*>& registry) {
  py::list out;
  for (const Kernel* k : registry) {
    py::dict d;
    d["name"] = k->name;
    d["isa"] = isa_name(k->isa);
    d["mr"] = k->mr;
    d["nr"] = k->nr;
    d["kr"] = k->kr;
    d["supported"] = cpu_has(k->isa);  // a query: no AMX permission request here
    out.append(d);
  }
  return out;
}

// Whether every page of [addr, addr + bytes) is writable. A torch tensor carries no read-only
// flag (torch.from_numpy / torch.frombuffer of a read-only array or mapping only warn), so `out`
// over a read-only mapping would be a SIGSEGV inside the op. Each page is probed with a futex
// FUTEX_WAKE_OP that atomically adds 0 to one aligned int of it and wakes nobody: the kernel
// reports EFAULT for a page the process may not write, no signal is raised, and the atomic add
// of 0 cannot lose a concurrent store (unlike reading a byte and writing it back). One system
// call per 4 KiB page, against the op's work on that page. Elsewhere than Linux: no probe.
bool writable_pages(uintptr_t addr, size_t bytes) {
#if defined(__linux__)
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t end = addr + bytes;
  int unused = 0;
  for (uintptr_t b = addr; b < end; b = (b / page + 1) * page) {
    const uintptr_t page_end = (b / page + 1) * page;
    const uintptr_t q = std::min((b + 3) / 4 * 4, page_end - 4);  // aligned, inside this page
    const long r = syscall(SYS_futex, &unused, FUTEX_WAKE_OP | FUTEX_PRIVATE_FLAG, 0, nullptr,
                           reinterpret_cast<int*>(q), FUTEX_OP(FUTEX_OP_ADD, 0, FUTEX_OP_CMP_EQ, 0));
    if (r < 0 && errno == EFAULT) return false;
  }
#else
  (void)addr;
  (void)bytes;
#endif
  return true;
}

// Both ops take the same call arguments; runs op(*packed, call) without the GIL.
template <class P>
void def_op(py::module_& m, const char* name, void (*op)(const P&, const MoeCall&),
            const char* doc) {
  m.def(
      name,
      [op](py::handle packed_obj, int64_t T, int64_t k, uintptr_t x, int64_t x_stride,
           const std::string& dtype, uintptr_t topk_weights, int64_t tw_stride, uintptr_t topk_ids,
           bool ids_int64, int64_t ids_stride, const std::string& activation, bool skip_weighted,
           uintptr_t out, int64_t out_stride, int num_threads, uintptr_t expert_map,
           int64_t num_global_experts) {
        MoeCall c;
        c.num_tokens = T;
        c.topk = k;
        c.x = ptr<const void>(x);
        c.x_row_stride = x_stride;
        c.dtype = parse_dtype(dtype, "x");
        c.topk_weights = ptr<const float>(topk_weights);
        c.topk_weights_row_stride = tw_stride;
        c.topk_ids = ptr<const void>(topk_ids);
        c.topk_ids_int64 = ids_int64;
        c.topk_ids_row_stride = ids_stride;
        c.activation = parse_act(activation);
        c.skip_weighted = skip_weighted;
        c.out = ptr<void>(out);
        c.out_row_stride = out_stride;
        c.num_threads = num_threads;
        c.expert_map = expert_map ? ptr<const int32_t>(expert_map) : nullptr;
        c.num_global_experts = num_global_experts;
        const std::shared_ptr<const P> packed = packed_of<P>(packed_obj);  // alive throughout
        py::gil_scoped_release nogil;
        // Only a span the op's own checks would accept is probed (they give the other errors).
        const int64_t H = packed->hidden();
        int64_t span = 0;
        if (out != 0 && T > 0 && out_stride >= H &&
            !__builtin_mul_overflow(T - 1, out_stride, &span) &&
            !__builtin_add_overflow(span, H, &span) &&
            !__builtin_mul_overflow(span, int64_t(dtype_size(c.dtype)), &span) &&
            out + uint64_t(span) > out && !writable_pages(out, size_t(span)))
          throw ArgumentError(
              "out: its memory is not writable (a tensor over a read-only array or mapping, "
              "e.g. torch.from_numpy of a read-only array: torch tensors carry no read-only flag)");
        op(*packed, c);
      },
      py::arg("packed"), py::arg("T"), py::arg("k"), py::arg("x"), py::arg("x_stride"),
      py::arg("dtype"), py::arg("topk_weights"), py::arg("topk_weights_stride"),
      py::arg("topk_ids"), py::arg("topk_ids_int64"), py::arg("topk_ids_stride"),
      py::arg("activation"), py::arg("skip_weighted"), py::arg("out"), py::arg("out_stride"),
      py::arg("num_threads"), py::arg("expert_map") = 0, py::arg("num_global_experts") = 0, doc);
}

py::dict features_dict() {
  const CpuFeatures& f = cpu_features();
  py::dict d;
  d["arch"] = target_arch();
#define CPUMOE_FEATURE(x) d[#x] = f.x;
  CPUMOE_FEATURE(neon)
  CPUMOE_FEATURE(dotprod)
  CPUMOE_FEATURE(i8mm)
  CPUMOE_FEATURE(bf16)
  CPUMOE_FEATURE(sve)
  CPUMOE_FEATURE(avx2)
  CPUMOE_FEATURE(fma)
  CPUMOE_FEATURE(avx512f)
  CPUMOE_FEATURE(avx512bw)
  CPUMOE_FEATURE(avx512vl)
  CPUMOE_FEATURE(avx512vnni)
  CPUMOE_FEATURE(avx512bf16)
  CPUMOE_FEATURE(avx_vnni)
  CPUMOE_FEATURE(f16c)
  CPUMOE_FEATURE(amx_tile)
  CPUMOE_FEATURE(amx_int8)
  CPUMOE_FEATURE(amx_bf16)
#undef CPUMOE_FEATURE
  return d;
}

// The fields MoeWeights and MoeWeightsBf16 share, from prepack's / prepack_bf16's arguments
// (weights of the struct's element type at w13 / w2; a bias address of 0 means none).
template <class W>
void fill_weights(W* w, int64_t E, int64_t H, int64_t I, uintptr_t w13, uintptr_t w2,
                  uintptr_t b13, const std::string& b13_dtype, uintptr_t b2,
                  const std::string& b2_dtype) {
  using Elem = std::remove_const_t<std::remove_pointer_t<decltype(w->w13)>>;
  w->num_experts = E;
  w->hidden = H;
  w->intermediate = I;
  w->w13 = ptr<const Elem>(w13);
  w->w2 = ptr<const Elem>(w2);
  w->b13 = b13 ? ptr<const void>(b13) : nullptr;
  w->b2 = b2 ? ptr<const void>(b2) : nullptr;
  if (b13) w->b13_dtype = parse_dtype(b13_dtype, "b13");
  if (b2) w->b2_dtype = parse_dtype(b2_dtype, "b2");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpumoe native core (use the cpumoe package, not this module directly)";
  // Raised for bad argument values; a ValueError to Python callers.
  py::register_exception<ArgumentError>(m, "ArgumentError", PyExc_ValueError);

  m.def("formats", &formats_list,
        "The weight formats (weight_format.h's table): name, bits, value_code, scale, "
        "scale_bytes, group, group_size, group_max, zero_point, family, activations, prepack.");
  m.def("activations", &activations_list,
        "The op's activations: name, interleaved (gate/up at even/odd columns), params (name -> "
        "default, None when required), formula.");
  m.def(
      "parse_activation",
      [](const std::string& text) {
        const ActivationSpec s = parse_act(text);
        return py::make_tuple(activation_name(s.kind), activation_spec_str(s), s.limit, s.alpha);
      },
      py::arg("spec"),
      "(name, canonical spec, limit, alpha) of an activation spec such as 'silu' or "
      "'silu_clamp(limit=10)' (limit and alpha as fp32); ValueError when it cannot run.");
  m.def("cpu_features", &features_dict, "Features of the running CPU that cpumoe kernels use.");
  m.def("target_arch", &target_arch);
  m.def("isa_ladder", [] {
    py::list out;
    for (Isa isa : isa_ladder()) out.append(isa_name(isa));
    return out;
  }, "ISA levels of this architecture, best first.");
  // A yes/no query (cpu_has): asks the OS for nothing (AMX: no tile-state request).
  m.def("cpu_supports", [](const std::string& isa) { return cpu_has(parse_isa(isa, "isa")); });
  m.def("env_isa_cap", []() -> std::optional<std::string> {
    const Isa* cap = env_isa_cap();
    if (cap == nullptr) return std::nullopt;
    return std::string(isa_name(*cap));
  }, "The cap set by CPUMOE_ISA, or None.");
  m.def("amx_peak", [](int threads, double seconds) -> std::optional<py::dict> {
    if (threads < 1 || threads > 4096) throw ArgumentError("threads: must be in [1, 4096]");
    if (!(seconds > 0 && seconds <= 60)) throw ArgumentError("seconds: must be in (0, 60]");
    AmxPeak peak;
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = measure_amx_peak(threads, seconds, &peak);
    }
    if (!ok) return std::nullopt;
    py::dict d;
    d["int8_ops"] = peak.int8_ops;
    d["bf16_flops"] = peak.bf16_flops;
    return d;
  }, py::arg("threads"), py::arg("seconds") = 0.2,
     "Peak of the AMX tile units (tile-only loop on `threads` threads): {'int8_ops', "
     "'bf16_flops'} per second, or None without AMX.");
  m.def("kernels", [] { return kernel_list(qgemm_registry()); },
        "The int8 GEMM kernels compiled in, best first.");
  m.def("bf16_kernels", [] { return kernel_list(bgemm_registry()); },
        "The bf16 GEMM kernels compiled in, best first.");
  m.def("select_kernel",
        [](std::optional<std::string> isa) { return config_for(isa, int8_config).gemm->name; },
        py::arg("isa") = py::none(),
        "Name of the kernel prepack would use (capped by isa and CPUMOE_ISA).");
  m.def("select_bf16_kernel",
        [](std::optional<std::string> isa) { return config_for(isa, bf16_config).gemm->name; },
        py::arg("isa") = py::none(),
        "Name of the kernel prepack_bf16 would use (capped by isa and CPUMOE_ISA).");

  m.def("w4_kernels", [] { return kernel_list(q4gemm_registry()); },
        "The W4A8 GEMM kernels compiled in, best first.");
  m.def("select_w4_kernel",
        [](std::optional<std::string> isa) { return config_for(isa, w4_config).gemm->name; },
        py::arg("isa") = py::none(),
        "Name of the kernel the q4gemm formats' prepack would use (capped by isa and CPUMOE_ISA).");

  m.def("f8_kernels", [] { return kernel_list(f8gemm_registry()); },
        "The fp8 (W8A16) GEMM kernels compiled in, best first.");
  m.def("select_f8_kernel",
        [](std::optional<std::string> isa) { return config_for(isa, fp8_config).gemm->name; },
        py::arg("isa") = py::none(),
        "Name of the kernel prepack_fp8 would use (capped by isa and CPUMOE_ISA).");

  def_packed<PackedMoe>(m);
  def_packed<PackedMoeBf16>(m);
  def_packed<PackedMoeW4>(m)
      .def_property_readonly(
          "group_size", [](py::handle h) { return packed_of<PackedMoeW4>(h)->group_size(); })
      .def_property_readonly("act_quant", [](py::handle h) {
        return packed_of<PackedMoeW4>(h)->act_quant() == ActQuant::group ? "group" : "row";
      });
  def_packed<PackedMoeFp8>(m)
      .def_property_readonly("block_size",
                             [](py::handle h) {
                               const auto p = packed_of<PackedMoeFp8>(h);
                               return py::make_tuple(p->block_n(), p->block_k());
                             })
      .def_property_readonly(
          "code_bits", [](py::handle h) { return packed_of<PackedMoeFp8>(h)->code_bits(); },
          "Bits per packed weight: 8 (E4M3 codes), or 4 (W4A16 from prepack_int4 / "
          "prepack_mxfp4 with act_quant='bf16', on a kernel that keeps 4-bit codes).");

  m.def(
      "prepack",
      [](int64_t E, int64_t H, int64_t I, uintptr_t w13, uintptr_t w2, uintptr_t s13, uintptr_t s2,
         uintptr_t b13, const std::string& b13_dtype, uintptr_t b2, const std::string& b2_dtype,
         std::optional<std::string> isa, int num_threads) {
        MoeWeights w;
        fill_weights(&w, E, H, I, w13, w2, b13, b13_dtype, b2, b2_dtype);
        w.s13 = ptr<const float>(s13);
        w.s2 = ptr<const float>(s2);
        const MoeConfig<QGemmUkernel> config = config_for(isa, int8_config);
        py::gil_scoped_release nogil;
        return std::make_shared<PackedMoe>(w, config, num_threads);
      },
      py::arg("E"), py::arg("H"), py::arg("I"), py::arg("w13"), py::arg("w2"), py::arg("s13"),
      py::arg("s2"), py::arg("b13"), py::arg("b13_dtype"), py::arg("b2"), py::arg("b2_dtype"),
      py::arg("isa"), py::arg("num_threads"),
      "Packs dense int8 expert weights (addresses of contiguous buffers).");

  m.def(
      "prepack_bf16",
      [](int64_t E, int64_t H, int64_t I, uintptr_t w13, uintptr_t w2, uintptr_t b13,
         const std::string& b13_dtype, uintptr_t b2, const std::string& b2_dtype,
         std::optional<std::string> isa, int num_threads) {
        MoeWeightsBf16 w;
        fill_weights(&w, E, H, I, w13, w2, b13, b13_dtype, b2, b2_dtype);
        const MoeConfig<BGemmUkernel> config = config_for(isa, bf16_config);
        py::gil_scoped_release nogil;
        return std::make_shared<PackedMoeBf16>(w, config, num_threads);
      },
      py::arg("E"), py::arg("H"), py::arg("I"), py::arg("w13"), py::arg("w2"), py::arg("b13"),
      py::arg("b13_dtype"), py::arg("b2"), py::arg("b2_dtype"), py::arg("isa"),
      py::arg("num_threads"), "Packs dense bf16 expert weights (addresses of contiguous buffers).");

  m.def(
      "prepack_w4",
      [](int64_t E, int64_t H, int64_t I, const std::string& format, int64_t group, uintptr_t w13,
         uintptr_t w2, uintptr_t s13, uintptr_t s2, uintptr_t b13, const std::string& b13_dtype,
         uintptr_t b2, const std::string& b2_dtype, std::optional<std::string> isa,
         int num_threads, const std::string& act_quant) {
        MoeWeightsW4 w;
        if (act_quant != "row" && act_quant != "group")
          throw ArgumentError("act_quant: must be 'row' or 'group', got '" + act_quant + "'");
        w.act_quant = act_quant == "group" ? ActQuant::group : ActQuant::row;
        w.num_experts = E;
        w.hidden = H;
        w.intermediate = I;
        WeightFormat f;
        if (!parse_weight_format(format.c_str(), &f) || !w4_format_of(f, &w.format))
          throw ArgumentError("format: must be one of " +
                              weight_format_names(KernelFamily::q4gemm) + ", got '" + format +
                              "'");
        w.group_size = group;
        w.w13 = ptr<const void>(w13);
        w.w2 = ptr<const void>(w2);
        w.s13 = ptr<const void>(s13);
        w.s2 = ptr<const void>(s2);
        w.b13 = b13 ? ptr<const void>(b13) : nullptr;
        w.b2 = b2 ? ptr<const void>(b2) : nullptr;
        if (b13) w.b13_dtype = parse_dtype(b13_dtype, "b13");
        if (b2) w.b2_dtype = parse_dtype(b2_dtype, "b2");
        const MoeConfig<Q4GemmUkernel> config = config_for(isa, w4_config);
        py::gil_scoped_release nogil;
        return std::make_shared<PackedMoeW4>(w, config, num_threads);
      },
      py::arg("E"), py::arg("H"), py::arg("I"), py::arg("format"), py::arg("group"),
      py::arg("w13"), py::arg("w2"), py::arg("s13"), py::arg("s2"), py::arg("b13"),
      py::arg("b13_dtype"), py::arg("b2"), py::arg("b2_dtype"), py::arg("isa"),
      py::arg("num_threads"), py::arg("act_quant") = "row",
      "Packs 4-bit expert weights of a q4gemm format (formats()) in its input form "
      "(addresses of contiguous buffers).");

  m.def(
      "prepack_fp8",
      [](int64_t E, int64_t H, int64_t I, int64_t block_n, int64_t block_k, uintptr_t w13,
         uintptr_t w2, uintptr_t s13, uintptr_t s2, uintptr_t b13, const std::string& b13_dtype,
         uintptr_t b2, const std::string& b2_dtype, std::optional<std::string> isa,
         int num_threads, int code_bits, uintptr_t codebook) {
        MoeWeightsFp8 w;
        fill_weights(&w, E, H, I, w13, w2, b13, b13_dtype, b2, b2_dtype);
        w.block_n = block_n;
        w.block_k = block_k;
        w.code_bits = code_bits;
        w.codebook = ptr<const uint8_t>(codebook);
        w.s13 = ptr<const float>(s13);
        w.s2 = ptr<const float>(s2);
        const MoeConfig<F8GemmUkernel> config = config_for(isa, fp8_config);
        py::gil_scoped_release nogil;
        return std::make_shared<PackedMoeFp8>(w, config, num_threads);
      },
      py::arg("E"), py::arg("H"), py::arg("I"), py::arg("block_n"), py::arg("block_k"),
      py::arg("w13"), py::arg("w2"), py::arg("s13"), py::arg("s2"), py::arg("b13"),
      py::arg("b13_dtype"), py::arg("b2"), py::arg("b2_dtype"), py::arg("isa"),
      py::arg("num_threads"), py::arg("code_bits") = 8, py::arg("codebook") = 0,
      "Packs FP8 (E4M3) expert weights with fp32 block scales (addresses of contiguous "
      "buffers; block_k 0: the whole depth); code_bits 4: the weights are indices 0..15 into "
      "codebook (16 E4M3 codes; W4A16) and the scales may be negative.");

  def_op<PackedMoeFp8>(m, "fused_moe_fp8", fused_moe_bf16,
                       "Runs the fused BF16 MoE op on FP8 weights on raw row-major buffers.");
  def_op<PackedMoeW4>(m, "fused_moe_w4", fused_moe_int8,
                      "Runs the fused W4A8 MoE op on raw row-major buffers.");
  def_op<PackedMoe>(m, "fused_moe_int8", fused_moe_int8,
                    "Runs the fused W8A8 MoE op on raw row-major buffers (row strides in elements).");
  def_op<PackedMoeBf16>(m, "fused_moe_bf16", fused_moe_bf16,
                        "Runs the fused BF16 MoE op on raw row-major buffers (row strides in "
                        "elements).");

  m.def(
      "scratch_bytes",
      [](py::handle packed, int64_t T, int64_t k, int num_threads) {
        if (py::isinstance<PackedMoeBf16>(packed))
          return fused_moe_scratch_bytes(*packed_of<PackedMoeBf16>(packed), T, k, num_threads);
        if (py::isinstance<PackedMoeW4>(packed))
          return fused_moe_scratch_bytes(*packed_of<PackedMoeW4>(packed), T, k, num_threads);
        if (py::isinstance<PackedMoeFp8>(packed))
          return fused_moe_scratch_bytes(*packed_of<PackedMoeFp8>(packed), T, k, num_threads);
        return fused_moe_scratch_bytes(*packed_of<PackedMoe>(packed), T, k, num_threads);
      },
      py::arg("packed"), py::arg("T"), py::arg("k"), py::arg("num_threads"),
      "Upper bound of the scratch bytes of one call with T tokens and k slots each.");
  m.def("thread_scratch_bytes", &thread_scratch_bytes,
        "Scratch bytes the calling thread holds now (kept for its next call).");
  m.def("release_thread_scratch", &release_thread_scratch, "Frees the calling thread's scratch.");
}
