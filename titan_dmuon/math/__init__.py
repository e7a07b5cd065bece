"""The math: pure functions on tensors, no modules, no communication, no state.

May import: torch and the standard library only (and its own siblings). Everything above depends on it.
"""
