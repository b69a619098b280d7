"""Build the demo corpus: file list, split, tokenizer and token arrays.

``python -m training.prepare --out data`` writes ``data/tokenizer/`` (tokenizer.json,
tokenizer_config.json), ``data/train.npy`` and ``data/heldout.npy`` (uint16 token ids,
documents joined by ``<|endoftext|>``) and ``data/manifest.json`` (Python version, file
counts, a digest of the sorted file list, token counts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np

from .corpus import HELDOUT_FRACTION, CorpusFile, iter_texts, list_files, stdlib_root
from .tokenizer import END_OF_TEXT, load_tokenizer, save_tokenizer, train_tokenizer


def tokenize_split(tokenizer, texts: List[str]) -> np.ndarray:
    """Token ids of ``texts``, each document followed by ``<|endoftext|>``.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``.
        texts: Documents in corpus order.

    Returns:
        A flat uint16 array.
    """
    end = tokenizer.token_to_id(END_OF_TEXT)
    pieces = []
    for encoding in tokenizer.encode_batch(texts):
        pieces.append(np.asarray(encoding.ids, dtype=np.uint16))
        pieces.append(np.asarray([end], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)


def file_list_digest(files: List[CorpusFile]) -> str:
    """SHA-256 over the sorted relative paths and their split flags."""
    digest = hashlib.sha256()
    for entry in files:
        digest.update(f"{entry.relative_path}\t{int(entry.heldout)}\n".encode())
    return digest.hexdigest()


def prepare(
    out: Path,
    root: Optional[Path] = None,
    vocab_size: int = 8192,
    max_files: Optional[int] = None,
) -> dict:
    """Write tokenizer, token arrays and manifest under ``out``.

    Args:
        out: Output folder.
        root: Stdlib folder (default: the running interpreter's).
        vocab_size: BPE vocabulary size, special tokens included.
        max_files: Use only the first files of the sorted list (tests).

    Returns:
        The manifest written to ``out/manifest.json``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(root) if root is not None else stdlib_root()
    files = list_files(root)[:max_files]
    train = [text for _, text in iter_texts(files, root, heldout=False)]
    heldout = [text for _, text in iter_texts(files, root, heldout=True)]
    if not train or not heldout:
        raise ValueError(f"corpus under {root} has an empty split")
    tokenizer = train_tokenizer(train, vocab_size)
    save_tokenizer(tokenizer, out / "tokenizer")
    tokenizer = load_tokenizer(out / "tokenizer")
    arrays = {"train": tokenize_split(tokenizer, train)}
    arrays["heldout"] = tokenize_split(tokenizer, heldout)
    for name, array in arrays.items():
        np.save(out / f"{name}.npy", array)
    manifest = {
        "python": platform.python_version(),
        "stdlib_root": str(root),
        "files": len(files),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "heldout_fraction": HELDOUT_FRACTION,
        "file_list_sha256": file_list_digest(files),
        "vocab_size": tokenizer.get_vocab_size(),
        "train_tokens": int(arrays["train"].size),
        "heldout_tokens": int(arrays["heldout"].size),
        "train_bytes": sum(len(t.encode("utf-8")) for t in train),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.prepare")
    parser.add_argument("--out", type=Path, default=Path("data"))
    parser.add_argument("--root", type=Path, default=None, help="stdlib folder")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-files", type=int, default=None)
    args = parser.parse_args(argv)
    manifest = prepare(args.out, args.root, args.vocab_size, args.max_files)
    json.dump(manifest, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
