"""Host time per step: DMuon's hooks and step next to FSDP2's, on the fake process group.

    .venv/bin/python benchmarks/host_time.py [--steps 4]

On a GPU the host only issues work: what DMuon costs there per step is Python and
launches, which do not depend on the tensors' sizes but on how many layers, weights and
owners there are. So each configuration is TorchTitan's llama3 (fused q/k/v) with its real
layer count and ranks, tiny dims (collectives on the fake process group move nothing and
the CPU's compute is small): the debug model (6 layers) on 2 ranks, and the 8B model's
structure (32 layers) on 8 ranks. For DMuon-Z3 and FSDP2-Z3 + AdamW it profiles one
steady-state step and prints the CPU time inside ``DMuon::*`` and ``FSDP::*`` labels
(hooks, launches), the optimizer step, and DMuon's launches, as a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_dmuon.integration import cpu  # noqa: E402

cpu.enable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tests.support import titan_harness as th  # noqa: E402

CASES = [("llama3 debug structure (6 layers)", 6, 2), ("llama3 8B structure (32 layers)", 32, 8)]


def _one(layers: int, world: int, optimizer: str, steps: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model, container = th.build(
            th.tiny_llama3(n_layers=layers, dim=64), th.parallel_dims(world), optimizer=optimizer, lr=0.02
        )
        tokens = torch.randint(0, th.VOCAB, (2, th.SEQ + 1))

        def step():
            container.zero_grad()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            begin = time.perf_counter()
            container.step()
            return time.perf_counter() - begin

        handles = (
            [h for o in container.dmuon_optimizers() for h in o.dedicated_handles()] if optimizer == "dmuon" else []
        )
        for _ in range(steps - 1):  # warm-up: lazy init, the recorded layer order, optimizer state
            step()
        for handle in handles:
            handle.pop_comm_stats()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step_seconds = step()
            wall = time.perf_counter() - start
        totals = {"DMuon": 0.0, "FSDP": 0.0}
        for event in prof.events():
            for prefix in totals:
                if event.name.startswith(f"{prefix}::"):
                    totals[prefix] += event.cpu_time_total / 1e6
        launches = sum(n for h in handles for _, _, n in h.pop_comm_stats().values())
        return {"wall": wall, "step": step_seconds, **totals, "launches": launches}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(
        "| structure | ranks | configuration | step (host) | optimizer step "
        "| in DMuon:: labels | in FSDP:: labels | DMuon launches |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, layers, world in CASES:
        for label, optimizer in (("FSDP2-Z3 + AdamW", "AdamW"), ("DMuon-Z3", "dmuon")):
            r = _one(layers, world, optimizer, args.steps)
            print(
                f"| {name} | {world} | {label} | {1e3 * r['wall']:.1f} ms | {1e3 * r['step']:.1f} ms | "
                f"{1e3 * r['DMuon']:.1f} ms | {1e3 * r['FSDP']:.1f} ms | {r['launches']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
