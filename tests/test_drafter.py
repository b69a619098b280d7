"""DFlash drafter: shapes, attention pattern, incremental context cache, DFlash2 parts."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY_DFLASH2, tiny_drafter_config, tiny_model
from mlx.utils import tree_flatten
from mlx_lm.models import muse_glimmer, qwen3

from dflash.drafter import (
    ARCH_DFLASH2,
    DFlashDrafter,
    DrafterConfig,
    GroupedDynamicCausalConv,
)

HIDDEN = 64
VOCAB = 256
MASK = 255
TAPS = (1, 4, 6)
WINDOW = 8


def muse_target() -> muse_glimmer.Model:
    return tiny_model("muse_glimmer", seed=11, window=32)


def qwen3_target() -> qwen3.Model:
    return tiny_model(
        "qwen3",
        seed=12,
        num_hidden_layers=8,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )


def tiny_config(**overrides) -> DrafterConfig:
    fields = dict(hidden_size=HIDDEN, sliding_window=WINDOW, block_size=4)
    fields.update(mask_token_id=MASK, target_layer_ids=TAPS)
    return tiny_drafter_config(**{**fields, **overrides})


DFLASH2 = dict(TINY_DFLASH2, architecture=ARCH_DFLASH2, vocab_size=VOCAB)


def make_drafter(target, seed: int = 3, **overrides) -> DFlashDrafter:
    mx.random.seed(seed)
    drafter = DFlashDrafter(tiny_config(**overrides))
    for layer in drafter.layers:
        if layer.has_conv:
            # Zero base kernels would hide half of the convolution.
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = 0.5 * mx.random.normal(conv.base_kernel.shape)
    mx.eval(drafter.parameters())
    drafter.bind(target)
    return drafter


def features(rows: int, seed: int = 5) -> mx.array:
    return mx.random.normal((1, rows, len(TAPS) * HIDDEN), key=mx.random.key(seed))


def block(first: int = 7, size: int = 4) -> mx.array:
    return mx.array([[first] + [MASK] * (size - 1)])


def filled_context(drafter, chunks):
    context = drafter.make_context()
    all_rows = features(sum(chunks))
    start = 0
    for count in chunks:
        drafter.append_context(context, all_rows[:, start : start + count], start)
        start += count
    return context, all_rows


def reference_logits(drafter: DFlashDrafter, hidden: mx.array, tokens: mx.array):
    """Full-history recomputation: K/V of every context row plus the block, from scratch.

    Context rows go to k_proj/v_proj straight from fc + hidden_norm (no
    input_layernorm); attention is written out by hand with explicit masks.
    """
    cfg = drafter.config
    n, size = hidden.shape[1], tokens.shape[1]
    context = drafter.hidden_norm(drafter.fc(hidden))
    h = drafter.embed(tokens)
    rope = drafter._rope
    q_pos = n + mx.arange(size)[:, None]
    k_pos = mx.arange(n + size)[None, :]
    for index, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        if layer.has_conv:
            x, dynamic = layer.attention_conv.prepare(x)
        q = attn.q_proj(x).reshape(1, size, cfg.num_attention_heads, cfg.head_dim)
        q = rope(attn.q_norm(q).transpose(0, 2, 1, 3), offset=n)
        rows = mx.concatenate([context, x], axis=1)
        k = attn.k_proj(rows).reshape(1, n + size, cfg.num_key_value_heads, -1)
        k = rope(attn.k_norm(k).transpose(0, 2, 1, 3), offset=0)
        v = attn.v_proj(rows).reshape(1, n + size, cfg.num_key_value_heads, -1)
        v = v.transpose(0, 2, 1, 3)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
        scores = (q * cfg.head_dim**-0.5) @ k.swapaxes(-1, -2)
        allowed = mx.ones(scores.shape[-2:], dtype=mx.bool_)
        if cfg.is_sliding(index):
            allowed = allowed & (mx.abs(q_pos - k_pos) < cfg.sliding_window)
        if cfg.block_causal(index):
            allowed = allowed & (k_pos <= q_pos)
        scores = mx.where(allowed, scores, -mx.inf)
        out = mx.softmax(scores, axis=-1) @ v
        out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, size, -1))
        if layer.has_conv:
            out = layer.attention_conv.finish(out, dynamic)
        h = h + out
        x = layer.post_attention_layernorm(h)
        if layer.has_conv:
            x, dynamic = layer.mlp_conv.prepare(x)
        x = layer.mlp(x)
        if layer.has_conv:
            x = layer.mlp_conv.finish(x, dynamic)
        h = h + x
    return drafter.logits(drafter.norm(h))


@pytest.fixture(scope="module")
def target():
    return muse_target()


def test_forward_shapes_and_parameters(target):
    drafter = make_drafter(target)
    context, _ = filled_context(drafter, [6])
    logits = drafter(block(), context)
    assert logits.shape == (1, 4, VOCAB)
    assert drafter.hidden_states(block(), context).shape == (1, 4, HIDDEN)
    proposal = drafter.propose(block(), context)
    assert proposal.tokens.shape == (1, 3) and proposal.probs is None
    names = [name for name, _ in tree_flatten(drafter.parameters())]
    assert not [n for n in names if "embed" in n or "lm_head" in n or "rope" in n]
    assert "fc.weight" in names and "hidden_norm.weight" in names


def test_in_block_attention_is_bidirectional(target):
    drafter = make_drafter(target)
    context, _ = filled_context(drafter, [6])
    tokens = block()
    changed = mx.array([[7, MASK, MASK, 42]])
    before, after = drafter(tokens, context), drafter(changed, context)
    for position in range(3):
        assert not mx.allclose(before[0, position], after[0, position], atol=1e-6)


def test_causal_block_hides_later_tokens(target):
    drafter = make_drafter(target, is_causal=True)
    context, _ = filled_context(drafter, [6])
    before = drafter(block(), context)
    after = drafter(mx.array([[7, MASK, MASK, 42]]), context)
    assert mx.array_equal(before[0, :3], after[0, :3])
    assert not mx.allclose(before[0, 3], after[0, 3], atol=1e-6)


def test_sliding_layers_keep_window_minus_one_rows(target):
    drafter = make_drafter(target)
    context = drafter.make_context()
    rows = features(40)
    for start, stop in [(0, 5), (5, 14), (14, 15), (15, 40)]:
        drafter.append_context(context, rows[:, start:stop], start)
        assert context.rows(0) == min(stop, WINDOW - 1)
        assert context.rows(1) == stop
    assert context.offset == 40


@pytest.mark.parametrize("is_causal", [False, None, True])
@pytest.mark.parametrize("chunks", [[1], [13, 1, 7, 19], [3, 300, 1, 250, 2]])
def test_incremental_context_matches_full_recomputation(target, is_causal, chunks):
    drafter = make_drafter(target, is_causal=is_causal)
    context, rows = filled_context(drafter, chunks)
    got = drafter(block(9), context)
    want = reference_logits(drafter, rows, block(9))
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4), mx.abs(got - want).max()
    # A block does not leak into the committed context.
    again = drafter(block(9), context)
    assert mx.array_equal(got, again)


def test_dflash2_forward_matches_full_recomputation(target):
    drafter = make_drafter(target, **DFLASH2)
    context, rows = filled_context(drafter, [5, 11, 2])
    got = drafter(block(3, size=6), context)
    want = reference_logits(drafter, rows, block(3, size=6))
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4)


def test_append_context_discontinuity_fails_closed(target):
    drafter = make_drafter(target)
    context, rows = filled_context(drafter, [5])
    before = drafter(block(), context)
    state = (context.offset, context.rows(0), context.rows(1))
    for wrong in (4, 6, 0):
        with pytest.raises(ValueError, match=f"expected start_position 5, got {wrong}"):
            drafter.append_context(context, features(3), wrong)
    with pytest.raises(ValueError, match=r"\(batch, n, 192\)"):
        drafter.append_context(context, mx.zeros((1, 2, 64)), 5)
    assert (context.offset, context.rows(0), context.rows(1)) == state
    assert mx.array_equal(drafter(block(), context), before)


def test_logit_scale_comes_from_target_unless_set(target):
    drafter = make_drafter(target)
    context, _ = filled_context(drafter, [4])
    hidden = drafter.hidden_states(block(), context)
    raw = target.lm_head(hidden)
    mult, cap = target.args.output_multiplier, target.args.final_logit_softcapping
    assert (drafter.logit_multiplier, drafter.logit_softcap) == (mult, cap)
    want = mx.tanh(raw * mult / cap) * cap
    assert mx.allclose(drafter.logits(hidden), want, atol=1e-6)

    own = make_drafter(target, output_multiplier=0.5, final_logit_softcapping=3.0)
    assert (own.logit_multiplier, own.logit_softcap) == (0.5, 3.0)

    plain = qwen3_target()
    bare = make_drafter(plain)
    assert (bare.logit_multiplier, bare.logit_softcap) == (None, None)
    context, _ = filled_context(bare, [4])
    hidden = bare.hidden_states(block(), context)
    assert mx.array_equal(bare.logits(hidden), plain.lm_head(hidden))


def test_embedding_modes(target):
    tokens = block()
    table = target.model.embed_tokens(tokens)
    raw = make_drafter(target)
    assert mx.array_equal(raw.embed(tokens), table)
    normed = make_drafter(target, embedding="target")
    eps = target.model.embed_eps
    assert mx.array_equal(normed.embed(tokens), mx.fast.rms_norm(table, None, eps))
    scaled = make_drafter(target, input_embedding_scale=2.0)
    assert mx.allclose(scaled.embed(tokens), 2.0 * table)


def test_unbound_drafter_refuses_to_run():
    drafter = DFlashDrafter(tiny_config())
    with pytest.raises(RuntimeError, match="bind"):
        drafter(block(), drafter.make_context())


def test_config_validation():
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        tiny_config(layer_types=("full_attention",))
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(sliding_window=None)
    with pytest.raises(ValueError, match="conv_group_size"):
        tiny_config(conv_kernel_size=2, conv_group_size=7)


def test_dynamic_conv_matches_direct_sum():
    mx.random.seed(4)
    conv = GroupedDynamicCausalConv(hidden_size=8, kernel_size=3, group_size=4)
    conv.base_kernel = mx.random.normal((2, 3, 8))
    x, y = mx.random.normal((1, 5, 8)), mx.random.normal((1, 5, 8))
    mixed, dynamic = conv.prepare(x)
    finished = conv.finish(y, dynamic)
    proj = np.array(conv.kernel_projection(x)).reshape(1, 5, 2, 3, 2)
    base = np.array(conv.base_kernel)

    def direct(values, half):
        values = np.array(values)
        out = np.zeros_like(values)
        for t in range(5):
            for lag in range(min(3, t + 1)):
                weight = base[half, lag] + np.repeat(proj[0, t, half, lag], 4)
                out[0, t] += weight * values[0, t - lag]
        return out

    assert np.allclose(np.array(mixed), direct(x, 0), atol=1e-5)
    assert np.allclose(np.array(finished), direct(y, 1), atol=1e-5)


def test_candidate_selector_greedy_path(target):
    drafter = make_drafter(target, **DFLASH2)
    context, _ = filled_context(drafter, [7])
    tokens = block(11, size=6)
    proposal = drafter.propose(tokens, context)
    hidden = np.array(drafter.hidden_states(tokens, context)[0, 1:])
    logits = np.array(drafter(tokens, context)[0, 1:])
    selector = drafter.candidate_selector
    projected = hidden @ np.array(selector.hidden_projection.weight).T
    pred = np.array(selector.predecessor_codebook.weight)
    succ = np.array(selector.successor_codebook.weight)
    previous, path = 11, []
    for t in range(5):
        candidates = np.argsort(-logits[t])[: selector.top_k]
        scores = logits[t, candidates] + (
            pred[previous] * projected[t] * succ[candidates]
        ).sum(-1)
        previous = int(candidates[np.argmax(scores)])
        path.append(previous)
    assert proposal.tokens[0].tolist() == path


def test_candidate_selector_sampled_distribution(target):
    drafter = make_drafter(target, **DFLASH2)
    context, _ = filled_context(drafter, [7])
    proposal = drafter.propose(block(size=5), context, 0.8, mx.random.key(1))
    probs = proposal.probs
    assert probs.shape == (1, 4, VOCAB)
    assert mx.allclose(probs.sum(axis=-1), mx.ones((1, 4)), atol=1e-5)
    assert ((probs > 0).sum(axis=-1) <= drafter.config.selector_top_k).all()
    picked = mx.take_along_axis(probs, proposal.tokens[..., None], axis=-1)
    assert (picked > 0).all()


def test_plain_propose_is_argmax(target):
    drafter = make_drafter(target)
    context, _ = filled_context(drafter, [7])
    logits = drafter(block(), context)
    assert mx.array_equal(
        drafter.propose(block(), context).tokens, mx.argmax(logits[:, 1:], axis=-1)
    )
    sampled = drafter.propose(block(), context, 1.0, mx.random.key(2))
    assert mx.allclose(sampled.probs.sum(axis=-1), mx.ones((1, 3)), atol=1e-5)


def test_config_is_a_dataclass_with_public_fields():
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    assert {
        "hidden_size",
        "layer_types",
        "sliding_window",
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "output_multiplier",
        "final_logit_softcapping",
    } <= fields


def test_lazy_outputs_survive_later_appends(target):
    # Block rows are written into the context's scratch rows; a later append reuses
    # them, and a still-unevaluated earlier result must not see that.
    drafter = make_drafter(target)
    context, rows = filled_context(drafter, [6])
    pending = drafter(block(), context)
    want = reference_logits(drafter, rows, block())
    drafter.append_context(context, features(9, seed=8), 6)
    assert mx.allclose(pending, want, atol=2e-5, rtol=1e-4)
