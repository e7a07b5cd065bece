"""DMuon's additions to TorchTitan's checkpointing: checks before a DCP load, a loadable HF export."""
