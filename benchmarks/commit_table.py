"""What one store for all rings would save at commit: 39 per-ring stores vs one table store.

A verify round's commit stores the kept rows of the held-back block in every ring: today one
in-place op per ring (39 at Muse Glimmer geometry). If all rings lived in one
``(L, 2, B, H, C, D)`` table, the commit could be one concatenate of the blocks plus one
in-place store. This times both, host (graph building) and total (until the device is done),
for a store inside one run of the ring and one across the seam, at kept = 5 and 16.

    python -m benchmarks.commit_table      # GPU host; on the CPU it runs, slowly

It measures the commit alone; it does not build the shared-table cache (see docs/metal.md for
why the cache keeps one buffer per ring).
"""

from __future__ import annotations

import mlx.core as mx

from dflash.metal import ring_write

from .common import host_and_total_ms

LAYERS, HEADS, CAPACITY, DIM, BLOCK = 39, 2, 2048, 128, 16
ROW_AXIS = 3  # of one ring's stacked (2, B, H, C, D) buffer


def main() -> None:
    shape = (2, 1, HEADS, CAPACITY, DIM)
    rings = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(LAYERS)]
    table = mx.stack(rings)
    blocks = [
        mx.random.normal((2, 1, HEADS, BLOCK, DIM)).astype(mx.bfloat16)
        for _ in range(LAYERS)
    ]
    mx.eval(rings, table, blocks)
    state = {"rings": rings, "table": table}
    del rings, table
    print(f"mlx {mx.__version__}, {mx.default_device()}")
    for dest in (1000, 2040):
        for kept in (5, BLOCK):

            def per_ring():
                kept_rows = [b[:, :, :, :kept] for b in blocks]
                state["rings"] = [
                    ring_write(r, k, dest, ROW_AXIS)
                    for r, k in zip(state["rings"], kept_rows)
                ]
                return state["rings"]

            def one_table():
                kept_rows = mx.stack([b[:, :, :, :kept] for b in blocks])
                state["table"] = ring_write(
                    state["table"], kept_rows, dest, ROW_AXIS + 1
                )
                return [state["table"]]

            for name, step in (
                ("39 ring stores", per_ring),
                ("one table store", one_table),
            ):
                host, total = host_and_total_ms(step)
                print(
                    f"dest {dest:4d} kept {kept:2d}  {name:15s}: host {host:6.3f} ms, "
                    f"total {total:6.3f} ms"
                )


if __name__ == "__main__":
    main()
