"""What the tiers share: worker pools, models and references, TorchTitan harness, jobs; never a test."""
