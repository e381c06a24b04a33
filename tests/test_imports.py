"""The package's import graph: every arrow points one way (no module imports, even lazily
inside a function, a module that imports it back), and down the layers: kernels, models,
decoding, the library's entry points, the server and training, the command line."""

import ast
from pathlib import Path

import dflash_mlx

PACKAGE = Path(dflash_mlx.__file__).parent


def module_name(path: Path) -> str:
    parts = ["dflash_mlx", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The layers, lowest first, by module names relative to the package ("": the package itself).
# A module may import the modules of its own layer and of those below it, and the leaves.
# settings.py sits with decode/: the loop reads a reply's `GenerationSettings`, which make
# its size policy and verifier.
LAYERS = (
    ("kernels", ("native",)),
    ("models", ("models",)),
    ("decoding", ("decode", "settings")),
    ("library", ("", "generate", "images", "options")),
    ("server and training", ("serve", "train")),
    ("command line", ("cli", "__main__")),
)
LEAVES = ("chat_format", "paths", "response", "staging")  # import nothing of the package


def layer(module: str) -> int | None:
    """The rank in `LAYERS` of a package module (None: a leaf, or in no layer); a module's
    `__main__` block is the command line's."""
    if module.endswith(SCRIPT):
        return len(LAYERS) - 1
    relative = module.removeprefix("dflash_mlx").removeprefix(".")
    for rank, (_, members) in enumerate(LAYERS):
        if any(relative == m or (m and relative.startswith(f"{m}.")) for m in members):
            return rank
    return None


def upward_imports(imports: dict[str, dict[str, int]]) -> list[str]:
    """Each import of a module from a layer above the importer's, as `module:line imports
    target (layer above layer)`."""
    found = []
    for module, targets in sorted(imports.items()):
        for target, line in sorted(targets.items()):
            here, there = layer(module), layer(target)
            if here is not None and there is not None and there > here:
                found.append(
                    f"{module}:{line} imports {target} ({LAYERS[there][0]} above {LAYERS[here][0]})"
                )
    return found


MAIN_TEST = "__name__ == '__main__'"
SCRIPT = ".__main__"  # a module's `if __name__ == "__main__":` block, as a node of its own


def split_main_block(tree: ast.Module) -> tuple[ast.Module, ast.Module]:
    """`tree` less its `if __name__ == "__main__":` block, and that block alone. The block runs
    only where the module is run as a script (`python -m`): it is an entry point of the command
    line, which nothing imports, so the graph holds it as a node of its own
    (`dflash_mlx.generate.__main__`) in the command line's layer; its imports are checked as
    that node's."""
    main = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == MAIN_TEST]
    rest = [n for n in tree.body if not any(n is m for m in main)]
    return ast.Module(rest, []), ast.Module(main, [])


def imported_lines() -> dict[str, dict[str, int]]:
    """Module -> the package modules it imports anywhere in its source (in functions and
    `TYPE_CHECKING` blocks too), each with the line of its first import there; a module's
    `__main__` block is a module of its own (`split_main_block`).

    `from . import x` points at module `x` when there is one, else at the package
    (a name its `__init__` defines); the implicit import of a parent package by
    its submodules is not an arrow.
    """
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        body, main = split_main_block(ast.parse(path.read_text()))
        found[name] = imports_of(body, name, package, files)
        if main.body:
            found[name + SCRIPT] = imports_of(main, name + SCRIPT, package, files)
    return found


def imports_of(tree: ast.Module, name: str, package: str, files: dict) -> dict[str, int]:
    """The package modules `tree` (of module `name` in `package`) imports, by first line."""
    targets: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("dflash_mlx")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").startswith("dflash_mlx"):
                base = node.module
            else:
                continue
            names = [f"{base}.{a.name}" for a in node.names]
            names = [n if n in files else base for n in names]
        else:
            continue
        for target in names:
            if target in files and target != name:
                targets[target] = min(targets.get(target, node.lineno), node.lineno)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (`imported_lines` without the lines)."""
    return {name: set(targets) for name, targets in imported_lines().items()}


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
    assert "dflash_mlx.models.draft" in graph["dflash_mlx.train"]  # under TYPE_CHECKING
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_a_main_block_is_a_command_line_node_of_its_own():
    graph = import_graph()
    assert "dflash_mlx.cli" in graph["dflash_mlx.generate.__main__"]
    assert "dflash_mlx.cli" not in graph["dflash_mlx.generate"]
    assert layer("dflash_mlx.generate.__main__") == layer("dflash_mlx.cli")


def test_the_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_training_takes_its_prompt_rendering_from_chat_format_not_the_bench():
    graph = import_graph()
    training = [m for m in graph if m.startswith("dflash_mlx.train")]
    assert "dflash_mlx.chat_format" in graph["dflash_mlx.train.data"]
    assert not [m for m in training if "dflash_mlx.cli.bench" in graph[m]]


def test_every_module_has_a_layer_or_is_a_leaf():
    leaves = {f"dflash_mlx.{m}" for m in LEAVES}
    placed = [m for m in import_graph() if layer(m) is not None or m in leaves]
    assert sorted(import_graph()) == sorted(placed)


def test_the_leaves_import_nothing_of_the_package():
    graph = import_graph()
    assert {m: graph[f"dflash_mlx.{m}"] for m in LEAVES} == {m: set() for m in LEAVES}


def test_the_check_names_an_import_from_a_layer_above():
    imports = {
        "dflash_mlx.models.draft": {"dflash_mlx.native.swaps": 3, "dflash_mlx.paths": 4},
        "dflash_mlx.native.blas": {"dflash_mlx.serve.app": 7},
        "dflash_mlx.decode.plan": {"dflash_mlx.settings": 2, "dflash_mlx.cli": 9},
    }
    assert upward_imports(imports) == [
        "dflash_mlx.decode.plan:9 imports dflash_mlx.cli (command line above decoding)",
        "dflash_mlx.native.blas:7 imports dflash_mlx.serve.app (server and training above kernels)",
    ]


def test_imports_point_down_the_layers():
    upward = upward_imports(imported_lines())
    assert not upward, "\n".join(upward)
