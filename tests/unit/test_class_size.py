"""No class in the package is longer than 250 lines (the project's rule): a class past it holds more
than one concern (``DMuon`` held the optimizer's API, the step's schedule, the TP exchange's stages
and AdamW in 382 lines; ``DedicatedParams`` 335), so the scan reads every module's syntax tree."""

import ast
from pathlib import Path

import titan_dmuon

MAX_CLASS_LINES = 250
PACKAGE = Path(titan_dmuon.__file__).parent


def class_lengths(source: str) -> dict[str, int]:
    """Lines of every class in ``source`` (nested ones too, by dotted name), from its ``class`` line
    (decorators excluded) to its last."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                out[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_the_scan_measures_a_class_from_its_first_line_to_its_last():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    source = f"@decorated\nclass Long:\n{body}\n\n\ndef f():\n    class Inner:\n        pass\n"
    assert class_lengths(source) == {"Long": MAX_CLASS_LINES + 1, "Inner": 2}


def test_no_class_in_the_package_is_over_250_lines():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40  # (the scan found the package)
    too_long = {
        f"{path.relative_to(PACKAGE)}: {name}": lines
        for path in modules
        for name, lines in class_lengths(path.read_text()).items()
        if lines > MAX_CLASS_LINES
    }
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines (split their concerns into classes): {too_long}"
