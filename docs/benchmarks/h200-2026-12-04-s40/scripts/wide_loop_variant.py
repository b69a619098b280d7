"""Session 40: the dropped `wide` form that call C's arms new1 / new ran (as
`dflash_attend_chunks_wide128_80f936e510`): the chunk body inside a loop over the group's
chunks, so that a light last chunk could ride on the groups of the chunk before it
(`params[17]`; the host rule merged it when that brought the grid from more than one wave
of 132 SMs to one). It was 4-11 us slower a call (nvcc spills 16 bytes of it at the
128-register bound), merged or not, and was dropped. Rebuilds that text from the current tree.
Usage (repository root): python docs/benchmarks/h200-2026-12-04-s40/scripts/wide_loop_variant.py
"""
import dataclasses

from dflash.metal import tensor_attention as ta
from dflash.metal.groups import indent

GROUP_CHUNK = "  const int u = rest % n_chunks;\n  rest = rest / n_chunks;\n"
MERGED_CHUNKS = """  const int merged = params[17];
  const int grid_chunks = n_chunks - merged;
  const int u_first = rest % grid_chunks;
  rest = rest / grid_chunks;
"""
CHUNK_START = "  const int chunk_start = (chunk_first + u) * chunk;\n"
LOOP_FROM = "  // Stage the block's query rows"
EXIT = "  if (key_tile > 0 || !warp_active) {\n    return;\n  }\n"


def loop_body(dim: int = 128) -> str:
    body = ta._wide_body(dim)
    body = body.replace(GROUP_CHUNK, MERGED_CHUNKS).replace(CHUNK_START, "")
    head, rest = body.split(LOOP_FROM)
    attend, combine = rest.split(EXIT)
    return head + (
        "  const int u_last =\n"
        "      merged != 0 && u_first == grid_chunks - 1 ? n_chunks - 1 : u_first;\n"
        "  for (int u = u_first; u <= u_last; ++u) {\n"
        + indent(CHUNK_START, 2)
        + indent(LOOP_FROM + attend, 2)
        + "    if (key_tile == 0 && warp_active) {\n"
        + indent(combine, 4)
        + "    }\n"
        + "    __syncthreads();  // the next chunk's staging reuses the shared memory\n"
        + "  }\n"
    )


if __name__ == "__main__":
    spec = ta.attend_spec(128, ta.WIDE)
    print(dataclasses.replace(spec, body=loop_body()).name("cuda"))
