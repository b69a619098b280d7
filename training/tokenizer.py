"""Byte-level BPE for the demo pair, saved so ``mlx_lm.load`` finds it offline."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

END_OF_TEXT = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (END_OF_TEXT, MASK)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Train a byte-level BPE whose first ids are the special tokens.

    Args:
        texts: Training documents.
        vocab_size: Entries in the vocabulary, special tokens included.
        min_frequency: Fewest occurrences for a merge.

    Returns:
        A ``tokenizers.Tokenizer``; ``<|endoftext|>`` is id 0 and ``<|mask|>`` id 1.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, folder: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ special tokens map).

    Args:
        tokenizer: A trained ``tokenizers.Tokenizer``.
        folder: Destination; created if missing.
    """
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        mask_token=MASK,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(folder))


def load_tokenizer(folder: Path):
    """Load the saved ``tokenizer.json`` as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
