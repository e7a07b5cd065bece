"""What a TorchTitan job leaves, read back for comparison: a pipeline's stage weights in full, an HF export on disk."""

from tests.support.helpers import assert_states_equal, full_parameters


def handles_of(parts) -> list:
    """The DMuon handles of these model parts (a pipeline rank's stages)."""
    from titan_dmuon.runtime import DedicatedParams

    return [h for part in parts for h in DedicatedParams.of(part)]


def pp_weights(parts):
    """This rank's stages' parameters in full, by canonical name (collective on the FSDP group)."""
    out = {}
    for part in parts:
        handles = handles_of([part])
        out.update(full_parameters(part, handles[0] if handles else None))
    return out


def check_hf_export(folder, expected):
    import json
    import os

    from safetensors.torch import load_file

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    exported = {}
    for name in sorted(set(weight_map.values())):
        exported.update(load_file(os.path.join(folder, name)))
    assert_states_equal(exported, expected)
