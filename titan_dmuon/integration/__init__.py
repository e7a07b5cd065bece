"""TorchTitan 0.3.0 with DMuon, in TorchTitan's own nouns. May import every layer of the core; the core never
imports it (``import titan_dmuon`` stays TorchTitan-free).

* ``config/``: how a job's config comes in and is checked before launch: ``toml_file`` (``run_train.sh``'s
  ``CONFIG_FILE``), ``python_config`` (``with_dmuon``), ``values`` (typed values for both doors and the command
  line), ``trainer_config`` (a ``Trainer.Config`` as DMuon's), ``validation/`` (one module per config section,
  ``validate.validate_dmuon`` runs them all), ``finalize`` (the last steps before a build), ``check`` (the
  pre-launch check ``run_train.sh`` runs).
* ``components/``: ``optimizer_container`` (``[optimizer] name``), ``checkpoint`` (checks before a DCP load),
  ``hf_export`` (an export ``transformers`` loads).
* ``distributed/``: ``parallelize`` (dedication at the family's first ``fully_shard``), ``degrees`` (what
  DMuon reads of the parallel layout: degrees, the dedication mesh), ``context_parallel``
  (CP's CPU attention), ``fault_tolerance`` (TorchFT).
* ``models/``: ``families`` (the supported model families), ``attention_clip`` (QK-clip's attention
  descriptions), ``attention_heads`` (per-head Newton–Schulz layouts).
* here: ``trainer`` (DMuonTrainer, metrics, clipping), ``train`` (the TOML entry point), ``assets`` (the debug
  tokenizer and dataset), ``names`` (optimizer names and metric keys), ``cpu`` (every accommodation for a
  machine without an accelerator).
"""
