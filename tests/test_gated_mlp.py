"""A SwiGLU MLP's activation inside the fused gate / up launch (``dflash.gated_mlp``,
the tensor-core matmul's SwiGLU form).

What is proven where:

* CPU (CI): the forward probe takes mlx-lm's SwiGLU MLPs and refuses another
  activation; off CUDA the form is never installed; through the emulated CUDA body,
  a fused ``[gate, up]`` set gives the activation of its own gate / up bits (the
  emulation's float32 sigmoid), and refuses sets it is not.
* CUDA (tests marked ``cuda``): the SwiGLU launch gives the bits of the plain launch
  followed by mlx's ``nn.silu`` and ``*`` (hypothesis, Muse Glimmer's MLP shape),
  the install probe agrees, and a patched model's logits equal the unfused patch's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import muse_glimmer
from support.compilers import GXX
from support.tensor_emulator import TensorEmulator, route_launches_to
from support.tensor_qmm_model import emulated_swiglu

from dflash import gated_mlp, kernel_patch
from dflash.cache import make_prompt_cache
from dflash.fused_projections import FusedProjections
from dflash.kernel_patch import KernelPatch
from dflash.metal import backend, tensor_qmm

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")


def glimmer_mlp(
    hidden: int, intermediate: int, dtype=mx.bfloat16, bits=4, seed=0, group_size=64
):
    """mlx-lm's Muse Glimmer MLP, random weights, quantized (``bits`` None: dense)."""
    mx.random.seed(seed)
    args = muse_glimmer.ModelArgs(hidden_size=hidden, intermediate_size=intermediate)
    mlp = muse_glimmer.MLP(args)
    mlp.set_dtype(dtype)
    if bits:
        nn.quantize(mlp, group_size=group_size, bits=bits)
    mx.eval(mlp.parameters())
    return mlp


class GeluMLP(nn.Module):
    """A gated MLP with another activation (what the forward probe must refuse)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))


def _gated(mlp: nn.Module) -> bool:
    """Whether the kernel patch swapped ``mlp`` for the SwiGLU form's class."""
    return type(mlp).__call__ is kernel_patch._gated_mlp_call


def test_forward_probe_takes_swiglu_mlps_and_refuses_another_activation() -> None:
    mlp = glimmer_mlp(64, 128, mx.float32, bits=None)
    assert gated_mlp.serves(mlp)
    assert gated_mlp.forward_matches(mlp, type(mlp))
    other = GeluMLP(64, 128)
    assert gated_mlp.serves(other)
    assert not gated_mlp.forward_matches(other, type(other))
    assert not gated_mlp.serves(nn.Linear(4, 4))


def test_off_cuda_no_mlp_takes_the_form(monkeypatch) -> None:
    monkeypatch.setattr(backend, "BACKEND", None)
    assert not gated_mlp.form_available(None)
    assert not gated_mlp.kernel_matches(mx.bfloat16, None)
    target = tiny_model("muse_glimmer", seed=1, window=16)
    with KernelPatch(target) as patch:
        assert patch.gated_mlps([]) == []


def test_it_is_opt_in_until_run_on_a_gpu(monkeypatch) -> None:
    monkeypatch.delenv(gated_mlp.SWIGLU_ENV, raising=False)
    assert not gated_mlp.swiglu_wanted()
    monkeypatch.setenv(gated_mlp.SWIGLU_ENV, "1")
    assert gated_mlp.swiglu_wanted()
    monkeypatch.setenv(gated_mlp.SWIGLU_ENV, "0")
    assert not gated_mlp.swiglu_wanted()
    assert gated_mlp.swiglu_wanted(True)
    monkeypatch.setenv(gated_mlp.SWIGLU_ENV, "maybe")
    with pytest.raises(ValueError):
        gated_mlp.swiglu_wanted()


@pytest.fixture(scope="module")
def swiglu_emulator(tmp_path_factory):
    """The emulator of the forms this file's calls take: group size 64 (Glimmer's),
    bfloat16 (a call outside them raises ``KeyError`` naming the form)."""
    if GXX is None:
        pytest.skip("g++ not installed")
    specs = [spec for spec in tensor_qmm.SPECS if "_g64" in spec.base]
    emulator = TensorEmulator(
        tmp_path_factory.mktemp("swiglu_emulator"), specs, GXX, bfloat16_only=specs
    )
    assert emulator.build.ok, emulator.build.log
    return emulator


@pytest.fixture
def emulated(swiglu_emulator, monkeypatch):
    route_launches_to(swiglu_emulator, monkeypatch)
    return swiglu_emulator


@pytest.mark.parametrize("rows", [1, 7, 16])
def test_emulated_fused_set_gives_the_activation_of_its_own_bits(emulated, rows):
    mlp = glimmer_mlp(256, 256, seed=rows)
    group = FusedProjections([mlp.gate_proj, mlp.up_proj])
    x = mx.random.normal((1, rows, 256), key=mx.random.key(rows)).astype(mx.bfloat16)
    gate = group.output(0, x, use_kernel=True)
    up = group.output(1, x, use_kernel=True)
    got = group.activated(mlp.gate_proj, mlp.up_proj, x, use_kernel=True)
    assert got.shape == (1, rows, 256)
    want = emulated_swiglu(gate, up)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    group.release()


