"""The capacity planner: the worked example exactly, presets, the fit decision, and its CLI."""

from __future__ import annotations

import json

import pytest

from kvstore.errors import ConfigError, KVStoreError
from kvstore.pages.shapes import PRESETS
from kvstore.tools.plan import format_plan, parse_params, plan

GIB, MIB = 1 << 30, 1 << 20
EXAMPLE = dict(layers=32, kv_heads=32, head_dim=128, dtype="fp16", context=4096, concurrency=20)


def test_worked_example_exactly():
    p = plan(**EXAMPLE)
    assert p["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert p["kv_bytes_per_sequence"] == 2147483648 == 2 * GIB
    assert p["kv_pool_bytes"] == 40 * GIB
    assert p["kv_pool_bytes_with_margin"] == 50 * GIB          # default margin 0.25
    assert p["weights_bytes"] == 0 and p["params"] is None
    assert any("weights counted as 0" in note for note in p["notes"])
    assert p["total_bytes"] == 50 * GIB
    assert p["kv_budget_bytes"] == 64 * GIB                    # 80 GiB x 0.8
    assert p["fits"] is True
    assert p["max_concurrency"] == 25                          # 64 / (2 x 1.25)
    assert p["page_bytes"] == 512 * 1024 * 16 == 8 * MIB
    assert p["pages_per_sequence"] == 256 and p["total_pages"] == 20 * 256
    assert p["budget_pages"] == 64 * GIB // (8 * MIB)


def test_worked_example_with_gqa_is_a_quarter():
    p = plan(**{**EXAMPLE, "kv_heads": 8})
    assert p["kv_bytes_per_sequence"] == 512 * MIB
    assert p["kv_pool_bytes"] == 10 * GIB
    assert p["kv_pool_bytes_with_margin"] == 12.5 * GIB


@pytest.mark.parametrize("margin, expected", [(0.2, 48 * GIB), (0.3, 52 * GIB), (0, 40 * GIB), (1, 80 * GIB)])
def test_margin_is_exact(margin, expected):
    assert plan(**EXAMPLE, margin=margin)["kv_pool_bytes_with_margin"] == expected


def test_margin_outside_recommendation_is_noted():
    assert any("recommended" in n for n in plan(**EXAMPLE, margin=0.5)["notes"])
    assert not any("recommended" in n for n in plan(**EXAMPLE, margin=0.2)["notes"])


def test_weights_with_seven_billion_params():
    p = plan(**EXAMPLE, params="7B")
    assert p["weights_bytes"] == 14_000_000_000                # fp16: 2 bytes a parameter
    assert p["total_bytes"] == 14_000_000_000 + 50 * GIB
    assert p["weights_fit"] and p["fits"]                      # 13.04 GiB <= 80 - 64 GiB


def test_weights_dtype_differs_from_kv_dtype():
    p = plan(**EXAMPLE, params=8e9, weights_dtype="fp8")
    assert p["weights_bytes"] == 8_000_000_000 and p["dtype"] == "float16"


def test_does_not_fit_when_pool_exceeds_budget():
    p = plan(**{**EXAMPLE, "concurrency": 26})               # 26 x 2.5 GiB = 65 GiB > 64 GiB
    assert not p["kv_fits"] and not p["fits"] and p["max_concurrency"] == 25
    assert any("exceeds the KV budget" in n for n in p["notes"])


def test_does_not_fit_when_weights_exceed_what_is_left():
    p = plan(**EXAMPLE, params="70B")                        # 140 GB of weights vs 16 GiB
    assert p["kv_fits"] and not p["weights_fit"] and not p["fits"]
    assert p["max_concurrency"] == 0


def test_fits_exactly_at_the_boundary():
    # 25 sequences x 2 GiB x 1.25 = 62.5 GiB; a 62.5 GiB budget holds exactly that.
    p = plan(**{**EXAMPLE, "concurrency": 25}, gpu_mem_gib=125, kv_mem_ratio=0.5)
    assert p["kv_pool_bytes_with_margin"] == p["kv_budget_bytes"] and p["fits"]


def test_partial_pages_round_up():
    p = plan(**{**EXAMPLE, "context": 4097})
    assert p["pages_per_sequence"] == 257


def test_presets():
    p = plan(model="llama-3-8b", context=8192, concurrency=4)
    assert p["kv_bytes_per_token"] == 131072                   # 2 x 32 x 8 x 128 x 2 (bf16)
    assert p["page_bytes"] == 2 * MIB
    assert p["params"] == PRESETS["llama-3-8b"].num_params
    assert 8.0e9 < p["params"] < 8.1e9
    assert p["weights_bytes"] == 2 * p["params"]
    assert plan(model="llama-3-70b", context=1, concurrency=1)["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert plan(model="qwen2-7b", context=1, concurrency=1)["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2


def test_params_parsing():
    assert parse_params("8B") == parse_params("8e9") == parse_params(8e9) == 8_000_000_000
    assert parse_params("500M") == 500_000_000 and parse_params("1.5b") == 1_500_000_000
    for bad in ("eight", "-8", "0", "8X", True):
        with pytest.raises(ConfigError, match="--params"):
            parse_params(bad)


@pytest.mark.parametrize("change, flag", [
    ({"page_size": 12}, "--page-size"),
    ({"page_size": 0}, "--page-size"),
    ({"kv_mem_ratio": 1.0}, "--kv-mem-ratio"),
    ({"kv_mem_ratio": 0}, "--kv-mem-ratio"),
    ({"margin": 1.5}, "--margin"),
    ({"margin": -0.1}, "--margin"),
    ({"gpu_mem_gib": 0}, "--gpu-mem-gib"),
    ({"gpu_mem_gib": float("nan")}, "--gpu-mem-gib"),
    ({"context": 0}, "--context"),
    ({"concurrency": -1}, "--concurrency"),
    ({"layers": 0}, "--layers"),
    ({"dtype": "int3"}, "--dtype"),
])
def test_invalid_inputs_name_the_flag(change, flag):
    with pytest.raises(ConfigError) as info:
        plan(**{**EXAMPLE, **change})
    assert info.value.key == flag


def test_model_or_dimensions():
    with pytest.raises(KVStoreError, match="--head-dim"):
        plan(layers=32, kv_heads=8, context=1, concurrency=1)
    with pytest.raises(KVStoreError, match="not both"):
        plan(model="tiny", layers=2, context=1, concurrency=1)
    with pytest.raises(ConfigError, match="preset"):
        plan(model="no-such-model", context=1, concurrency=1)


def test_table_shows_the_numbers():
    text = format_plan(plan(**EXAMPLE))
    assert "2147483648" in text and "40.00 GiB" in text and "fits" in text


def test_cli_json_reproduces_the_worked_example(kvstore_cli):
    out = kvstore_cli("plan", "--layers", 32, "--kv-heads", 32, "--head-dim", 128, "--dtype", "fp16",
                      "--context", 4096, "--concurrency", 20, "--json")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["kv_bytes_per_sequence"] == 2147483648 and p["kv_pool_bytes"] == 40 * GIB
    for key in ("kv_bytes_per_token", "kv_pool_bytes_with_margin", "weights_bytes", "total_bytes", "fits",
                "max_concurrency", "page_bytes", "pages_per_sequence", "total_pages", "kv_budget_bytes"):
        assert key in p
    out = kvstore_cli("plan", "--layers", 32, "--kv-heads", 8, "--head-dim", 128, "--dtype", "fp16",
                      "--context", 4096, "--concurrency", 20, "--params-b", 7, "--json")
    p = json.loads(out.stdout)
    assert p["kv_bytes_per_sequence"] == 512 * MIB and p["kv_pool_bytes"] == 10 * GIB
    assert p["weights_bytes"] == 14_000_000_000


def test_cli_table_for_a_preset(kvstore_cli):
    out = kvstore_cli("plan", "--model", "llama-3-8b", "--context", 8192, "--concurrency", 32)
    assert out.returncode == 0, out.stderr
    assert "131072 bytes" in out.stdout and "fits" in out.stdout


@pytest.mark.parametrize("args, key", [
    (["--model", "tiny", "--context", "16", "--concurrency", "1", "--page-size", "12"], "--page-size"),
    (["--model", "tiny", "--context", "16", "--concurrency", "1", "--kv-mem-ratio", "1.2"], "--kv-mem-ratio"),
    (["--model", "nope", "--context", "16", "--concurrency", "1"], "model"),
    (["--layers", "2", "--context", "16", "--concurrency", "1"], "--kv-heads"),
    (["--model", "tiny", "--context", "16", "--concurrency", "1", "--params", "8", "--params-b", "8"],
     "--params-b"),
])
def test_cli_invalid_input_is_one_line(kvstore_cli, args, key):
    out = kvstore_cli("plan", *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvstore: error: ")
    assert key in out.stderr and "Traceback" not in out.stderr


def test_cli_missing_required_flag_is_a_usage_error(kvstore_cli):
    out = kvstore_cli("plan", "--model", "tiny", "--context", "16")
    assert out.returncode == 2 and "--concurrency" in out.stderr and "Traceback" not in out.stderr
