"""TorchTitan's parallelisms with DMuon: parallelize (dedication at the first ``fully_shard``), context
parallelism's CPU attention, fault tolerance (TorchFT)."""
