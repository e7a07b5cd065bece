"""TorchTitan 0.3.0 with DMuon, laid out in the order a job passes through it.

1. ``doors/``: how a job's config comes in: a TOML file (``toml_file``: ``run_train.sh``'s
   ``CONFIG_FILE``), a Python config (``python_config``: ``with_dmuon``, for TorchTitan's
   ``--module/--config``), and the typed values both doors and the command line convert with (``values``).
2. ``prepare/``: what every door does next, before any process group: the config as DMuon's
   (``trainer_config``), every check (``validation``, ``fault_tolerance_checks``), the last steps
   (``finalize``).
3. ``training/``: what TorchTitan builds and runs: ``trainer`` (DMuonTrainer, metrics, clipping),
   ``parallelize`` (dedication at the family's first ``fully_shard``), ``models`` (the supported
   families), ``optimizer_container`` (``[optimizer] name``), ``attention_clip`` (QK-clip's attention
   descriptions), ``fault_tolerance`` (TorchFT).
4. ``adapters/``: TorchTitan's checkpoint (``checkpoint``: checks before a DCP load) and HF export
   (``hf_export``).

Here: the commands ``run_train.sh`` runs (``train``: the TOML entry point; ``check``: the pre-launch
check; ``assets``: the debug tokenizer and dataset), ``names`` (optimizer names and metric keys) and
``cpu`` (every accommodation for a machine without an accelerator).
"""
