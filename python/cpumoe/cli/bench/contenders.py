"""The contenders of ``cpumoe bench``: cpumoe's ops, vLLM's CPU kernels and kt-kernel's (in a
worker process of its own venv, kt_cpu.py) on one layer, each checked against the reference
before it is timed."""

from __future__ import annotations

import gc
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from .. import problem
from . import kt_cpu, vllm_cpu


INT8_CONTENDERS = ("cpumoe-int8", "vllm-int8")
BF16_CONTENDERS = ("cpumoe-bf16", "vllm-bf16", "vllm-bf16-sgl")


def _format_contenders():
    """cpumoe's op on each quantized weight format of the extension's table besides int8 (and
    bf16, which have contenders of their own): ``cpumoe-<format>`` at group (fp8: block) 128 or
    the format's fixed group, and ``cpumoe-<format>-g32`` where a multiple may be chosen."""
    from ... import ops
    out = {}
    for row in ops.formats():
        name = row["name"]
        if row["family"] in ("qgemm", "bgemm"):
            continue
        if row["group"] == "block":
            out[f"cpumoe-{name}"] = (name, 128)
        elif row["group"] == "multiple":
            out[f"cpumoe-{name}"], out[f"cpumoe-{name}-g32"] = (name, 128), (name, 32)
        else:
            out[f"cpumoe-{name}"] = (name, row["group_size"])
    for base in [n for n in out if out[n][0] in A16_FORMATS]:  # their W4A16 mode
        out[base + "-a16"] = out[base]
    return out


#: The formats with a W4A16 mode (prepack act_quant="bf16": the FP8 kernels, bf16
#: activations): contenders cpumoe-<format>[-g32]-a16.
A16_FORMATS = ("int4", "mxfp4")


# Quantized weights: (format, group size) of each contender: cpumoe's formats (4-bit, fp8) and
# vLLM's kernels as vllm_cpu says (quantized_as); the ones of one (format, group) get the same
# quantized weights.
#: GGUF Q8_0's form of the layer's own weights: int8_affine g32 with the int8 values as the codes
#: c = v + 128, each channel's scale in every group and min = -128 * scale (so the op keeps no
#: offsets): the W8A8 contender's weights exactly, read as a Q8_0 file's are.
Q8_0 = "cpumoe-q8_0"
QUANT_CONTENDERS = {**_format_contenders(), Q8_0: ("int8_affine", 32),
                 **{k.name: k.quantized_as for k in vllm_cpu.KERNELS.values()
                    if hasattr(k, "quantized_as")}}
CONTENDERS = ("cpumoe-int8", "cpumoe-bf16", "vllm-int8", "vllm-bf16", "vllm-bf16-sgl",
              *QUANT_CONTENDERS, *kt_cpu.CONTENDERS)
ALL_CONTENDERS = ("cpumoe-int8", "cpumoe-bf16", "vllm-int8", "vllm-bf16")
CHECK_TOKENS = 3


class Contender:
    """One kernel on one layer: ``fn(x, topk_weights, topk_ids, out)``.

    A contender that runs in another process (kt-kernel's) also has ``prepare(x, routes)``,
    called once per timed point with its x and numpy routings, and ``timed(n)``, which makes
    call n (routing n mod their count) and answers the seconds it measured itself; ``pause``:
    seconds to idle after its turn in a round; ``close()`` ends it."""

    def __init__(self, name: str, label: str, path: Optional[str], kernel: str,
                 weight_bytes: float, fn: Callable, ref: str):
        self.name, self.label, self.path, self.kernel = name, label, path, kernel
        # bytes read per weight element (1 int8, 2 bf16; 4-bit: 0.5 plus the group scales)
        self.weight_bytes = weight_bytes
        self.fn = fn
        self.ref = ref  # "int8" or "bf16": the reference it is checked against
        self.check: Optional[Tuple[bool, float]] = None
        self.prepare: Optional[Callable] = None
        self.timed: Optional[Callable[[int], float]] = None
        self.pause = 0.0
        self.close: Optional[Callable[[], None]] = None


def cpumoe_int8(layer, packed) -> Contender:
    """cpumoe's int8 op on ``packed`` (one of ``layer.packed(path)``)."""
    import cpumoe
    act, threads = layer.activation, layer.threads

    def fn(x, w, i, out):
        cpumoe.fused_moe_int8(x, packed, w, i, act, out=out, num_threads=threads)
    return Contender("cpumoe-int8", packed.path, packed.path, packed.kernel, 1, fn, "int8")


