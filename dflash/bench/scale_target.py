"""Random-weight Muse Glimmer targets and the acceptance replay, shared by two processes.

This module imports ``mlx`` and ``mlx_lm`` only. ``dflash-bench --scale`` imports it as
``dflash.bench.scale_target``; the public DFlash loop's runner (``benchmarks/peer_dflash.py``,
a subprocess whose ``dflash`` is the public package) loads it by file path. Both build the
target through :func:`build_target`, so one seed gives the same weights in both processes.

Weights. Every matrix is ``N(0, 0.02)`` in the target dtype, seeded per parameter; a norm
weight is its module's initial value plus ``N(0, 0.02)``. Two choices make the target's
greedy continuation decided by wide logit margins, so a 1-token step and a 16-token verify
forward pick the same token (in bf16 and in 4-bit) and a replayed acceptance profile holds
exactly: the post-attention / post-feed-forward norms scale each residual branch by about
0.05 (the embedding stays the dominant direction of the residual stream), and the LM head's
rows are the embedding rows in a seeded random order, scaled so the chosen token's logit is
about 10 before the soft-cap. The greedy continuation is then close to a fixed random
permutation walk over the vocabulary. Shapes, dtypes and bytes are exactly the geometry's.
"""

from contextlib import redirect_stdout
from io import StringIO
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import muse_glimmer

# mlx-lm's ModelArgs defaults are the full-size geometry (52 layers = 39 sliding + 13 full).
GEOMETRIES: Dict[str, Dict[str, Any]] = {
    "full": {},
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=8,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        sliding_window=32,
        max_position_embeddings=4096,
    ),
}
# Target forms: bf16, or mlx-lm's affine quantization as (bits, group size); the plain
# names take mlx-lm's default group of 64, ``-gN`` names another group size.
QUANT_GROUP_SIZE = 64
QUANT_FORMS = {
    f"{bits}bit{'' if group == QUANT_GROUP_SIZE else f'-g{group}'}": (bits, group)
    for bits in (4, 8)
    for group in (64, 32, 128)
}
QUANTS = ("bf16", *QUANT_FORMS)
INIT_STD = 0.02
BRANCH_SCALE = 0.05
TOP_LOGIT = 10.0
_DAMPED_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
# Added to a replayed proposal's logit: far above any soft-capped logit.
REPLAY_BOOST = 1.0e4


def target_args(geometry: str) -> muse_glimmer.ModelArgs:
    """mlx-lm's Muse Glimmer arguments for a named geometry.

    Args:
        geometry: ``"full"`` (mlx-lm's defaults) or ``"tiny"``.

    Returns:
        The model arguments.
    """
    if geometry not in GEOMETRIES:
        raise ValueError(
            f"geometry must be one of {sorted(GEOMETRIES)}, got {geometry!r}"
        )
    return muse_glimmer.ModelArgs(**GEOMETRIES[geometry])


def _keys(seed: int, count: int) -> mx.array:
    return mx.random.split(mx.random.key(seed), max(count, 2))


def randomize(
    module: nn.Module,
    seed: int,
    dtype: mx.Dtype = mx.bfloat16,
    branch_scale: Optional[float] = None,
    chunk: int = 16,
) -> None:
    """Give every parameter of ``module`` seeded random values in ``dtype``, in place.

    The module's own (lazy, float32) initial matrices are never evaluated, so no float32
    copy of a large model is made; parameters are evaluated ``chunk`` at a time.

    Args:
        module: Any mlx module (a target or a drafter).
        seed: Seed; parameter ``i`` (in ``tree_flatten`` order) uses key ``i`` of its split.
        dtype: Parameter dtype.
        branch_scale: If set, norms named ``post_attention_layernorm`` /
            ``post_feedforward_layernorm`` (zero-centred) scale their branch by about this.
        chunk: Parameters evaluated together.
    """
    params = tree_flatten(module.parameters())
    keys = _keys(seed, len(params))
    for start in range(0, len(params), chunk):
        update = []
        for index in range(start, min(start + chunk, len(params))):
            name, value = params[index]
            noise = (
                mx.random.normal(value.shape, dtype=dtype, key=keys[index]) * INIT_STD
            )
            if value.ndim >= 2:
                update.append((name, noise))
            elif branch_scale is not None and name.endswith(_DAMPED_NORMS):
                update.append((name, noise + (branch_scale - 1.0)))
            else:
                update.append((name, value.astype(dtype) + noise))
        module.update(tree_unflatten(update))
        mx.eval([value for _, value in update])


def _decisive_head(model: nn.Module, seed: int) -> None:
    """LM-head rows = the embedding rows in a seeded order, scaled to a top logit ~10."""
    args = model.args
    table = model.model.embed_tokens.weight
    order = mx.random.permutation(args.vocab_size, key=mx.random.key(seed + 7919))
    # The scaleless-normed embedding has RMS 1, so its dot with its own raw row is
    # about hidden_size * INIT_STD.
    gain = TOP_LOGIT / (args.output_multiplier * args.hidden_size * INIT_STD)
    head = mx.take(table, order, axis=0) * gain
    model.lm_head.weight = head.astype(table.dtype)
    mx.eval(model.lm_head.weight)


