"""What tests, benchmarks and examples run DMuon against, not part of DMuon itself.

* ``toy_model.py``: a tiny Llama-style transformer (optionally with MoE experts);
* ``baselines.py``: naive FSDP2 + Muon (a full-gradient all-gather in the step), the
  baseline DMuon's communication is measured against (also ``optimizer.name = "naive_muon"``, which
  benchmarks/naive_muon_job.py's container subclass builds: DMuon never imports this package).
"""
