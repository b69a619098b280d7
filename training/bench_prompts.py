"""Cut the held-out prompt set: function signatures and docstrings with preceding context.

``python -m training.bench_prompts --data data --out configs/bench/heldout.jsonl`` walks
the held-out files in sorted order, takes every function (or method) that has a
docstring, and makes a prompt of the lines before it plus its signature and docstring,
growing the context upwards, whole lines at a time, to about ``--context-tokens``
tokens. ``--count`` prompts are picked at evenly spaced indices of all candidates.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path
from typing import Iterator, List, Optional

from .corpus import iter_texts, list_files
from .tokenizer import load_tokenizer


def documented_functions(source: str) -> Iterator[ast.AST]:
    """Functions and methods of ``source`` that start with a docstring, in line order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    nodes = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and ast.get_docstring(node) is not None
        and len(node.body) > 1
    ]
    yield from sorted(nodes, key=lambda node: node.lineno)


def cut_prompt(lines: List[str], node: ast.AST, tokenizer, context_tokens: int) -> str:
    """Lines up to the end of ``node``'s docstring, with about ``context_tokens`` tokens.

    The prompt always starts at a line boundary and ends with the docstring's line.
    """
    stop = node.body[0].end_lineno
    start = node.lineno - 1
    if getattr(node, "decorator_list", None):
        start = min(d.lineno for d in node.decorator_list) - 1
    while start > 0:
        text = "".join(lines[start - 1 : stop])
        if len(tokenizer.encode(text).ids) > context_tokens:
            break
        start -= 1
    return "".join(lines[start:stop])


def candidates(
    data: Path, context_tokens: int, min_tokens: int, heldout: bool = True
) -> List[dict]:
    """Every documented function of one split's files as a prompt record."""
    tokenizer = load_tokenizer(data / "tokenizer")
    records = []
    for path, text in iter_texts(list_files(), heldout=heldout):
        lines = text.splitlines(keepends=True)
        for node in documented_functions(text):
            prompt = cut_prompt(lines, node, tokenizer, context_tokens)
            count = len(tokenizer.encode(prompt).ids)
            if count >= min_tokens:
                records.append(
                    {
                        "prompt": prompt,
                        "file": path,
                        "function": node.name,
                        "line": node.lineno,
                        "prompt_tokens": count,
                    }
                )
    return records


def pick_evenly(records: List[dict], count: int) -> List[dict]:
    """``count`` records at evenly spaced indices (all of them if there are fewer)."""
    if len(records) <= count:
        return list(records)
    step = len(records) / count
    return [records[int(i * step)] for i in range(count)]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.bench_prompts")
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("configs/bench/heldout.jsonl"))
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--context-tokens", type=int, default=320)
    parser.add_argument("--min-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    records = pick_evenly(
        candidates(args.data, args.context_tokens, args.min_tokens), args.count
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    files = len({r["file"] for r in records})
    print(f"{len(records)} prompts from {files} held-out files -> {args.out}")


if __name__ == "__main__":
    main()
