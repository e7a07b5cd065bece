"""End to end: ``./run_train.sh`` with the variants' flags, as a user runs it (tests/e2e/test_titan_e2e.py's way).

One job with all three (``--optimizer.normuon_beta2 0.95 --optimizer.ns_blocks heads --optimizer.ns_dtype
float16``) against the default job, to keep the suite fast (float16 GEMMs are slow on CPUs without
float16 units); each option's own path is tested in-process (tests/titan/test_variants.py, test_variants_math.py).
"""

import os
import re

from tests.support.run_train import parse, run_train

NS_MATRICES = re.compile(r"NS: (\d+) matrices on this rank")

STEPS = 4
VARIANTS = ["--optimizer.normuon_beta2", "0.95", "--optimizer.ns_blocks", "heads", "--optimizer.ns_dtype", "float16"]


def test_the_variants_train_the_debug_job_from_the_default_jobs_first_step(tmp_path):
    """Step 1 (before any update) sees exactly the default job's loss and gradient norm: the options change
    nothing but the optimizer's rule. The loss falls over the steps. Per-head blocks reached the job (the
    logged rank runs more Newton–Schulz matrices than with whole ones). The last step's HF export holds the
    model's weights and nothing of NorMuon's state."""
    export = [
        "--checkpoint.enable",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.interval",
        "1000",
    ]
    default_run = run_train(tmp_path / "default", "--training.steps", "1")
    variants_run = run_train(tmp_path / "variants", "--training.steps", str(STEPS), *VARIANTS, *export, timeout=900)
    (default, _), (variants, _) = parse(default_run), parse(variants_run)
    ns = [int(NS_MATRICES.findall(r.stdout + r.stderr)[0]) for r in (default_run, variants_run)]
    assert ns[1] > ns[0], ns
    assert sorted(variants) == list(range(1, STEPS + 1))
    assert variants[1] == default[1]
    assert variants[STEPS][0] < variants[1][0], variants
    folder = tmp_path / "variants" / "checkpoint" / f"step-{STEPS}"
    keys = _safetensors_keys(str(folder))
    assert keys and all("moment" not in k and "momentum" not in k for k in keys), sorted(keys)[:5]


def _safetensors_keys(folder: str) -> list[str]:
    from safetensors import safe_open

    keys = []
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                keys += list(f.keys())
    return keys
