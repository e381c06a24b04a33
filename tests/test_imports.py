"""The package's import graph: every arrow points one way (no module imports, even lazily
inside a function, a module that imports it back)."""

import ast
from pathlib import Path

import dflash_mlx

PACKAGE = Path(dflash_mlx.__file__).parent


def module_name(path: Path) -> str:
    parts = ["dflash_mlx", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MAIN_TEST = "__name__ == '__main__'"


def without_main_block(tree: ast.Module) -> ast.Module:
    """`tree` less its `if __name__ == "__main__":` block: that code runs only in the module
    run as a script (`__main__`), which no module imports, so its imports close no cycle."""
    tree.body = [
        n for n in tree.body if not (isinstance(n, ast.If) and ast.unparse(n.test) == MAIN_TEST)
    ]
    return tree


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source.

    `from . import x` points at module `x` when there is one, else at the package
    (a name its `__init__` defines); the implicit import of a parent package by
    its submodules is not an arrow.
    """
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(without_main_block(ast.parse(path.read_text()))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("dflash_mlx")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                elif (node.module or "").startswith("dflash_mlx"):
                    base = node.module
                else:
                    continue
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "dflash_mlx.generate" in graph["dflash_mlx.cli.generate"]
    assert "dflash_mlx.native.kernels.metal" in graph["dflash_mlx.native.kernels"]
    assert "dflash_mlx.models.gguf" in graph["dflash_mlx.cli.convert"]  # imported inside run()
    assert "dflash_mlx.models.loading" in graph["dflash_mlx.train"]  # `from ..models.loading`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_training_takes_its_prompt_rendering_from_chat_format_not_the_bench():
    graph = import_graph()
    training = [m for m in graph if m.startswith("dflash_mlx.train")]
    assert "dflash_mlx.chat_format" in graph["dflash_mlx.train.data"]
    assert not [m for m in training if "dflash_mlx.cli.bench" in graph[m]]