def _cpumoe_bf16(layer, w13b, w2b, b13, b2) -> Contender:
    import cpumoe
    packed = cpumoe.prepack_bf16(w13b, w2b, b13, b2, num_threads=layer.threads)
    act, threads = layer.activation, layer.threads

    def fn(x, w, i, out):
        cpumoe.fused_moe_bf16(x, packed, w, i, act, out=out, num_threads=threads)
    return Contender("cpumoe-bf16", "cpumoe-bf16", packed.path, packed.kernel, 2, fn, "bf16")


def _w4_weights(layer, fmt: str, g: int, w13, w2, s13, s2, b13, b2):
    """Copies of the layer's int8 experts in format ``fmt`` (cpumoe.quantize), made from the
    dequantized weights one expert at a time (the float copy of a whole layer is GBs)."""
    from ... import quantize as Q

    def one(w, s):
        return lambda e: Q.to_numpy(w[e]).astype(np.float32) * Q.to_numpy(s[e]).reshape(-1, 1)

    return Q.quantize_experts(fmt, one(w13, s13), one(w2, s2), group_size=g, b13=b13, b2=b2,
                              num_experts=w13.shape[0])


def _q8_0_weights(w13, w2, s13, s2, b13, b2):
    """The layer's int8 experts in GGUF Q8_0's form (Q8_0 above)."""
    from ... import quantize as Q

    def one(w, s):
        v = Q.to_numpy(w).astype(np.int16)
        sc = Q.to_numpy(s, float32=True)
        sc = np.broadcast_to(sc.reshape(*v.shape[:2], 1), (*v.shape[:2], v.shape[2] // 32))
        return (v + 128).astype(np.uint8), np.stack([sc, np.float32(-128) * sc], axis=-1)

    (c13, p13), (c2, p2) = one(w13, s13), one(w2, s2)
    return Q.QuantizedExperts("int8_affine", 32, c13, c2, p13, p2, b13, b2)


def _cpumoe_w4(layer, name: str, q) -> Contender:
    """cpumoe's op on ``q`` (a QuantizedExperts, packed here)."""
    import cpumoe
    fmt, g = QUANT_CONTENDERS[name]
    a16 = name.endswith("-a16")
    packed = q.prepack(num_threads=layer.threads, **({"act_quant": "bf16"} if a16 else {}))
    # W4A16 reads per weight the code (4 bits, or an E4M3 byte where the kernel widens them)
    # and an fp32 scale per group.
    per_weight = packed.code_bits / 8 + 4 / g if a16 else q.bytes_per_weight()
    act, threads = layer.activation, layer.threads

    def fn(x, w, i, out):
        cpumoe.fused_moe(x, packed, w, i, activation=act, out=out, num_threads=threads)
    return Contender(name, f"{name} {packed.path}", packed.path, packed.kernel,
                     per_weight, fn,
                     f"{fmt} g{g}" + (" bf16 activations" if a16 else ""))


def _w4_reference(name, x, q, used, wts, local_ids, act):
    """The reference of a quantized contender (cpumoe's format, or vLLM's kernel's own: see
    vllm_cpu) on the experts ``used``, and what it is called in the check's line."""
    from ... import reference as R
    sub = q.select(used)
    if name in vllm_cpu.KERNELS:
        return vllm_cpu.KERNELS[name].reference(x, sub, wts, local_ids, act)
    if name.endswith("-a16"):  # W4A16: the BF16 op on the dequantized weights
        return (R.ref_fused_moe_bf16(x, *sub.dequantized(), wts, local_ids, act, b13=sub.b13,
                                     b2=sub.b2),
                f"bf16 on {q.weight_format} g{q.group_size}")
    return (R.ref_fused_moe_experts(x, sub, wts, local_ids, act),
            f"{q.weight_format} g{q.group_size}")


def _vllm(name: str, layer, x_dtype, weights) -> Contender:
    k = vllm_cpu.KERNELS[name](*weights, activation=layer.activation, x_dtype=x_dtype)
    if name in QUANT_CONTENDERS:  # bytes per weight: codes, scales (and int4's zero points)
        per_weight = k.bytes / (layer.E * 3 * layer.H * layer.I)
    else:
        per_weight = 1 if name in INT8_CONTENDERS else 2
    return Contender(name, name, k.path, k.kernel, per_weight, k,
                     "bf16" if name in BF16_CONTENDERS else "int8")


def _dequant_bf16(lib, w, s):
    """bf16 copy of int8 weights times their per-row scales, one expert at a time."""
    E = w.shape[0]
    if lib.torch is not None:
        torch = lib.torch
        out = torch.empty(tuple(w.shape), dtype=torch.bfloat16)
        for e in range(E):
            out[e] = (w[e].to(torch.float32) * s[e].reshape(-1, 1)).to(torch.bfloat16)
        return out
    out = np.empty(w.shape, lib.dtype("bfloat16"))
    for e in range(E):
        out[e] = (w[e].astype(np.float32) * s[e].reshape(-1, 1)).astype(out.dtype)
    return out


def _check_inputs(layer):
    """x, ids, weights of the check, and (used experts, ids renumbered into them): the
    references get only the experts the check reads (a widened copy of a whole bf16 Mixtral
    layer would take 6 GB)."""
    rng = np.random.default_rng([layer.seed, 777])
    x = layer.lib.tensor(rng.standard_normal((CHECK_TOKENS, layer.H), dtype=np.float32),
                         layer.dtype)
    # Routed over a pool of experts whose fp32 copies (the references widen) fit in about 1 GB.
    n_pool = int(min(layer.E, max(layer.k, 2**30 // (4 * layer.expert_bytes))))
    pool = np.sort(rng.permutation(layer.E)[:n_pool])
    ids, wts = problem.make_routing(rng, CHECK_TOKENS, n_pool, layer.k)
    ids = pool[ids].astype(np.int32)
    used, local = np.unique(ids, return_inverse=True)
    return (x, layer.lib.tensor(ids), layer.lib.tensor(wts), used,
            layer.lib.tensor(local.reshape(ids.shape).astype(np.int32)))


def _subset(a, used):
    return None if a is None else a[used]  # a copy of the experts `used` (numpy or torch)


def _run_checks(layer, conts: List[Contender], ref, x, ids, wts) -> None:
    lib = layer.lib
    for c in conts:
        out = lib.tensor(np.zeros((x.shape[0], layer.H), np.float32), layer.dtype)
        c.fn(x, wts, ids, out)
        c.check = problem.check_one(lib, out, ref)


def _kt_or_skip(kt, name: str, layer, arrays, ref, ref_name: str, check_in, conts, skipped
                ) -> None:
    """Starts kt contender ``name`` on ``arrays`` and checks it against ``ref``; appends it to
    ``conts``, or the reason to ``skipped`` (no venv, a problem kt does not compute, a worker
    that fails, or a failed check: a kt kernel that does not match is left out of the timing)."""
    if kt is None or kt.error:
        skipped.append((name, kt.error if kt is not None else "kt-kernel is not set up"))
        return
    c = None
    try:
        c = kt_cpu.contender(kt, name, layer, arrays, ref_name)
        _run_checks(layer, [c], ref, *check_in)
    except Exception as e:  # noqa: BLE001 (a peer's trouble must not end the bench)
        ours = isinstance(e, (kt_cpu.Unsupported, kt_cpu.KtError))  # their messages say it all
        skipped.append((name, str(e) if ours else f"{type(e).__name__}: {e}"))
        if c is not None:
            c.close()
        return
    ok, rel = c.check
    if not ok:
        skipped.append((name, f"{c.kernel} fails the check against the {ref_name} reference "
                              f"(max|err|/scale {rel:.1e}, T={CHECK_TOKENS}): not timed"))
        c.close()
        return
    conts.append(c)


def build_contenders(layer, names: List[str], paths: List[str], out, kt=None
                     ) -> Tuple[List[Contender], List[Tuple[str, str]]]:
    """Makes the layer's weights, packs them for each contender, checks each against the
    reference on CHECK_TOKENS tokens, and drops the unpacked weights. Returns the contenders and
    the (name, reason) of those skipped. ``kt``: the kt_cpu.Session of the kt contenders."""
    import cpumoe
    from ... import quantize as Q
    lib = layer.lib
    t_make = layer.make()
    w13, w2, s13, s2, b13, b2 = layer.tensors
    x_dtype = getattr(lib.torch, layer.dtype) if lib.torch is not None else None
    x, ids, wts, used, local_ids = _check_inputs(layer)
    conts: List[Contender] = []
    skipped: List[Tuple[str, str]] = []

    def vllm_or_skip(name, weights):
        if lib.torch is None:
            skipped.append((name, "vLLM's kernels need --backend torch"))
            return None
        try:
            return _vllm(name, layer, x_dtype, weights)
        except vllm_cpu.Unsupported as e:
            skipped.append((name, str(e)))
            return None

    def kt_or_skip(name, arrays, ref, ref_name):
        _kt_or_skip(kt, name, layer, arrays, ref, ref_name, (x, ids, wts), conts, skipped)

    # Each reference is computed before the packing: its temporaries (several GB for a Mixtral
    # expert) then do not add to the packed copies.
    t0 = time.perf_counter()
    ref8 = None
    if any(n in INT8_CONTENDERS or n == "kt-int8" for n in names):
        ref8 = cpumoe.reference.ref_fused_moe_int8(
            x, *(_subset(a, used) for a in (w13, w2, s13, s2)), wts, local_ids, layer.activation,
            b13=_subset(b13, used), b2=_subset(b2, used))
        int8 = []
        if "cpumoe-int8" in names:
            int8 += [cpumoe_int8(layer, layer.packed(p)) for p in paths]
        if "vllm-int8" in names:
            c = vllm_or_skip("vllm-int8", (w13, w2, s13, s2, b13, b2))
            int8 += [c] if c is not None else []
        _run_checks(layer, int8, ref8, x, ids, wts)
        conts += int8
    quant = {**QUANT_CONTENDERS, **kt_cpu.QUANT}
    w4_names = [n for n in names if n in quant]
    groups = [(fmt_g, [n for n in w4_names if quant[n] == fmt_g and n != Q8_0])
              for fmt_g in dict.fromkeys(quant[n] for n in w4_names if n != Q8_0)]
    if Q8_0 in names:
        groups.append((quant[Q8_0], [Q8_0]))
    for (fmt, g), group in groups:
        if g not in Q.group_sizes(fmt, layer.H, layer.I, preferred=(g,)):
            skipped += [(n, f"group {g} does not divide H = {layer.H} and I = {layer.I}")
                        for n in group]
            continue
        q = (_q8_0_weights(w13, w2, s13, s2, b13, b2) if group == [Q8_0] else
             _w4_weights(layer, fmt, g, w13, w2, s13, s2, b13, b2))
        for name in group:
            if name.startswith("kt-"):
                ref, ref_name = _w4_reference(name, x, q, used, wts, local_ids, layer.activation)
                kt_or_skip(name, {"w13": q.w13, "w2": q.w2, "s13": q.s13, "s2": q.s2}, ref,
                           ref_name)
                continue
            if name.startswith("vllm-"):
                c = vllm_or_skip(name, (q.w13, q.s13, q.w2, q.s2, b13, b2))
                if c is None:
                    continue
            else:
                c = _cpumoe_w4(layer, name, q)
            ref, c.ref = _w4_reference(name, x, q, used, wts, local_ids, layer.activation)
            _run_checks(layer, [c], ref, x, ids, wts)
            conts.append(c)
        del q
    bf16_names = [n for n in names if n in BF16_CONTENDERS]
    kt_bf16 = [n for n in ("kt-int8", "kt-bf16") if n in names]  # kt-int8: kt quantizes bf16
    if bf16_names or kt_bf16:
        w13b, w2b = _dequant_bf16(lib, w13, s13), _dequant_bf16(lib, w2, s2)
        layer.tensors = w13 = w2 = None  # the int8 copy is packed already
        ref = None
        if bf16_names or "kt-bf16" in kt_bf16:
            ref = cpumoe.reference.ref_fused_moe_bf16(
                x, _subset(w13b, used), _subset(w2b, used), wts, local_ids, layer.activation,
                b13=_subset(b13, used), b2=_subset(b2, used))
        bf16 = []
        for name in bf16_names:
            if name == "cpumoe-bf16":
                if hasattr(cpumoe, "fused_moe_bf16"):
                    bf16.append(_cpumoe_bf16(layer, w13b, w2b, b13, b2))
                else:
                    skipped.append((name, "this cpumoe has no fused_moe_bf16"))
            else:
                c = vllm_or_skip(name, (w13b, w2b, b13, b2))
                bf16 += [c] if c is not None else []
        _run_checks(layer, bf16, ref, x, ids, wts)
        conts += bf16
        for name in kt_bf16:
            kt_or_skip(name, {"w13": w13b, "w2": w2b}, ref8 if name == "kt-int8" else ref,
                       "int8" if name == "kt-int8" else "bf16")
        del w13b, w2b
    layer.tensors = None
    gc.collect()
    print(f"weights  {layer.name}: {layer.E * layer.expert_bytes / 1e6:.1f} MB int8 (made in "
          f"{t_make:.1f} s), packed for {len(conts)} contender(s) in "
          f"{time.perf_counter() - t0:.1f} s", file=out)
    return conts, skipped
