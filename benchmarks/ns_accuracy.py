"""How close each Newton–Schulz method's output is to the exact polar factor U Vᵀ, on the matrices Muon sees.

    python benchmarks/ns_accuracy.py                      # llama3 debug, qwen3 MoE experts, llama3 8B shapes
    python benchmarks/ns_accuracy.py --shapes debug moe   # the small ones only (a minute)
    python benchmarks/ns_accuracy.py --shapes 70b --device cuda   # llama3 70B (hours on a CPU)
    python benchmarks/ns_accuracy.py --shapes debug --restarts    # also Gram Newton–Schulz's other restarts

For each (short, long) shape of those models' Muon matrices (a matrix and its transpose are one
Newton–Schulz problem) and each input: Gaussian; "real", the momentum buffers of TorchTitan's llama3
debug model after a few torch.optim.Muon steps on the bundled dataset (debug shapes); rank 16; condition
number 1e6; a zero matrix; a single nonzero entry. For torch.optim.Muon's own Newton–Schulz (per matrix)
and each ``ns_methods.NS_METHODS`` method (batched): the smallest and largest singular value of the output
(over the input's rank) and its relative Frobenius distance from the exact polar factor (float64: from the
known factors of the constructed inputs, from the eigendecomposition of M Mᵀ for Gaussian ones, an SVD for
the real ones; U_r V_rᵀ for rank r). Whether every output is finite and a zero matrix gives zero is checked
on every row. ``--restarts`` adds Gram Newton–Schulz with its authors' float16 default (one restart, before
step 2) and with restarts before steps 2 and 4, the rows behind ``ns_methods.gram_restarts``.

Each method also runs in float16 (``ns_dtype="float16"``: normalised in float32, then every product in
float16), a column each; a second table gives, per shape and input, the largest magnitude any float16
intermediate of each method reached (every op's output, recorded as it runs: float16 overflows at 65504)
and the share of the normalised input's nonzero entries below float16's smallest normal number (6.1e-5),
where it keeps fewer significant bits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from titan_dmuon.math import ns_methods  # noqa: E402

# (short, long) of the Newton–Schulz matrices (tests/..., from the models built on the meta device)
SHAPES = {
    "debug": [(256, 256), (256, 768)],  # llama3 debugmodel: wq/wk/wv/wo, w1/w2/w3
    "moe": [(256, 768), (768, 2048)],  # qwen3 experts: moe_debug, 30B-A3B
    "8b": [(1024, 4096), (4096, 4096), (4096, 14336)],  # llama3 8B: wk/wv, wq/wo, w1/w2/w3
    "70b": [(1024, 8192), (8192, 8192), (8192, 28672)],  # llama3 70B
}
INPUTS = ("gaussian", "real", "rank 16", "condition 1e6", "zero", "one entry")


def constructed(short: int, long: int, singular_values: torch.Tensor, generator, device):
    """(M, its polar factor U_r V_rᵀ): random orthonormal U (short x r), V (long x r), M = U diag(s) Vᵀ."""
    r = len(singular_values)
    u, _ = torch.linalg.qr(torch.randn(short, r, generator=generator, dtype=torch.float64).to(device))
    v, _ = torch.linalg.qr(torch.randn(long, r, generator=generator, dtype=torch.float64).to(device))
    return (u * singular_values.to(device)) @ v.T, u @ v.T


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """U Vᵀ of a full-rank wide float64 matrix: (M Mᵀ)^(-1/2) M from the eigendecomposition of M Mᵀ."""
    if min(matrix.shape) <= 1024:
        u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u @ vh
    values, vectors = torch.linalg.eigh(matrix @ matrix.T)
    return (vectors * values.rsqrt()) @ vectors.T @ matrix


def debug_model_momenta(steps: int = 5, seed: int = 0) -> list[torch.Tensor]:
    """The Muon momentum buffers of TorchTitan's llama3 debug model after ``steps`` steps of
    torch.optim.Muon (lr 0.02) + AdamW on the bundled dataset (batch 4 x 256 tokens), one process."""
    import json

    from tokenizers import Tokenizer

    from titan_dmuon.integration import cpu

    cpu.enable()
    import re

    import torchtitan.models.llama3 as llama3

    from titan_dmuon.integration.assets import dataset_dir, ensure_debug_assets, tokenizer_dir
    from titan_dmuon.integration.distributed.parallelize import DEFAULT_MUON_PARAMS

    root = ensure_debug_assets(os.path.join(ROOT, "assets", "debug"))
    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir(root), "tokenizer.json"))
    with open(os.path.join(dataset_dir(root), "train.jsonl")) as f:
        text = " ".join(json.loads(line)["text"] for _, line in zip(range(400), f))
    tokens = torch.tensor(tokenizer.encode(text).ids)
    spec = llama3.model_registry("debugmodel")
    cpu.use_sdpa_attention(spec.model)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    targets = [p for n, p in model.named_parameters() if any(re.search(r, n) for r in DEFAULT_MUON_PARAMS)]
    ids = {id(p) for p in targets}
    muon = torch.optim.Muon(targets, lr=0.02)
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=8e-4)
    batch, seq = 4, 256
    for step in range(steps):
        chunk = tokens[step * batch * (seq + 1) : (step + 1) * batch * (seq + 1)].view(batch, seq + 1)
        logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return [muon.state[p]["momentum_buffer"].detach().clone() for p in targets]


def inputs(short: int, long: int, kind: str, generator, device, real: list[torch.Tensor]):
    """(M float64 wide, its polar factor, its rank) of one kind, or None where it does not apply."""
    if kind == "gaussian":
        m = torch.randn(short, long, generator=generator, dtype=torch.float64).to(device)
        return m, polar_factor(m), short
    if kind == "real":
        found = [t for t in real if tuple(sorted(t.shape)) == (short, long)]
        if not found:
            return None
        m = found[len(found) // 2].double().to(device)
        m = m.T if m.shape[0] > m.shape[1] else m
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        rank = int((s > 1e-12 * s[0]).sum())
        return m, u[:, :rank] @ vh[:rank], rank
    if kind == "rank 16":
        m, p = constructed(short, long, torch.logspace(0, -1, 16, dtype=torch.float64), generator, device)
        return m, p, 16
    if kind == "condition 1e6":
        m, p = constructed(short, long, torch.logspace(0, -6, short, dtype=torch.float64), generator, device)
        return m, p, short
    if kind == "zero":
        m = torch.zeros(short, long, dtype=torch.float64, device=device)
        return m, m, 0
    m = torch.zeros(short, long, dtype=torch.float64, device=device)
    m[short // 3, long // 2] = -3.0
    p = torch.zeros_like(m)
    p[short // 3, long // 2] = -1.0
    return m, p, 1


def runs(short: int, long: int, restarts: bool):
    """(label, fn: bf16 (1, short, long) -> output) for each method."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    out = [("torch.optim.Muon", lambda x: _zeropower_via_newtonschulz(x[0], ns_methods.NS_COEFFICIENTS, 5, 1e-7)[None])]
    out += [(m, lambda x, m=m: ns_methods.newton_schulz(x, ns_method=m)) for m in ns_methods.NS_METHODS]
    out += [
        (f"{m}, float16", lambda x, m=m: ns_methods.newton_schulz(x, ns_method=m, ns_dtype="float16"))
        for m in ns_methods.NS_METHODS
    ]
    if restarts and ns_methods.uses_gram(short, long):
        schedule = ns_methods.ns_schedule("gram", 5)

        def gram_with(chosen):
            def run(x):
                x = x.bfloat16()  # (a copy: x is float32)
                ns_methods._normalise_(x, ns_methods.NS_EPS, ns_methods.POLAR_EXPRESS_SAFETY)
                return ns_methods._gram_newton_schulz(x, schedule, restarts=chosen)

            return run

        out += [("gram, restart before 2", gram_with((2,))), ("gram, restarts before 2, 4", gram_with((2, 4)))]
    return out


