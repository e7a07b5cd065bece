"""The optimizer: ``DMuon``'s API, its state dict, the Muon step's schedule and one module per kind of
weight update (whole, grouped, tensor-parallel), clipping and QK-clip's runtime.

May import: ``titan_dmuon.math``, ``options``, ``plan`` and ``runtime``.
"""
