"""The drafter's decoder layer as two compiled replays (``dflash.traced_drafts``).

On the CPU the kernel path is forced as on CUDA with every launch replaced by a
stand-in whose outputs depend on every input it gets (``test_traced_layers``'s
``kernel_path_on_cpu``): the traced draft layers then give the eager patch's outputs
over rounds whose positions move, so every runtime value reaches the replays as an
input (a trace that keeps its first position fails: the negative control). Speed is
not measured here (no GPU in session 45).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn
import pytest
import test_traced_layers
from conftest import TINY_DFLASH2, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dflash_loop import random_drafter

from dflash import dflash_generate_step, kernel_patch, traced_drafts
from dflash.drafter import DraftDecoderLayer
from dflash.kernel_patch import KernelPatch
from dflash.metal import backend, heads

# The kernel path forced as on CUDA, every launch a stand-in (a fixture).
kernel_path_on_cpu = test_traced_layers.kernel_path_on_cpu


def _pair(seed: int, **drafter_fields):
    target = tiny_model("muse_glimmer", seed=seed, window=16)
    drafter = random_drafter(target, seed=seed + 1, block_size=8, **drafter_fields)
    return target, drafter


def _is_traced(layer: nn.Module) -> bool:
    return type(layer).__name__ == "KernelDraftDecoderLayer"


def draft_rounds(
    target, drafter, traced: bool, appends: List[int], qkv: bool = False
) -> List[mx.array]:
    """Block hidden states after a 20-row prefill and then each append of ``appends``
    rows (positions move; the sliding plane drops rows), under the patch with the
    drafter's head prep (and with ``qkv`` its q / k / v stacked), traced or not."""
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    total = 20 + sum(appends)
    taps = mx.random.normal((1, total, width), key=mx.random.key(5))
    mask = drafter.config.mask_token_id
    block = mx.array([[3] + [mask] * (drafter.config.block_size - 1)])
    context = drafter.make_context()
    outs = []
    options = {"drafter_head_prep": True, "drafter_traced": traced, "drafter_qkv": qkv}
    with KernelPatch(target, drafter, **options):
        layers = [m for m in drafter.modules() if isinstance(m, DraftDecoderLayer)]
        assert layers and all(_is_traced(layer) is traced for layer in layers)
        start = 0
        for size in [20] + appends:
            drafter.append_context(context, taps[:, start : start + size], start)
            start += size
            out = drafter.hidden_states(block, context)
            mx.eval(out)
            outs.append(out)
    return outs


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        assert mx.array_equal(g, w).item(), f"round {index} differs"


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # patches only
)
@given(appends=st.lists(st.integers(1, 9), min_size=2, max_size=5), qkv=st.booleans())
def test_traced_draft_layers_give_the_eager_outputs_every_round(
    kernel_path_on_cpu, appends, qkv
):
    """Over rounds of any accepted counts, with or without the stacked q / k / v."""
    target, drafter = _pair(11)
    want = draft_rounds(target, drafter, False, appends, qkv)
    got = draft_rounds(target, drafter, True, appends, qkv)
    _assert_same(got, want)


def test_a_trace_that_keeps_its_first_position_is_caught(
    kernel_path_on_cpu, monkeypatch
):
    """The negative control: head-prep integers captured at the first round (a stale
    RoPE position) make the check above fail."""
    target, drafter = _pair(13)
    appends = [3, 4, 5]
    want = draft_rounds(target, drafter, False, appends)
    first = {}
    real = heads.head_prep_ints

    def stale(q_shape, k_heads, prep, stacked):
        return first.setdefault(
            (q_shape, k_heads), real(q_shape, k_heads, prep, stacked)
        )

    monkeypatch.setattr(traced_drafts.heads, "head_prep_ints", stale)
    got = draft_rounds(target, drafter, True, appends)
    assert mx.array_equal(got[0], want[0]).item()
    assert not all(mx.array_equal(g, w).item() for g, w in zip(got[1:], want[1:]))


def test_each_half_is_traced_once_and_replayed(kernel_path_on_cpu, monkeypatch):
    """The halves' Python runs at the first call (eager, counting counters) and once
    more as the trace; later rounds replay it."""
    target, drafter = _pair(15)
    calls = {"pre": 0, "post": 0}
    for name, key in (("_pre_attention", "pre"), ("_post_attention", "post")):
        real = getattr(traced_drafts, name)

        def counted(*args, _real=real, _key=key):
            calls[_key] += 1
            return _real(*args)

        monkeypatch.setattr(traced_drafts, name, counted)
    draft_rounds(target, drafter, True, [2, 3, 4, 5])
    layers = len(drafter.layers)
    assert calls == {"pre": 2 * layers, "post": 2 * layers}