class Float16Peak(TorchDispatchMode):
    """The largest magnitude of any float16 tensor an op returns while it is active (inf if one overflowed)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float16 and t.numel():
                self.peak = max(self.peak, float(t.abs().max().float()))
        return out


def below_float16_normal(matrix: torch.Tensor) -> float:
    """The share of the normalised matrix's nonzero entries below float16's smallest normal number."""
    x = ns_methods.normalised(matrix.float())
    nonzero = x[x != 0]
    return float((nonzero.abs() < torch.finfo(torch.float16).tiny).float().mean()) if nonzero.numel() else 0.0


def measure(short, long, kind, generator, device, real, restarts, peaks: dict | None = None) -> list[tuple]:
    """A row per method; ``peaks`` gets each float16 method's largest intermediate, and "subnormal" the
    share of the input's entries below float16's normal range."""
    found = inputs(short, long, kind, generator, device, real)
    if found is None:
        return []
    matrix, polar, rank = found
    x = matrix.float()[None]
    if peaks is not None:
        peaks["subnormal"] = below_float16_normal(x[0])
    rows = []
    for label, fn in runs(short, long, restarts):
        if label.endswith("float16") and peaks is not None:
            with Float16Peak() as watch:
                output = fn(x.clone())[0].double()
            peaks[label] = watch.peak
        else:
            output = fn(x.clone())[0].double()
        finite = bool(torch.isfinite(output).all())
        if rank == 0:
            zero = 0.0 if finite and not output.any() else float("nan")
            rows.append((label, 0.0, float(output.abs().max()), zero, finite))
            continue
        gram = output @ output.T
        if finite:
            singular = torch.linalg.eigvalsh(gram).clamp(min=0).sqrt().flip(0)[:rank]
        else:
            singular = torch.full((1,), float("nan"))
        distance = float((output - polar).norm() / polar.norm())
        rows.append((label, float(singular.min()), float(singular.max()), distance, finite))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["debug", "moe", "8b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--restarts", action="store_true", help="also Gram Newton–Schulz with other restarts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = sorted({s for group in args.shapes for s in SHAPES[group]})
    started = time.monotonic()
    real = debug_model_momenta() if any(s in SHAPES["debug"] for s in shapes) else []
    labels = [label for label, _ in runs(*max(shapes, key=lambda s: ns_methods.uses_gram(*s)), args.restarts)]
    print(
        f"Newton–Schulz (5 steps, bf16; the float16 columns in float16) vs the exact polar factor U Vᵀ, {device.type}, "
        f"torch {torch.__version__}: "
        "per method, the output's smallest–largest singular value (over the input's rank) / "
        "‖X − U Vᵀ‖_F / ‖U Vᵀ‖_F"
    )
    print("| shape | input | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    bad, float16 = [], []
    for short, long in shapes:
        generator = torch.Generator().manual_seed(args.seed)
        for kind in INPUTS:
            cells, peaks = {}, {}
            rows = measure(short, long, kind, generator, device, real, args.restarts, peaks)
            if rows:
                float16.append((short, long, kind, peaks))
            for label, low, high, distance, finite in rows:
                cells[label] = f"{low:.3f}–{high:.3f} / {distance:.3f}" if finite else "NOT FINITE"
                if not finite or (kind == "zero" and distance != 0.0):
                    bad.append((short, long, kind, label))
            if cells:
                print(
                    f"| {short} x {long} | {kind} | " + " | ".join(cells.get(label, "") for label in labels) + " |",
                    flush=True,
                )
    print(
        f"{len(shapes)} shapes in {time.monotonic() - started:.0f} s; "
        + ("every output finite, a zero matrix gives zero" if not bad else f"FAILED: {bad}")
    )
    methods = [label for label in labels if label.endswith("float16")]
    print(
        "\nfloat16: the largest magnitude of any intermediate (float16 overflows at 65504), and the share of the "
        "normalised input's nonzero entries below float16's smallest normal number (6.1e-5: fewer significant bits)"
    )
    print("| shape | input | " + " | ".join(methods) + " | below 6.1e-5 |")
    print("|---|---|" + "---|" * (len(methods) + 1))
    for short, long, kind, peaks in float16:
        print(
            f"| {short} x {long} | {kind} | "
            + " | ".join(f"{peaks[m]:.3g}" for m in methods)
            + f" | {peaks['subnormal']:.1%} |"
        )
    overall = max(peaks[m] for *_, peaks in float16 for m in methods)
    print(
        f"largest float16 intermediate over every row: {overall:.3g} ({65504 / overall:.0f}x below float16's maximum)"
        if overall < float("inf")
        else "FAILED: a float16 intermediate overflowed"
    )


if __name__ == "__main__":
    main()
