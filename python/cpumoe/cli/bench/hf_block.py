"""``cpumoe bench --model PRESET``: a Hugging Face transformers MoE block per experts backend.

One MoE block (the model's own class, router included) of the preset's real shapes with random
bf16 weights, called as the model calls it, once per experts_implementation: transformers'
``eager`` and ``grouped_mm`` and cpumoe's backend of each weight format (``cpumoe`` for W8A8,
``cpumoe_bf16``, ``cpumoe_<format>``: the weights re-rounded to the format), at each T
(default 1, 16, 128, 512). Plus, as the yardsticks of the backend's own cost, ``router+op``: the
block's router and :func:`cpumoe.fused_moe_int8` called by hand on the same packed layer, and
``experts`` / ``op``: the experts module on the "cpumoe" backend and the op alone, both on one
fixed routing. Then a
2-layer model of the preset's width (attention, norms, a ``--vocab``-sized head) per backend:
one decode step after a 128-token prompt (KV cache) and one 128-token prefill.

Timing: per point the contenders alternate in ``--rounds`` rounds (rotated order), each round
about ``--seconds`` / rounds of calls per contender, so a slow spell of a shared machine hits
them all; the medians and minima are over all calls. Speed-ups are ratios of medians to
``grouped_mm`` (the transformers backend its documentation calls the most efficient on CPUs).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .. import problem

#: preset -> (transformers config class, config kwargs); shapes (H, I, E, k) are problem.PRESETS'.
MODEL_CONFIGS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128)),
    "gpt-oss-20b": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64)),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8)),
}
#: transformers' own experts implementations, timed beside cpumoe's (cpumoe.transformers.BACKENDS:
#: one per weight format, each packed once up front, the float weights kept for the others).
HF_BACKENDS = ("eager", "grouped_mm")
BY_HAND = "router+op"
EXPERTS = "experts"  # the experts module alone on the "cpumoe" backend
OP = "op"  # cpumoe.fused_moe_int8 alone
BLOCK_TOKENS = [1, 16, 128, 512]
PROMPT = 128


def _shape(cfg) -> tuple:
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts")
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return cfg.hidden_size, inter, E, cfg.num_experts_per_tok


def model_config(preset: str, layers: int, vocab: int, transformers):
    """The transformers config of a preset's model with ``layers`` decoder layers."""
    cls_name, kw = MODEL_CONFIGS[preset]
    kw = dict(kw, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=4096)
    if cls_name == "GptOssConfig":
        kw["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    cfg = getattr(transformers, cls_name)(**kw)
    H, I, E, k, _, _ = problem.PRESETS[preset]
    if _shape(cfg) != (H, I, E, k):  # the two tables must describe the same layer
        raise AssertionError(f"{preset}: transformers config {_shape(cfg)} != preset "
                             f"{(H, I, E, k)}")
    return cfg


def _build(preset: str, layers: int, vocab: int, torch, transformers):
    cfg = model_config(preset, layers, vocab, transformers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                          experts_implementation="eager")
    return model.eval()


def _alternate(contenders: Dict[str, Callable[[], Any]], setup: Callable[[str], None],
               seconds: float, rounds: int,
               before: Optional[Callable[[str], None]] = None) -> Dict[str, List[float]]:
    """Per-call times (s) of each contender, alternating in rounds. ``setup(name)`` runs before
    a contender's calls of a round, ``before(name)`` before each call; neither is timed."""
    names = list(contenders)
    prep = before or (lambda name: None)
    est = {}
    for n in names:
        setup(n)
        prep(n)
        contenders[n]()  # warm-up (first call: packing, allocations)
        prep(n)
        t0 = time.perf_counter()
        contenders[n]()
        est[n] = max(time.perf_counter() - t0, 1e-6)
    calls = {n: int(min(200, max(1, seconds / rounds / est[n]))) for n in names}
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            setup(n)
            fn = contenders[n]
            for _ in range(calls[n]):
                prep(n)
                t0 = time.perf_counter()
                fn()
                times[n].append(time.perf_counter() - t0)
    return times


def _rows(preset: str, what: str, times: Dict[str, List[float]]) -> List[Dict[str, Any]]:
    med = {n: float(np.median(t)) for n, t in times.items()}
    base = med.get("grouped_mm")
    return [{"preset": preset, "point": what, "backend": n, "ms_median": med[n] * 1e3,
             "ms_min": float(np.min(t)) * 1e3, "calls": len(t),
             "speedup_vs_grouped_mm": base / med[n] if base else None}
            for n, t in times.items()]


def _print_rows(rows: List[Dict[str, Any]], out) -> None:
    for r in rows:
        sp = r["speedup_vs_grouped_mm"]
        print(f"{r['preset']:<14} {r['point']:<14} {r['backend']:<12} {r['ms_median']:>10.2f} "
              f"{r['ms_min']:>10.2f} {sp:>8.2f}x {r['calls']:>6}", file=out)
    out.flush()


def _block_points(preset, tokens, args, torch, transformers, cmt, cpumoe, out):
    cpumoe_backends = tuple(cmt.BACKENDS)
    backends = (*HF_BACKENDS, *cpumoe_backends)
    model = _build(preset, 1, 256, torch, transformers)
    for backend in cpumoe_backends:
        cmt.prepare(model, backend, keep_float_weights=True)
    block = model.model.layers[0].mlp
    experts = block.experts
    router = getattr(block, "gate", None) or getattr(block, "router")
    state = experts._cpumoe_state["int8"]
    H = model.config.hidden_size
    rows = []
    rng = torch.Generator().manual_seed(1)
    for T in tokens:
        x = torch.randn((1, T, H), generator=rng).to(torch.bfloat16)
        x2 = x.reshape(T, H)

        def by_hand():
            _, w, ids = router(x2)
            return cpumoe.fused_moe_int8(x2, state.packed, w.float(), ids, state.activation)

        with torch.inference_mode():
            _, w0, ids0 = router(x2)  # one routing, for the two rows without the router
        w0f = w0.float()
        conts = {b: (lambda: block(x)) for b in backends}
        conts[BY_HAND] = by_hand
        # The backend's own cost: the experts module on the "cpumoe" backend against the op on
        # the same routing (both without the router and the block's code).
        conts[EXPERTS] = lambda: experts(x2, ids0, w0)
        conts[OP] = lambda: cpumoe.fused_moe_int8(x2, state.packed, w0f, ids0, state.activation)

        def setup(name):
            if name in backends:
                model.set_experts_implementation(name)
            elif name == EXPERTS:
                model.set_experts_implementation("cpumoe")

        with torch.inference_mode():
            times = _alternate(conts, setup, args.seconds, args.rounds)
        r = _rows(preset, f"block T={T}", times)
        _print_rows(r, out)
        rows += r
    del model, block, experts, state
    return rows


def _model_points(preset, args, torch, transformers, cmt, out):
    cpumoe_backends = tuple(cmt.BACKENDS)
    backends = (*HF_BACKENDS, *cpumoe_backends)
    model = _build(preset, 2, args.vocab, torch, transformers)
    for backend in cpumoe_backends:
        cmt.prepare(model, backend, keep_float_weights=True)
    rng = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, args.vocab, (1, PROMPT), generator=rng)
    step = torch.randint(0, args.vocab, (1, 1), generator=rng)
    caches = {}

    def setup(name):
        model.set_experts_implementation(name)

    with torch.inference_mode():
        for b in backends:  # each backend's own prompt cache
            setup(b)
            caches[b] = model(prompt, use_cache=True).past_key_values
        holder = {}

        def fresh_cache(name):  # every decode step starts from the prompt's cache
            holder[name] = copy.deepcopy(caches[name])

        conts = {b: (lambda b=b: model(step, past_key_values=holder[b], use_cache=True))
                 for b in backends}
        times = _alternate(conts, setup, args.seconds, args.rounds, before=fresh_cache)
        rows = _rows(preset, f"decode@{PROMPT}", times)
        _print_rows(rows, out)
        conts = {b: (lambda: model(prompt, use_cache=False)) for b in backends}
        r = _rows(preset, f"prefill {PROMPT}", _alternate(conts, setup, args.seconds,
                                                          args.rounds))
        _print_rows(r, out)
    return rows + r


