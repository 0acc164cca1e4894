"""The native kernels beside attention (linear.cpp, layer_ops.cpp) against PyTorch: projections
within float32 rounding of F.linear and bit-identical whatever the batch around a row or the
threads; RoPE and the K/V write bit-identical to the reference ops; RMSNorm and SwiGLU within
rounding; inputs laid out otherwise go to PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layer_ops import TORCH_OPS
from engine.model import Projection, RMSNorm, native_linear_library
from conftest import requires

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture
def native_kernels(monkeypatch):
    """The kernels where they can run, on any CPU: where `auto` would not pick them (neither AVX-512
    nor AVX2: they run, exactly, but were not measured there), Projection is made to take them."""
    from engine.attention import native
    why = native.available(torch.float32)
    requires(why is None, f"the native kernels do not run here: {why}")
    monkeypatch.setattr(native, "preferred", lambda: None)


def ops():
    from engine.attention import native
    return native.NativeLayerOps(native.load())


def projection(n: int, k: int, bias: bool, seed: int = 0) -> tuple[Projection, nn.Linear]:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    ref = nn.Linear(k, n, bias=bias)
    ref.load_state_dict(lin.state_dict())
    proj = Projection(lin, prepack=True)
    assert proj.native is not None and proj.packed is None
    return proj, ref


@pytest.mark.parametrize("n,k", [(5, 1), (48, 7), (100, 64), (960, 576), (49, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_projection_is_f_linear_within_rounding(n, k, bias):
    proj, ref = projection(n, k, bias)
    with torch.no_grad():
        for m in (1, 3, 8, 9, 17, 70):
            x = torch.randn(m, k)
            torch.testing.assert_close(proj(x), ref(x), atol=2e-5, rtol=1e-5)


def test_projection_rows_are_the_same_bits_in_any_batch_and_thread_count():
    proj, _ = projection(200, 576, bias=True, seed=1)
    x = torch.randn(70, 576)
    before = torch.get_num_threads()
    with torch.no_grad():
        whole = proj(x)
        alone = torch.cat([proj(x[i:i + 1]) for i in range(70)])
        in_thirteens = torch.cat([proj(x[i:i + 13]) for i in range(0, 70, 13)])
        try:
            torch.set_num_threads(1)
            one_thread = proj(x)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(whole, alone) and torch.equal(whole, in_thirteens) and torch.equal(whole, one_thread)


def test_projection_of_a_strided_or_foreign_input_goes_to_pytorch():
    proj, ref = projection(64, 32, bias=True)
    with torch.no_grad():
        x = torch.randn(6, 64)[:, ::2]            # a column stride the kernel does not read
        torch.testing.assert_close(proj(x), ref(x), atol=2e-5, rtol=1e-5)
        with pytest.raises(RuntimeError):         # the wrong width is refused, as F.linear refuses it
            proj(torch.randn(3, 31))


def test_bfloat16_weights_are_not_packed_natively():
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert native_linear_library(w) is None


@pytest.mark.parametrize("tokens", [1, 8, 700])
def test_layer_ops_against_the_reference(tokens):
    native = ops()
    g = torch.Generator().manual_seed(tokens)
    x, delta = torch.randn(tokens, 576, generator=g), torch.randn(tokens, 576, generator=g)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x_ref, x_nat = x.clone(), x.clone()
    expected, got = TORCH_OPS.add_rms_norm(x_ref, delta, norm), native.add_rms_norm(x_nat, delta, norm)
    assert torch.equal(x_ref, x_nat)                      # the residual: one rounding, the same
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.add_rms_norm(x, None, norm), TORCH_OPS.add_rms_norm(x, None, norm),
                               atol=1e-5, rtol=1e-5)

    gate_up = torch.randn(tokens, 2 * 1536, generator=g) * 6
    torch.testing.assert_close(native.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up), atol=1e-5, rtol=1e-5)

    nh, nkv, d = 9, 3, 64
    qkv = torch.randn(tokens, (nh + 2 * nkv) * d, generator=g)
    cos, sin = torch.randn(tokens, 1, d, generator=g), torch.randn(tokens, 1, d, generator=g)
    kv_ref = torch.zeros(2, 100, 16, nkv, d)
    kv_nat = kv_ref.clone()
    rows = torch.randperm(1600, generator=g)[:tokens]
    q_ref = TORCH_OPS.rope_write(qkv, cos, sin, kv_ref, rows, nh, nkv, d)
    q_nat = native.rope_write(qkv, cos, sin, kv_nat, rows, nh, nkv, d)
    assert torch.equal(q_ref, q_nat) and torch.equal(kv_ref, kv_nat)


def test_layer_ops_of_other_layouts_go_to_pytorch():
    native = ops()
    norm = RMSNorm(32, 1e-6)
    x = torch.randn(4, 64)[:, ::2]
    torch.testing.assert_close(native.add_rms_norm(x.clone(), None, norm), norm(x))
    gate_up = torch.randn(4, 128)[:, ::2]
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up), F.silu(gate) * up)
    x16 = torch.randn(4, 32, dtype=torch.bfloat16)
    norm16 = RMSNorm(32, 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(native.add_rms_norm(x16.clone(), None, norm16), norm16(x16))
