"""The package's layers, as CONTRIBUTING.md draws them: each module imports only its own layer's package
and the layers below it (function-level imports included), and no two modules import each other, directly
or through others. A new module goes into the folder of its layer; this test says where it may reach."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "titan_dmuon")
# Lowest first. A module may import its own package (the first part of its path) and every layer below.
LAYERS = (
    ("math",),
    ("options",),
    ("plan",),
    ("runtime",),
    ("optim",),
    ("tools", "testing"),
    ("integration",),
    ("sizing",),
    ("__init__", "config_registry", "env"),  # the API, TorchTitan's registry, the report on the whole package
)
TOP_LEVEL_MODULES = {"__init__", "options", "config_registry"}  # the API, the options, TorchTitan's registry


def _modules() -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
                if parts[-1] == "__init__" and len(parts) > 1:
                    parts = parts[:-1]
                found[".".join(["titan_dmuon", *parts])] = path
    return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """Every titan_dmuon module this file imports, at any level (``from a import b`` counts ``a.b`` where
    that is a module)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_dmuon"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("titan_dmuon")}
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    for index, names in enumerate(LAYERS):
        if head in names:
            return index
    raise AssertionError(f"{module}: not in any layer of tests/unit/test_layers.py's LAYERS; put it in a layer folder")


def test_no_module_imports_a_layer_above_its_own():
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        own, package = _layer(module), module.split(".")[:2]
        for target in sorted(_imports(path, modules)):
            if target.split(".")[:2] != package and _layer(target) >= own and target != "titan_dmuon":
                upward.append(f"{module} -> {target}")
            elif target == "titan_dmuon" and own < len(LAYERS) - 1:
                upward.append(f"{module} -> titan_dmuon (the API: import the module that defines the name)")
    assert upward == []


def test_no_import_circle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}

    def reaches(start, target, seen):
        for dep in graph.get(start, ()):
            if dep == target:
                return True
            if dep not in seen:
                seen.add(dep)
                if reaches(dep, target, seen):
                    return True
        return False

    # a package's __init__ importing its own modules is how packages export: left out of the circle check
    circles = [m for m in graph if not os.path.basename(modules[m]) == "__init__.py" and reaches(m, m, set())]
    assert circles == []


def test_the_top_level_holds_the_api_the_options_and_the_config_registry_only():
    top = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert top == TOP_LEVEL_MODULES


def test_no_module_is_over_500_lines():
    long = {m: n for m, p in _modules().items() if (n := sum(1 for _ in open(p))) > 500}
    assert long == {}