def test_emulated_form_refuses_sets_it_is_not(emulated) -> None:
    mlp = glimmer_mlp(256, 256)
    x = mx.random.normal((1, 2, 256)).astype(mx.bfloat16)
    swapped = FusedProjections([mlp.up_proj, mlp.gate_proj])
    assert swapped.activated(mlp.gate_proj, mlp.up_proj, x, True) is None
    group = FusedProjections([mlp.gate_proj, mlp.up_proj])
    long = mx.zeros((1, tensor_qmm.MAX_ROWS + 1, 256), mx.bfloat16)
    assert group.activated(mlp.gate_proj, mlp.up_proj, long, True) is None
    narrow = glimmer_mlp(256, 96, bits=None)  # N = 192: not whole column tiles
    small = FusedProjections([narrow.gate_proj, narrow.up_proj])
    assert small.activated(narrow.gate_proj, narrow.up_proj, x, True) is None


# --------------------------------------------------------------------- CUDA


@st.composite
def cuda_cases(draw):
    bits = draw(st.sampled_from([4, 8, None]))
    depth = 256 * draw(st.integers(1, 4))
    intermediate = 64 * draw(st.integers(1, 6))
    rows = draw(st.integers(1, 32))
    dtype = draw(st.sampled_from([mx.bfloat16, mx.float16]))
    return bits, depth, intermediate, rows, dtype, draw(st.integers(0, 1 << 16))


def _assert_swiglu_is_silu_times_up(mlp, x) -> None:
    group = FusedProjections([mlp.gate_proj, mlp.up_proj])
    gate = group.output(0, x, use_kernel=True)
    up = group.output(1, x, use_kernel=True)
    want = nn.silu(gate) * up
    got = group.activated(mlp.gate_proj, mlp.up_proj, x, use_kernel=True)
    assert got is not None
    assert mx.array_equal(got, want)
    group.release()


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=cuda_cases())
def test_cuda_swiglu_form_gives_mlxs_bits(case) -> None:
    bits, depth, intermediate, rows, dtype, seed = case
    if intermediate * 2 % tensor_qmm.COLUMNS:
        intermediate += 64
    mlp = glimmer_mlp(depth, intermediate, dtype, bits, seed)
    x = mx.random.normal((1, rows, depth), key=mx.random.key(seed)).astype(dtype)
    _assert_swiglu_is_silu_times_up(mlp, x)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("group_size", tensor_qmm.GROUP_SIZES)
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_swiglu_form_gives_mlxs_bits_at_every_group_size(
    bits, group_size, rows
) -> None:
    """Each SwiGLU kernel of the default switches (its group size a constant of the
    kernel since session 28) once: silu(gate) * up of the plain launches."""
    mlp = glimmer_mlp(512, 256, mx.bfloat16, bits, rows, group_size)
    x = mx.random.normal((1, rows, 512), key=mx.random.key(rows)).astype(mx.bfloat16)
    _assert_swiglu_is_silu_times_up(mlp, x)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_swiglu_form_gives_mlxs_bits_at_glimmers_shape(rows) -> None:
    mlp = glimmer_mlp(6656, 19968, mx.bfloat16, 4, rows)
    x = mx.random.normal((1, rows, 6656), key=mx.random.key(rows)).astype(mx.bfloat16)
    _assert_swiglu_is_silu_times_up(mlp, x)


@pytest.mark.cuda
@cuda
def test_cuda_install_probe_passes_and_logits_keep_their_bits() -> None:
    assert gated_mlp.kernel_matches(mx.bfloat16, None)
    assert gated_mlp.kernel_matches(mx.float16, None)
    target = tiny_model(
        "muse_glimmer", seed=5, window=16, hidden_size=256, intermediate_size=256
    )
    target.set_dtype(mx.bfloat16)
    nn.quantize(target, group_size=64, bits=4)
    tokens = mx.random.randint(0, 200, (1, 12))
    logits = {}
    for swiglu in (True, False):
        with KernelPatch(target, swiglu=swiglu):
            assert all(_gated(layer.mlp) is swiglu for layer in target.layers)
            cache = make_prompt_cache(target)
            target(tokens[:, :8], cache)
            out = target(tokens[:, 8:], cache)
            mx.eval(out)
            logits[swiglu] = out
    assert mx.array_equal(logits[True], logits[False])


def test_a_patched_model_takes_its_mlp_activation_from_the_fused_set(monkeypatch):
    """The install and the call path, on the CPU: with the form made available, each
    Muse Glimmer MLP is swapped, asks its fused ``[gate, up]`` set for the activation
    once a served call (not for a prefill chunk past ``max_queries``), feeds it to
    ``down_proj``, and the logits keep the unswapped patch's bits; uninstalling
    restores the class."""
    monkeypatch.setattr(gated_mlp, "form_available", lambda use_kernel: True)
    monkeypatch.setattr(gated_mlp, "kernel_matches", lambda dtype, use_kernel: True)
    asked = []

    def activated(group, gate, up, x, use_kernel):
        asked.append(x.shape[1])
        return nn.silu(gate(x)) * up(x)  # what the launch computes, by mlx's ops

    monkeypatch.setattr(FusedProjections, "activated", activated)
    target = tiny_model("muse_glimmer", seed=6, window=16)
    tokens = mx.random.randint(0, 200, (1, 24))
    base = type(target.layers[0].mlp)
    with KernelPatch(target, max_queries=16, swiglu=False):
        assert not any(_gated(layer.mlp) for layer in target.layers)
        cache = make_prompt_cache(target)
        want = [target(tokens[:, :20], cache), target(tokens[:, 20:], cache)]
    assert asked == []
    with KernelPatch(target, max_queries=16, swiglu=True):
        assert all(_gated(layer.mlp) for layer in target.layers)
        cache = make_prompt_cache(target)
        got = [target(tokens[:, :20], cache), target(tokens[:, 20:], cache)]
    assert asked == [4] * len(target.layers)  # the 20-token prefill kept its own
    assert all(type(layer.mlp) is base for layer in target.layers)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w)
