"""Support for the tests, and tooling the benchmarks share: not part of the library.

* :mod:`.launches`: launch counting on a lazy mlx graph;
* :mod:`.validated`: argument-checking forms of the kernel entries, for tests that
  call the operations on their own;
* :mod:`.kernel_cases`: bit-exactness cases of every kernel operation;
  :mod:`.selfcheck` runs them without pytest (``python -m tests.support.selfcheck``
  from the repository root);
* :mod:`.compile_check`: the kernel bodies compiled by g++ (Metal, against
  ``shim_metal.h``) and nvcc (CUDA, against ``shim_cuda_utils.h``) inside mlx's
  generated signatures; :mod:`.metal_emulator` runs the Metal bodies on the CPU.

The tests import it as ``support`` (pytest puts ``tests/`` on ``sys.path``, as it
does for ``conftest``); the benchmarks as ``tests.support``, from the repository
root. Modules here import each other relatively, so either name works.
"""
