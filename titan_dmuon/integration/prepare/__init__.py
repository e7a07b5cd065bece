"""A job config made DMuon's, checked and finalized: what every door does before TorchTitan builds."""
