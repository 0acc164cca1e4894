"""Capacity planner (`kvstore plan`): how big a KV pool a workload needs, and whether it fits.

    KV per token    = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    per sequence    = context x KV per token
    pool            = concurrency x per sequence
    pool + margin   = pool x (1 + margin)      20-30% for the prefix cache and scheduling slack
    weights         = parameters x bytes per element of the weights dtype
    KV budget       = GPU memory x kv_mem_ratio
    fits            = pool + margin <= KV budget  and  weights <= GPU memory - KV budget

Worked example: 32 layers, 32 KV heads, head dim 128, fp16, 4096 tokens, 20 sequences ->
512 KiB a token, 2 GiB a sequence, a 40 GiB pool (GQA with 8 KV heads: a quarter of each).
Activations and framework overhead are not estimated: they share GPU memory - KV budget
with the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from fractions import Fraction
from typing import Any

from kvstore.config import format_size
from kvstore.errors import ConfigError, KVStoreError
from kvstore.pages.shapes import PRESETS, load_shape
from kvstore.pages.spec import DTYPES, canonical_dtype, is_power_of_two

GIB = 1 << 30
RECOMMENDED_MARGIN = (0.2, 0.3)
_PARAMS_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_PARAMS_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_params(value: Any) -> int:
    """A parameter count from 8000000000, 8e9, '8B', '70b' or '500M'."""
    if isinstance(value, bool):
        raise ConfigError("--params", value, "must be a positive count such as 8e9 or 8B")
    if isinstance(value, (int, float)):
        count = Fraction(str(value)) if math.isfinite(value) else Fraction(0)
    else:
        m = _PARAMS_RE.match(str(value))
        if not m:
            raise ConfigError("--params", value, "must be a positive count such as 8e9 or 8B")
        count = Fraction(m.group(1)) * _PARAMS_UNITS[m.group(2).lower()]
    if count <= 0:
        raise ConfigError("--params", value, "must be a positive count such as 8e9 or 8B")
    return round(count)


def _exact(x: float | int) -> Fraction:
    """The decimal a user typed (0.2 is 1/5, not the nearest binary float)."""
    return Fraction(str(x))


def _positive_int(flag: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(flag, value, "must be a positive integer")
    return value


def _number(flag: str, value: Any, allowed: str, ok) -> Fraction:
    try:
        exact = _exact(float(value))
    except (TypeError, ValueError):
        raise ConfigError(flag, value, f"must be {allowed}") from None
    if not math.isfinite(float(value)) or not ok(exact):
        raise ConfigError(flag, value, f"must be {allowed}")
    return exact


def plan(*, context: int, concurrency: int, model: str | None = None,
         layers: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
         params: int | float | str | None = None, dtype: str = "bf16", weights_dtype: str | None = None,
         gpu_mem_gib: float = 80.0, kv_mem_ratio: float = 0.8, margin: float = 0.25,
         page_size: int = 16) -> dict:
    """The plan for one workload, as a flat dict of numbers (bytes are ints). Raises ConfigError."""
    if model is not None:
        given = [flag for flag, v in (("--layers", layers), ("--kv-heads", kv_heads),
                                      ("--head-dim", head_dim)) if v is not None]
        if given:
            raise KVStoreError(f"give --model or {', '.join(given)}, not both")
        shape = load_shape(model)
        layers, kv_heads, head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        if params is None:
            params = shape.num_params
    else:
        missing = [flag for flag, v in (("--layers", layers), ("--kv-heads", kv_heads),
                                        ("--head-dim", head_dim)) if v is None]
        if missing:
            raise KVStoreError("plan needs --model PRESET_OR_DIR, or all of --layers, --kv-heads and "
                               f"--head-dim (missing {', '.join(missing)})")
    for flag, value in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim),
                        ("--context", context), ("--concurrency", concurrency)):
        _positive_int(flag, value)
    if not is_power_of_two(page_size):
        raise ConfigError("--page-size", page_size, "must be a positive power of two (e.g. 16)")
    kv_dtype = canonical_dtype(dtype, "--dtype")
    w_dtype = canonical_dtype(weights_dtype or dtype, "--weights-dtype")
    gpu = _number("--gpu-mem-gib", gpu_mem_gib, "a number of GiB > 0", lambda v: v > 0)
    ratio = _number("--kv-mem-ratio", kv_mem_ratio, "a number in (0, 1), e.g. 0.8", lambda v: 0 < v < 1)
    slack = _number("--margin", margin, "a number in [0, 1] (0.2 to 0.3 recommended)", lambda v: 0 <= v <= 1)
    n_params = None if params is None else parse_params(params)

    token_bytes = 2 * layers * kv_heads * head_dim * DTYPES[kv_dtype]
    seq_bytes = context * token_bytes
    pool = concurrency * seq_bytes
    pool_with_margin = math.ceil(pool * (1 + slack))
    weights = 0 if n_params is None else n_params * DTYPES[w_dtype]
    gpu_bytes = math.floor(gpu * GIB)
    budget = math.floor(gpu_bytes * ratio)
    beside_kv = gpu_bytes - budget
    kv_fits, weights_fit = pool_with_margin <= budget, weights <= beside_kv
    max_concurrency = math.floor(budget / (seq_bytes * (1 + slack))) if weights_fit else 0
    page_bytes = token_bytes * page_size
    pages_per_sequence = -(-context // page_size)

    notes = []
    if n_params is None:
        notes.append("no parameter count given: weights counted as 0 (pass --params or --params-b)")
    if not RECOMMENDED_MARGIN[0] <= float(slack) <= RECOMMENDED_MARGIN[1]:
        notes.append(f"margin {float(slack):g} is outside the recommended 0.2-0.3")
    if not kv_fits:
        notes.append(f"the KV pool with margin ({format_size(pool_with_margin)}) exceeds the KV budget "
                     f"({format_size(budget)}): lower --concurrency or --context, or raise --kv-mem-ratio")
    if not weights_fit:
        notes.append(f"the weights ({format_size(weights)}) exceed the memory beside the KV budget "
                     f"({format_size(beside_kv)}): lower --kv-mem-ratio or quantize the weights")
    notes.append(f"activations and framework overhead must also fit in the "
                 f"{format_size(max(beside_kv - weights, 0))} left beside the weights")

    return {
        "model": model,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": kv_dtype,
        "weights_dtype": w_dtype,
        "params": n_params,
        "context": context,
        "concurrency": concurrency,
        "margin": float(slack),
        "gpu_mem_bytes": gpu_bytes,
        "kv_mem_ratio": float(ratio),
        "page_size": page_size,
        "kv_bytes_per_token": token_bytes,
        "kv_bytes_per_sequence": seq_bytes,
        "kv_pool_bytes": pool,
        "kv_pool_bytes_with_margin": pool_with_margin,
        "weights_bytes": weights,
        "total_bytes": weights + pool_with_margin,
        "kv_budget_bytes": budget,
        "weights_budget_bytes": beside_kv,
        "kv_fits": kv_fits,
        "weights_fit": weights_fit,
        "fits": kv_fits and weights_fit,
        "max_concurrency": max_concurrency,
        "page_bytes": page_bytes,
        "pages_per_sequence": pages_per_sequence,
        "total_pages": concurrency * pages_per_sequence,
        "budget_pages": budget // page_bytes,
        "notes": notes,
    }


def _bytes(n: int) -> str:
    return f"{format_size(n):>12}  ({n} bytes)"


def format_plan(p: dict) -> str:
    """The plan as a readable table."""
    what = p["model"] or "model"
    params = "params unknown" if p["params"] is None else f"{p['params'] / 1e9:.2f}B params"
    rows = [
        ("KV per token", _bytes(p["kv_bytes_per_token"])),
        (f"KV per sequence ({p['context']} tokens)", _bytes(p["kv_bytes_per_sequence"])),
        (f"KV pool ({p['concurrency']} sequences)", _bytes(p["kv_pool_bytes"])),
        (f"KV pool + {p['margin']:.0%} margin", _bytes(p["kv_pool_bytes_with_margin"])),
        (f"weights ({params}, {p['weights_dtype']})", _bytes(p["weights_bytes"])),
        ("total (weights + pool + margin)", _bytes(p["total_bytes"])),
        ("GPU memory", _bytes(p["gpu_mem_bytes"])),
        (f"KV budget ({p['kv_mem_ratio']:g} of GPU memory)", _bytes(p["kv_budget_bytes"])),
        (f"page ({p['page_size']} tokens)", _bytes(p["page_bytes"])),
        ("pages per sequence / in all", f"{p['pages_per_sequence']} / {p['total_pages']}"),
        ("pages the KV budget holds", str(p["budget_pages"])),
        ("max concurrency at this context", str(p["max_concurrency"])),
        ("fits", "yes" if p["fits"] else "NO"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{what}: {p['layers']} layers x {p['kv_heads']} KV heads x {p['head_dim']} head dim, "
             f"KV in {p['dtype']}"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    lines += [f"note: {note}" for note in p["notes"]]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `kvstore plan`."""
    p = subparsers.add_parser(
        "plan", help="capacity planner: KV pool size for a model, context and concurrency, and whether it fits",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kvstore plan --model llama-3-8b --context 8192 --concurrency 32\n"
               "  kvstore plan --layers 32 --kv-heads 32 --head-dim 128 --dtype fp16 "
               "--context 4096 --concurrency 20 --params-b 7 --json")
    model = p.add_argument_group("model: a preset or directory, or explicit dimensions")
    model.add_argument("--model", metavar="PRESET_OR_DIR",
                       help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face model directory")
    model.add_argument("--layers", type=int, help="number of decoder layers")
    model.add_argument("--kv-heads", type=int, help="number of KV heads (fewer than query heads with GQA)")
    model.add_argument("--head-dim", type=int, help="dimension of one attention head")
    model.add_argument("--params", metavar="COUNT",
                       help="parameter count for the weights, e.g. 8e9 or 8B (default: the model's, else 0)")
    model.add_argument("--params-b", type=float, metavar="BILLIONS", help="parameter count in billions, e.g. 8")
    model.add_argument("--dtype", default="bf16", help="KV cache dtype: fp16, bf16, fp32 or fp8 (default bf16)")
    model.add_argument("--weights-dtype", help="weights dtype (default: --dtype)")
    load = p.add_argument_group("workload")
    load.add_argument("--context", type=int, required=True, help="tokens per sequence (prompt + output)")
    load.add_argument("--concurrency", type=int, required=True, help="sequences resident at once")
    memory = p.add_argument_group("memory")
    memory.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory in GiB (default 80)")
    memory.add_argument("--kv-mem-ratio", type=float, default=0.8,
                        help="share of GPU memory for the KV cache, in (0, 1) (default 0.8)")
    memory.add_argument("--margin", type=float, default=0.25,
                        help="headroom over the pool for prefix cache and scheduling, 0..1; "
                             "0.2-0.3 recommended (default 0.25)")
    memory.add_argument("--page-size", type=int, default=16, help="tokens per page, a power of two (default 16)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.params is not None and args.params_b is not None:
        raise KVStoreError("give --params or --params-b, not both")
    params = args.params
    if args.params_b is not None:
        params = round(_number("--params-b", args.params_b, "a positive number of billions", lambda v: v > 0)
                       * 10**9)
    result = plan(context=args.context, concurrency=args.concurrency, model=args.model, layers=args.layers,
                  kv_heads=args.kv_heads, head_dim=args.head_dim, params=params, dtype=args.dtype,
                  weights_dtype=args.weights_dtype, gpu_mem_gib=args.gpu_mem_gib,
                  kv_mem_ratio=args.kv_mem_ratio, margin=args.margin, page_size=args.page_size)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0
