"""Run the public DFlash MLX loader (PyPI ``dflash`` 0.1.0) on a drafter we saved.

Both packages are named ``dflash``, so ``tests/test_loader.py`` runs this file's
source with ``python -c`` in a fresh interpreter whose working directory is not a
checkout of ours, with the public package's folder first on ``sys.path``. Their
``load_draft`` fetches through ``huggingface_hub.snapshot_download``; the caller
points ``HF_HUB_CACHE`` at a local cache holding the drafter and sets
``HF_HUB_OFFLINE=1``, so nothing touches the network.

The request (``argv[1]``, JSON) names the public package folder, the saved target
folder, the drafter's repo id in that cache, the prompt, the anchor token, how
many tokens their loop generates and the output file. The output holds the tokens
their greedy loop generated, the target's tapped features, their drafter's logits
and draft tokens for one block, and their parsed config as metadata.
"""

import dataclasses
import json
import sys
from pathlib import Path


def main() -> None:
    request = json.loads(sys.argv[1])
    peer = Path(request["peer_src"]).resolve()
    sys.path.insert(0, str(peer))
    import dflash

    origin = Path(dflash.__file__).resolve()
    if peer not in origin.parents:
        raise SystemExit(f"imported dflash from {origin}, not from {peer}")
    import mlx.core as mx
    from mlx_lm import load

    from dflash import model_mlx

    target, tokenizer = load(request["target"])
    draft = model_mlx.load_draft(request["repo_id"])
    # Their whole loop first (greedy), then one block by hand.
    generated = [
        token
        for response in model_mlx.stream_generate(
            target,
            draft,
            tokenizer,
            request["prompt"],
            max_tokens=request["max_tokens"],
        )
        for token in response.tokens
    ]
    draft.bind(target)
    # Their loop's own tap: it wraps the tapped decoder layers of the target.
    model_mlx._patch_model(target, draft.config.target_layer_ids)
    target(mx.array([request["prompt"]]))
    hidden = mx.concatenate(target._hidden_states, axis=-1)
    size = int(draft.config.block_size)
    block = mx.array([[request["anchor"]] + [draft.config.mask_token_id] * (size - 1)])
    logits = draft(block, hidden, draft.make_cache(), logits_start=1)
    if isinstance(draft, model_mlx.DFlash2DraftModel):
        tokens = draft.propose(block, hidden, draft.make_cache(), 0.0, logits_start=1)
        tokens = tokens[0]
    else:
        tokens = mx.argmax(logits, axis=-1)
    config = dataclasses.asdict(draft.config)
    config["class"] = type(draft).__name__
    mx.save_safetensors(
        request["out"],
        {
            "hidden": hidden,
            "logits": logits,
            "tokens": tokens.astype(mx.int32),
            "generated": mx.array(generated, dtype=mx.int32),
        },
        metadata={"config": json.dumps(config)},
    )


if __name__ == "__main__":
    main()
