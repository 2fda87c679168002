"""The floors of the package, read from the import statements (``ast``, nothing imported). Each floor
imports only from itself and the floors below it (docs/design.md draws them); no two modules import
each other (package ``__init__`` re-exports aside); a size cap per module (the largest are one op
family each: kernels, launch plans and checks)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[1]
PACKAGES = {"sd_kernels": ROOT / "sd_kernels", "sd_kernels.patches": ROOT / "patches"}

# The floors, lowest first: (name, the module prefixes it holds). A module imports only from its own
# floor and the ones below it.
FLOORS = [
    ("data", ("sd_kernels.profiles", "sd_kernels.models", "sd_kernels.configs")),
    ("runtime", ("sd_kernels.runtime",)),
    ("kernels", ("sd_kernels.ops", "sd_kernels.reference", "sd_kernels.testing")),
    ("patch", ("sd_kernels.patches",)),
    ("analysis", ("sd_kernels.analysis",)),
    ("apps", ("sd_kernels.apps", "sd_kernels.__main__")),
]
MAX_LINES = 700


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, base in PACKAGES.items():
        for f in base.rglob("*.py"):
            parts = [p for p in f.relative_to(base).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The package modules ``name`` imports, anywhere in the file (function-level imports too)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
    return {m for m in out if m in known and m != name and m != "sd_kernels"}


MODULES = _modules()
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def test_the_import_graph_was_read():
    assert {"sd_kernels.ops", "sd_kernels.ops.attention"} <= GRAPH["sd_kernels.ops.custom_ops"]
    assert "sd_kernels.profiles" in GRAPH["sd_kernels.ops.attention"]


def _floor(module: str) -> int | None:
    for level, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def test_every_module_sits_on_a_floor():
    assert not [name for name in MODULES if name != "sd_kernels" and _floor(name) is None]


def test_floors_import_nothing_above_them():
    for name, deps in GRAPH.items():
        level = _floor(name)
        if level is None:
            continue
        above = sorted(d for d in deps if (_floor(d) or 0) > level)
        assert not above, f"{name} ({FLOORS[level][0]}) imports {above}, above its floor"


def test_a_back_arrow_fails_the_floor_test():
    """The check itself: the runtime floor importing the patch is caught."""
    deps = {"sd_kernels.patches.record"}
    assert any((_floor(d) or 0) > _floor("sd_kernels.runtime.memory") for d in deps)


def test_no_two_modules_import_each_other():
    cycles = {frozenset({a, b}) for a, deps in GRAPH.items() for b in deps
              if a in GRAPH.get(b, ()) and not {a, b} & set(PACKAGES)}
    assert not cycles, cycles


def test_module_size():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_one_table_of_model_families():
    """patches/families.py is where a model family is described: the lists that used to repeat it are
    lookups in it, and the profiles' layout parts (profiles sit below patches) agree with it."""
    from sd_kernels.patches import PARTS, SUPPORTED_MODELS, families

    from sd_kernels import profiles

    assert (PARTS, SUPPORTED_MODELS) == (families.PARTS, families.SUPPORTED_MODELS)
    assert set(profiles.LAYOUT_PARTS) == set(families.PARTS)
    assert families.DENOISERS and set(families.DENOISERS) <= set(families.SUPPORTED_MODELS)
    for name in ("patches/channels_last.py", "patches/memory_budget.py", "patches/cuda_graph.py",
                 "patches/winograd.py"):
        assert '"UNet2DConditionModel"' not in (ROOT / name).read_text(), name