def test_replacing_a_weight_drops_the_layers_traces(
    kernel_path_on_cpu,
):
    """A layer given a new array is traced again (its old trace captured the old
    one), and the output follows the new weight."""
    target, drafter = _pair(17)
    mask = drafter.config.mask_token_id
    block = mx.array([[3] + [mask] * (drafter.config.block_size - 1)])
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    context = drafter.make_context()
    taps = mx.random.normal((1, 12, width), key=mx.random.key(6))
    with KernelPatch(target, drafter, drafter_head_prep=True, drafter_traced=True):
        drafter.append_context(context, taps, 0)
        before = drafter.hidden_states(block, context)
        layer = drafter.layers[0]
        traces = layer.__dict__[kernel_patch._TRACES]
        layer.post_attention_layernorm.weight = (
            layer.post_attention_layernorm.weight * 3
        )
        after = drafter.hidden_states(block, context)
        assert layer.__dict__[kernel_patch._TRACES] is not traces
    assert not mx.array_equal(before, after).item()


def test_the_install_takes_draft_layers_only_when_asked_and_served(monkeypatch):
    """Off by default; on with its switch or argument, and then only with the drafter's
    head prep, compile and the kernel path, for layers without dynamic convolutions
    whose heads the head prep serves; a bad switch value is refused by name."""
    monkeypatch.delenv(traced_drafts.DRAFTER_TRACED_ENV, raising=False)
    monkeypatch.setattr(backend, "compile_wanted", lambda: True)
    monkeypatch.setattr(backend, "use_kernel_path", lambda use, auto: use is not False)
    target, drafter = _pair(19)
    layers = list(drafter.layers)
    assert (
        KernelPatch(target, drafter, drafter_head_prep=True).traced_draft_modules()
        == []
    )
    patch = KernelPatch(target, drafter, drafter_head_prep=True, drafter_traced=True)
    assert set(map(id, patch.traced_draft_modules())) == set(map(id, layers))
    monkeypatch.setenv(traced_drafts.DRAFTER_TRACED_ENV, "1")
    assert KernelPatch(target, drafter, drafter_head_prep=True).traced_draft_modules()
    assert not KernelPatch(target, drafter).traced_draft_modules()  # no head prep
    monkeypatch.setattr(backend, "compile_wanted", lambda: False)
    assert not KernelPatch(
        target, drafter, drafter_head_prep=True
    ).traced_draft_modules()
    monkeypatch.setattr(backend, "compile_wanted", lambda: True)
    _, dflash2 = _pair(21, **TINY_DFLASH2)
    assert not KernelPatch(
        target, dflash2, drafter_head_prep=True
    ).traced_draft_modules()  # dynamic convolutions
    rope = drafter._rope
    assert traced_drafts.serves(layers[0], rope)
    assert not traced_drafts.serves(layers[0], nn.RoPE(rope.dims, traditional=True))
    layers[0].self_attn.k_norm.weight = layers[0].self_attn.k_norm.weight.astype(
        mx.float16
    )
    assert not traced_drafts.serves(layers[0], rope)
    monkeypatch.setenv(traced_drafts.DRAFTER_TRACED_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_DRAFTER_TRACED must be 0 or 1"):
        KernelPatch(target, drafter)


def test_uninstall_restores_the_layers_and_a_reinstall_takes_the_kept_traces(
    kernel_path_on_cpu,
):
    """Leaving the patch gives the layers their class back and keeps their traces; the
    next install under the same options takes them back (no second trace), one under
    other drafter options does not."""
    target, drafter = _pair(23)
    draft_rounds(target, drafter, True, [2], qkv=True)
    layer = drafter.layers[0]
    assert type(layer) is DraftDecoderLayer
    kept = layer.__dict__[kernel_patch._KEPT_TRACES][1]
    draft_rounds(target, drafter, True, [3], qkv=True)
    assert layer.__dict__[kernel_patch._KEPT_TRACES][1] is kept
    # Without the stack (its views stay, so the layer's arrays are the same) the kept
    # traces, which launch the stacked product, are not taken.
    draft_rounds(target, drafter, True, [3], qkv=False)
    assert layer.__dict__[kernel_patch._KEPT_TRACES][1] is not kept


def test_the_dflash_loop_with_traced_draft_layers_keeps_its_tokens(
    kernel_path_on_cpu,
):
    """Inside the real DFlash loop (proposals, context appends of each round's accepted
    rows, rollbacks), the traced draft layers give the eager ones' tokens and
    log-probabilities, round after round (every launch a stand-in: the target's
    outputs are not a model's, but both runs see the same ones)."""
    target, drafter = _pair(25)
    prompt = mx.random.randint(0, 250, (24,), key=mx.random.key(26))
    runs = {}
    for traced in (False, True):
        options = {"drafter_head_prep": True, "drafter_traced": traced}
        with KernelPatch(target, drafter, **options):
            runs[traced] = [
                (int(token), logprobs)
                for token, logprobs, _ in dflash_generate_step(
                    prompt, target, drafter, max_tokens=20
                )
            ]
    assert len(runs[True]) == len(runs[False]) == 20
    for (token, logprobs), (want_token, want) in zip(runs[True], runs[False]):
        assert token == want_token and mx.array_equal(logprobs, want).item()