def run_model(args) -> int:
    """The ``--model`` run of ``cpumoe bench`` (argument parsing in cli/bench/__init__.py)."""
    out = sys.stdout
    try:
        import torch
        import transformers
        import cpumoe
        import cpumoe.transformers as cmt
    except ImportError as e:
        print(f"cpumoe bench --model: needs torch and transformers>=5 (pip install "
              f"'cpumoe[transformers]'): {e}", file=sys.stderr)
        return 2
    presets = args.model
    tokens = BLOCK_TOKENS if args.tokens is problem.BENCH_TOKENS else args.tokens
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, cpumoe path {cpumoe.selected_path()} "
          f"(int8) / {cpumoe.selected_path(op='bf16')} (bf16); bf16 activations, random weights; "
          f"whole model: 2 layers, vocab {args.vocab}", file=out)
    print(f"{'preset':<14} {'point':<14} {'backend':<12} {'ms median':>10} {'ms min':>10} "
          f"{'vs g_mm':>9} {'calls':>6}", file=out)
    rows: List[Dict[str, Any]] = []
    try:
        for preset in presets:
            rows += _block_points(preset, tokens, args, torch, transformers, cmt, cpumoe, out)
            if not args.no_whole_model:
                rows += _model_points(preset, args, torch, transformers, cmt, out)
    finally:
        torch.set_num_threads(threads_before)
    over = [(r["preset"], r["point"]) for r in rows if r["backend"] == BY_HAND]
    for preset, point in over:
        med = {r["backend"]: r["ms_median"] for r in rows
               if r["preset"] == preset and r["point"] == point}
        print(f"backend  {preset} {point}: experts module {med[EXPERTS]:.3f} ms vs the op "
              f"{med[OP]:.3f} ms ({(med[EXPERTS] / med[OP] - 1) * 100:+.1f}%); 'cpumoe' block "
              f"{med['cpumoe']:.3f} ms vs router+op by hand {med[BY_HAND]:.3f} ms "
              f"({(med['cpumoe'] / med[BY_HAND] - 1) * 100:+.1f}%)", file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "vocab": args.vocab, "rows": rows}, f, indent=1)
    return 0


def add_args(p) -> None:
    """The --model options (a hook in cli/bench/__init__.py's parser)."""
    p.add_argument("--model", type=problem.name_list(list(MODEL_CONFIGS), list(MODEL_CONFIGS),
                                                     "model"),
                   default=None,
                   help="time one transformers MoE block (router included) of these presets "
                        "(comma-separated or all) per experts backend: eager, grouped_mm "
                        "and cpumoe's of each weight format, at T=1,16,128,512 "
                        "(or --tokens), and a 2-layer "
                        "model's decode step and 128-token prefill (needs transformers)")
    p.add_argument("--vocab", type=problem.positive_int, default=4096,
                   help="--model: vocabulary of the 2-layer model (default: 4096, so the head "
                        "does not hide the layers)")
    p.add_argument("--no-whole-model", action="store_true",
                   help="--model: only the block, not the 2-layer model")
