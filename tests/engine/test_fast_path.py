"""The fast CPU path (fused projections, weights prepacked for oneDNN, sdpa attention) against the
reference path (separate F.linear projections, torch attention): same greedy tokens, logits within a
tolerance, and a prepacked copy never outlives a change of the weights it was made from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.loader import load_model
from engine.model import Projection, can_prepack
from kvstore.errors import ConfigError
from conftest import requires

CPU = torch.device("cpu")


def needs_onednn() -> None:
    requires(can_prepack(CPU, torch.float32), "oneDNN is not in this torch build")


def linears(seed: int = 0, bias: bool = True) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(48, n, bias=bias) for n in (32, 16, 16)]


@pytest.mark.parametrize("prepack", [False, True])
def test_projection_equals_its_linears(prepack):
    if prepack:
        needs_onednn()
    parts = linears()
    x = torch.randn(5, 48)
    with torch.no_grad():
        expected = torch.cat([m(x) for m in parts], dim=-1)
        proj = Projection(*parts, prepack=prepack)
        torch.testing.assert_close(proj(x), expected, atol=1e-5, rtol=1e-5)
        # the linears are views of the fused weight: each still gives its own output
        torch.testing.assert_close(parts[1](x), expected[:, 32:48])


@pytest.mark.parametrize("change", ["in_place", "assigned"])
def test_a_changed_weight_is_never_served_from_the_prepacked_copy(change):
    needs_onednn()
    parts = linears()
    x = torch.randn(3, 48)
    with torch.no_grad():
        proj = Projection(*parts, prepack=True)
        before = proj(x)
        if change == "in_place":
            parts[0].weight.mul_(2.0)                    # e.g. load_state_dict copying into it
        else:
            parts[0].weight = nn.Parameter(parts[0].weight * 2.0, requires_grad=False)
        after = proj(x)
        torch.testing.assert_close(after, torch.cat([m(x) for m in parts], dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after[:, :32], before[:, :32])


def test_prepacked_model_keeps_its_state_dict():
    plain = load_model("tiny", torch.float32, CPU, prepack=False).model.state_dict()
    packed = load_model("tiny", torch.float32, CPU, prepack=can_prepack(CPU, torch.float32)).model.state_dict()
    assert plain.keys() == packed.keys()
    for name in plain:
        assert torch.equal(plain[name], packed[name]), name


def test_prepack_true_where_it_cannot_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="prepack_weights"):
        LLM("tiny", dtype="float16", prepack_weights="true", data_dir=str(tmp_path), hot__device="cpu")
    with pytest.raises(ConfigError, match="prepack_weights"):
        LLM("tiny", prepack_weights="yes", data_dir=str(tmp_path), hot__device="cpu")


@pytest.mark.parametrize("backend", ["sdpa", "native"])
def test_fast_engine_gives_the_reference_engines_tokens(tmp_path, backend):
    """Batched prompts with a shared prefix (a cache hit on the second round), chunked prefill and
    decode: every greedy token of the fast path equals the reference path's."""
    common = dict(dtype="float32", hot__device="cpu", engine__prefill_chunk_tokens=24, page_size=16)
    ref = LLM("small", attention_backend="torch", prepack_weights="false", data_dir=str(tmp_path / "ref"), **common)
    fast = LLM("small", attention_backend=backend, data_dir=str(tmp_path / "fast"), **common)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(10, 8000, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(10, 8000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    prompts.append(torch.randint(10, 8000, (9,), generator=g).tolist())
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for round_ in range(2):                                # round 2 reuses the cached prefixes
        a = ref.generate(prompts, params)
        b = fast.generate(prompts, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b], f"round {round_}"
    assert sum(b[0].cached_tokens.values()) > 0
    for llm in (ref, fast):
        llm.close()


def _warm_prefix_engines(tmp_path, seed: int):
    """The reference engine and a native one that has computed a 160-token document (10 pages in
    hot), its page keys, a question over the document and the answer's sampling parameters."""
    from kvstore.pages.keys import page_keys
    common = dict(dtype="float32", hot__device="cpu", page_size=16)
    ref = LLM("small", attention_backend="torch", prepack_weights="false", data_dir=str(tmp_path / "ref"), **common)
    fast = LLM("small", attention_backend="native", data_dir=str(tmp_path / "fast"), **common)
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(10, 8000, (160,), generator=g).tolist()
    fast.generate([doc], SamplingParams(max_tokens=1))
    keys = page_keys(fast.store.namespace(""), doc, 16)[:10]
    question = doc + torch.randint(10, 8000, (20,), generator=g).tolist()
    return ref, fast, doc, keys, question, SamplingParams(max_tokens=6, ignore_eos=True)


def test_a_prefix_in_warm_is_attended_where_it_lies(tmp_path):
    """native on the CPU: a cached prefix in warm is leased there and read in place (nothing copied to
    hot, no hot slot held for it), and the answer is the one the reference engine gives."""
    ref, fast, doc, keys, question, params = _warm_prefix_engines(tmp_path, seed=2)
    fast.store.evict(keys, to="warm")
    fast.store.promote(keys, to="warm")
    assert fast.store.match(doc, fast.store.namespace("")).tiers == ["warm"] * 10
    moved = fast.store.stats()["bytes_moved"]["warm_to_hot"]
    req = fast.make_request(question, params)
    fast.submit(req)
    fast.step()                                        # admitted: the prefix leased in warm
    assert len(req.handle.spilled) == 10 and req.cached_tokens["warm"] == 160
    while fast.has_work():
        fast.step()
    assert req.output().token_ids == ref.generate([question], params)[0].token_ids
    assert fast.store.stats()["bytes_moved"]["warm_to_hot"] == moved
    assert fast.store.audit()["problems"] == []
    for llm in (ref, fast):
        llm.close()


@pytest.mark.parametrize("head", [2, 8])
def test_a_prefix_whose_head_is_in_hot_and_tail_in_warm(tmp_path, head):
    """native on the CPU: a prefix whose head is in hot and tail in warm (where eviction leaves a chain)
    is leased in warm when most of it is there (the head copied down, nothing copied up), else copied
    up to hot; either way the answer is the reference engine's."""
    ref, fast, doc, keys, question, params = _warm_prefix_engines(tmp_path, seed=3)
    fast.store.evict(keys[head:], to="warm")
    fast.store.promote(keys[head:], to="warm")
    assert fast.store.match(doc, fast.store.namespace("")).tiers == ["hot"] * head + ["warm"] * (10 - head)
    moved = fast.store.stats()["bytes_moved"]
    req = fast.make_request(question, params)
    fast.submit(req)
    fast.step()
    in_warm = head < 5
    assert len(req.handle.spilled) == (10 if in_warm else 0)
    assert req.cached_tokens["hot"] == 16 * head and req.cached_tokens["warm"] == 16 * (10 - head)
    now = fast.store.stats()["bytes_moved"]
    assert (now["warm_to_hot"] == moved["warm_to_hot"]) == in_warm
    assert (now["hot_to_warm"] > moved["hot_to_warm"]) == in_warm
    while fast.has_work():
        fast.step()
    assert req.output().token_ids == ref.generate([question], params)[0].token_ids
    assert fast.store.audit()["problems"] == []
    for llm in (ref, fast):
        llm.close()


def test_a_prefix_leased_in_warm_goes_to_hot_when_warm_cannot_take_its_head(tmp_path):
    """native on the CPU: a prefix mostly in warm whose hot head cannot get warm copies (every free warm
    slot taken) is not left unheld: it is attached in hot (its tail copied up) and the answer is the
    reference engine's."""
    ref, fast, doc, keys, question, params = _warm_prefix_engines(tmp_path, seed=4)
    fast.store.evict(keys[2:], to="warm")
    fast.store.promote(keys[2:], to="warm")
    assert fast.store.match(doc, fast.store.namespace("")).tiers == ["hot"] * 2 + ["warm"] * 8
    warm = fast.store.warm
    taken = warm.pool.alloc(warm.pool.num_free)   # no free warm slot: the head gets no warm copy
    moved = fast.store.stats()["bytes_moved"]
    req = fast.make_request(question, params)
    fast.submit(req)
    fast.step()
    assert not req.handle.spilled                      # held in hot, not leased in warm
    assert req.cached_tokens["hot"] == 32 and req.cached_tokens["warm"] == 128
    now = fast.store.stats()["bytes_moved"]
    assert now["warm_to_hot"] > moved["warm_to_hot"] and now["hot_to_warm"] == moved["hot_to_warm"]
    while fast.has_work():
        fast.step()
    assert req.output().token_ids == ref.generate([question], params)[0].token_ids
    warm.pool.free(taken)
    assert fast.store.audit()["problems"] == []
    for llm in (ref, fast):
        llm.close()
