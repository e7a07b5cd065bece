"""What TorchTitan builds and runs for DMuon: the trainer, parallelization, models, optimizer container,
QK-clip attention descriptions, fault tolerance."""
