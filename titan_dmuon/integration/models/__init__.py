"""TorchTitan's model families under DMuon: which are supported, their attention for QK-clip and per-head
Newton–Schulz."""
