"""The C++ host side both CPU emulators share (:mod:`.metal_emulator`, :mod:`.group_emulator`).

A driver binary is called as ``key <params...> n_in in_path... n_out (out_path out_bytes)...``:
it reads every input file, gives every output ``canary_bytes`` of canary past its end, runs the
case whose ``key`` matches (the emulator writes the cases), and writes the outputs back,
failing if a kernel wrote past the end of one.
"""

from __future__ import annotations

from typing import Sequence

# Host headers come before the shim: its address-space macros must not reach the C
# library's own declarations.
DRIVER_INCLUDES = """
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
"""

_MAIN = r"""
static std::vector<char> slurp(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

// Outputs carry CANARY bytes past their end; a body that writes past its
// output (e.g. a missing bound check on a rounded-up grid) fails the run.
static int finish(char** argv, std::vector<std::vector<char>>& outs,
                  const std::vector<size_t>& sizes, int first_out) {
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t b = sizes[i]; b < outs[i].size(); ++b) {
      if (static_cast<unsigned char>(outs[i][b]) != CANARY) {
        std::fprintf(stderr, "output %zu written past its end\n", i);
        return 3;
      }
    }
    std::ofstream out(argv[first_out + 2 * i], std::ios::binary);
    out.write(outs[i].data(), sizes[i]);
  }
  return 0;
}

// argv: key PARAM_NAMES n_in in_path... n_out (out_path out_bytes)...
int main(int argc, char** argv) {
  (void)argc;
  const std::string key = argv[1];
PARAM_LINES
  const int n_in = std::atoi(argv[FIRST_IN - 1]);
  std::vector<std::vector<char>> ins;
  for (int i = 0; i < n_in; ++i) {
    ins.push_back(slurp(argv[FIRST_IN + i]));
  }
  const int n_out = std::atoi(argv[FIRST_IN + n_in]);
  const int first_out = FIRST_IN + 1 + n_in;
  std::vector<std::vector<char>> outs;
  std::vector<size_t> sizes;
  for (int i = 0; i < n_out; ++i) {
    sizes.push_back(std::strtoull(argv[first_out + 2 * i + 1], nullptr, 10));
    outs.emplace_back(sizes.back() + CANARY_BYTES, char(CANARY));
  }
__CASES__
  std::fprintf(stderr, "unknown kernel %s\n", key.c_str());
  return 2;
}
"""


def buffer_args(input_types: Sequence[str], output_types: Sequence[str]) -> list[str]:
    """A kernel call's buffer arguments: each input's and output's bytes as its C++ type.

    Args:
        input_types: The C++ element type of each input, in order.
        output_types: The C++ element type of each output, in order.

    Returns:
        One argument expression a buffer.
    """
    args = [
        f"reinterpret_cast<const {ctype}*>(ins[{i}].data())"
        for i, ctype in enumerate(input_types)
    ]
    args += [
        f"reinterpret_cast<{ctype}*>(outs[{i}].data())"
        for i, ctype in enumerate(output_types)
    ]
    return args


def driver_main(
    params: Sequence[str], cases: str, canary_bytes: int, canary: int
) -> str:
    """The driver's ``slurp``, ``finish`` and ``main``.

    Args:
        params: Names of the ``uint`` launch parameters that follow the key on the command
            line (e.g. ``("groups", "threads")``), in order.
        cases: C++ statements, one ``if (key == ...)`` block a kernel, each returning
            ``finish(argv, outs, sizes, first_out)``; they see ``key``, ``ins``, ``outs``,
            ``sizes``, ``first_out`` and the parameters.
        canary_bytes: Canary bytes past every output.
        canary: The canary byte's value.

    Returns:
        C++ source, to follow the kernels' translation units.
    """
    lines = [
        f"  const uint {name} = uint(std::strtoul(argv[{2 + i}], nullptr, 10));"
        for i, name in enumerate(params)
    ]
    main = _MAIN.replace("PARAM_NAMES", " ".join(params))
    main = main.replace("PARAM_LINES", "\n".join(lines))
    main = main.replace("FIRST_IN", str(3 + len(params)))
    main = main.replace("__CASES__", cases)
    main = main.replace("CANARY_BYTES", str(canary_bytes))
    return main.replace("CANARY", str(canary))