def build_target(
    geometry: str = "full", quant: str = "bf16", seed: int = 0
) -> nn.Module:
    """A random-weight mlx-lm Muse Glimmer model (see the module docstring).

    Args:
        geometry: ``"full"`` or ``"tiny"``.
        quant: ``"bf16"`` or a name of :data:`QUANT_FORMS` (mlx-lm's
            ``quantize_model``, affine: ``"4bit"`` / ``"8bit"`` in groups of 64,
            ``"4bit-g32"`` ... ``"8bit-g128"`` in groups of 32 or 128).
        seed: Weight seed.

    Returns:
        The model, evaluated, in eval mode.
    """
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {list(QUANTS)}, got {quant!r}")
    args = target_args(geometry)
    model = muse_glimmer.Model(args)
    randomize(model, seed, mx.bfloat16, branch_scale=BRANCH_SCALE)
    _decisive_head(model, seed)
    if quant in QUANT_FORMS:
        quantize_as(model, quant)
        mx.eval(model.parameters())
        mx.clear_cache()
    model.eval()
    return model


def quantize_as(model: nn.Module, quant: str) -> None:
    """Quantize ``model`` in place by mlx-lm's ``quantize_model`` as the name
    ``quant`` of :data:`QUANT_FORMS` says (bits and group size)."""
    from mlx_lm.utils import quantize_model

    bits, group_size = QUANT_FORMS[quant]
    with redirect_stdout(StringIO()):  # it prints bits per weight
        quantize_model(model, {}, group_size, bits)


def random_prompt(vocab_size: int, length: int, seed: int, index: int = 0) -> mx.array:
    """Seeded random prompt tokens.

    Args:
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
        length: Prompt length.
        seed: Run seed.
        index: Prompt index (each index gives another prompt).

    Returns:
        The prompt.

    Shapes:
        returns ``(length,)`` uint32.
    """
    key = mx.random.key(1_000_003 * (seed + 1) + index)
    return mx.random.randint(0, vocab_size, (length,), key=key).astype(mx.uint32)


def replay_tokens(
    sequence: Sequence[int], position: int, count: int, tau: int, vocab_size: int
) -> List[int]:
    """Drafts that a target with greedy continuation ``sequence`` accepts ``tau - 1`` of.

    The block's first token sits at absolute ``position``; draft ``i`` (1-based) proposes
    the token at ``position + i``: ``sequence``'s own for ``i < tau``, then a wrong one.

    Args:
        sequence: Prompt plus the target's greedy continuation.
        position: Absolute position of the block's first (committed) token.
        count: Drafts wanted (block size minus one).
        tau: Tokens committed per round in the profile (``>= 1``).
        vocab_size: Vocabulary size (wrong tokens stay inside it).

    Returns:
        ``count`` token ids.
    """
    out = []
    for i in range(1, count + 1):
        at = position + i
        truth = sequence[at] if at < len(sequence) else 0
        out.append(truth if i < tau else (truth + 1) % vocab_size)
    return out


def replay_logits(real: mx.array, tokens: Sequence[int], first_row: int) -> mx.array:
    """``real`` plus a boost that makes row ``first_row + j``'s argmax ``tokens[j]``.

    The real drafter logits stay in the graph, so the drafter forward runs in full.

    Args:
        real: The drafter's logits.
        tokens: Proposed tokens for rows ``first_row ..``.
        first_row: Row of ``tokens[0]``; earlier rows are left as they are.

    Returns:
        Logits of the same shape and dtype.

    Shapes:
        real: ``(1, R, V)``; returns ``(1, R, V)``.
    """
    rows = real.shape[1]
    wanted = [-1] * first_row + list(tokens)
    wanted = (wanted + [-1] * rows)[:rows]
    hits = mx.arange(real.shape[-1])[None, :] == mx.array(wanted, mx.int32)[:, None]
    return real + (hits.astype(real.dtype) * REPLAY_BOOST)[None]


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (packed weights, scales and biases when quantized)."""
    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))


def embedding_bytes(model: nn.Module) -> int:
    """Bytes of the input embedding table (weights, scales and biases)."""
    table = model.model.embed_tokens
    return sum(value.nbytes for _, value in tree_flatten(table.parameters()))


def step_read_bytes(model: nn.Module, kv_bytes: int = 0) -> int:
    """Bytes a 1-token decode step must read: weights once (one embedding row) plus KV.

    Args:
        model: An mlx-lm model with ``model.embed_tokens``.
        kv_bytes: Bytes of the KV cache the step attends over.

    Returns:
        The byte count.
    """
    table = embedding_bytes(model)
    if not hasattr(model, "lm_head"):  # tied: the table is the head, read in full
        return parameter_bytes(model) + kv_bytes
    rows = model.model.embed_tokens.weight.shape[0]
    return parameter_bytes(model) - table + table // rows + kv_bytes
