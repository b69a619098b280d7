"""The package's import graph: no circle, and no private name imported across modules."""

import ast
from pathlib import Path

import dflash

PACKAGE = Path(dflash.__file__).parent


def module_imports():
    """``{module: [(imported module, [names])]}`` for every ``dflash/*.py`` relative import."""
    graph = {}
    for path in sorted(PACKAGE.glob("*.py")):
        name = path.stem
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                target = (node.module or "").split(".")[0]
                if target:
                    edges.append((target, [alias.name for alias in node.names]))
                else:  # "from . import x"
                    edges.extend((alias.name, []) for alias in node.names)
        graph[name] = edges
    return graph


def test_top_level_modules_import_each_other_without_a_circle():
    graph = {m: {t for t, _ in edges} for m, edges in module_imports().items()}
    state = {}

    def visit(module, path):
        if state.get(module) == "done" or module not in graph:
            return
        assert state.get(module) != "open", "import circle: " + " -> ".join(
            path + [module]
        )
        state[module] = "open"
        for target in sorted(graph[module]):
            visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


# The generation loop's modules (the rest of the package keeps its own conventions).
LOOP = {
    "generation",
    "dflash_round",
    "speculative",
    "rounds",
    "sampling",
    "inputs",
    "stats",
}


def test_no_private_name_is_imported_across_the_loop_modules():
    for module, edges in module_imports().items():
        if module not in LOOP:
            continue
        for target, names in edges:
            private = [n for n in names if n.startswith("_")]
            assert (
                not private
            ), f"dflash.{module} imports {private} from dflash.{target}"
