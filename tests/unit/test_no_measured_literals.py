"""No test compares a figure of a run with a number read off one machine.

A loss, logit or norm computed in bf16 (or by TorchTitan's kernels) differs between CPU models
(AMX, AVX-512 BF16, AVX2) and GPUs; a test that asserts it equals a literal passes where it was
written and fails on a fresh clone elsewhere (it happened twice: a bitwise assert, then
``approx(0.9329, abs=1e-3)`` for a bf16 max logit that is 0.9312 on an Intel Xeon with AMX).
Tests compute their expectation in the same test (a reference run, the same job without the
feature) or derive a tolerance from the dtype. This scan fails CI on any machine when an assertion
compares with a float literal of 4 or more significant digits, unless the literal is an exact
design figure named in ``DESIGN_FIGURES`` with why it is exact. (Counts are integers: not flagged.)
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
SIGNIFICANT = 4  # 0.9329 is flagged, 0.5, 1e-3, 0.0008 and 2.5 are not

# (file, literal) -> why the figure is exact (elements from the model's shapes, not a measurement)
DESIGN_FIGURES = {
    (
        "e2e/test_titan_e2e.py",
        7.2417,
    ): "M elements/rank/step of Z3 on the debug model, 3(N-1)/N P_M - (N-1)/N P_layer, from its shapes",
    ("e2e/test_titan_e2e.py", 19.5953): "MB of the same elements (bf16 broadcasts, fp32 reduces), from the shapes",
    ("e2e/test_titan_e2e.py", 7.6677): "step 1's Z3 elements (the last layer re-broadcast), from the shapes",
    ("titan/test_trainer_jobs.py", 5.1118): "2(N-1)/N P_M of the debug model, from its shapes",
}

# calls whose positional arguments are the expected value (not a tolerance)
EXPECTATION_CALLS = {"approx", "assert_close", "assert_allclose", "isclose", "allclose", "assertAlmostEqual"}
# calls that only build a value from their arguments (their literals are the expected value)
VALUE_CALLS = {"tensor", "as_tensor", "full", "full_like", "float", "approx"}


def _significant_digits(value: float) -> int:
    mantissa = repr(abs(value)).split("e")[0].replace(".", "")
    return len(mantissa.strip("0"))


def _literals(node: ast.AST, named: dict):
    """Float literals that make up the value ``node`` (through arithmetic, tuples, lists,
    value-building calls and names assigned such a value in the file; not through other calls,
    whose arguments are their inputs)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        yield node
    elif isinstance(node, ast.Name) and node.id in named:
        yield from _literals(named[node.id], {k: v for k, v in named.items() if k != node.id})
    elif isinstance(node, ast.BinOp):
        yield from _literals(node.left, named)
        yield from _literals(node.right, named)
    elif isinstance(node, ast.UnaryOp):
        yield from _literals(node.operand, named)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _literals(element, named)
    elif isinstance(node, ast.Call) and _name(node.func) in VALUE_CALLS:
        for arg in node.args:
            yield from _literals(arg, named)


def _name(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def compared_literals(source: str) -> list[tuple[int, float]]:
    """(line, value) of each float literal an assertion compares a figure with: operands of a
    comparison inside ``assert``, and the expected values of approx/assert_close/isclose calls."""
    return sorted(set(_compared(ast.parse(source))))


def _compared(tree: ast.AST):
    named = {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        operands = []
        if isinstance(node, ast.Assert):
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands += [compare.left, *compare.comparators]
        elif isinstance(node, ast.Call) and _name(node.func) in EXPECTATION_CALLS:
            operands += node.args[:2] if _name(node.func) != "approx" else node.args[:1]
        for operand in operands:
            for literal in _literals(operand, named):
                if _significant_digits(literal.value) >= SIGNIFICANT:
                    yield literal.lineno, literal.value


def _scan() -> list[str]:
    found = []
    for folder, _, files in sorted(os.walk(TESTS)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.relpath(os.path.join(folder, name), TESTS)
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                source = f.read()
            for line, value in compared_literals(source):
                if (path, value) not in DESIGN_FIGURES:
                    found.append(f"tests/{path}:{line}: {value!r}")
    return found


def test_no_assertion_compares_with_a_measured_literal():
    found = _scan()
    assert not found, (
        "these assertions compare with a number of 4+ significant digits written into the test; if it was read "
        "off a run (a bf16 loss, logit or norm) it differs on another CPU or a GPU: compute the expectation in the "
        "same test or derive the tolerance from the dtype; an exact design figure goes into DESIGN_FIGURES with "
        "why it is exact: " + "; ".join(found)
    )


def test_the_scan_sees_each_form_and_leaves_tolerances_counts_and_design_figures():
    """The scan itself: each way of writing a machine-pinned figure is seen; tolerances (keywords),
    counts (integers), short literals and inputs of other calls are not."""
    flagged = """
assert qk[0] == (pytest.approx(0.9329, abs=1e-3), 0)
assert loss < 2.4031
assert norms == [1.25, 7.6513]
torch.testing.assert_close(logits, torch.tensor([0.12345]))
assert math.isclose(x, -3.14159)
EXPECTED = 0.93291
assert s == pytest.approx(EXPECTED, abs=1e-3)
"""
    assert [line for line, _ in compared_literals(flagged)] == [2, 3, 4, 5, 6, 7]
    clean = """
assert x == pytest.approx(y, abs=1e-3, rel=0.0001)
assert count == 12345 and ratio < 0.8 * first and s < 2.5
assert torch.equal(o, newton_schulz(m, (3.4445, -4.7750, 2.0315)))
torch.testing.assert_close(a, b, rtol=1.2345e-5, atol=0)
"""
    assert compared_literals(clean) == []
    assert all(_significant_digits(v) >= SIGNIFICANT for _, v in DESIGN_FIGURES)
