"""Scripts that reproduce the bundled demo pair (target + DFlash drafter) from a fresh machine.

Run from the repository root, in order (see ``configs/demo/README.md``)::

    python -m training.prepare --out data              # corpus, tokenizer, token arrays
    python -m training.bench_prompts --data data       # configs/bench/heldout.jsonl
    python -m training.train_target --data data ...    # GPU, resumable
    python -m training.distill --data data ...         # target's greedy continuations
    python -m training.train_drafter --data data ...   # GPU, resumable
"""
