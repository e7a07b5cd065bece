"""DMuon's versions of TorchTitan's components: the optimizer container, the checkpoint manager, the HF export."""
