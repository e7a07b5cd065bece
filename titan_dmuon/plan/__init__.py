"""The plan: who owns what, computed from names and shapes alone, identical on every rank.

May import: ``titan_dmuon.math`` and ``titan_dmuon.options``. ``validate_across_ranks`` is its one collective.
"""
