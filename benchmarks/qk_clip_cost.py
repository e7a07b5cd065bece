"""QK-clip's cost per step on TorchTitan's llama3 debug model, with and without the clip, side by side.

    python benchmarks/qk_clip_cost.py [--batch 2] [--seq 256] [--iters 8]

One process, the debug model (6 layers, 16 heads of 16, fused wqkv, SDPA) on this machine's CPU:
forward + backward timed with the capture hooks on and off in alternation (the same weights and
batch), and the step side (gamma from the [layers x heads] maxima and the q/k row rescale of every
layer) timed alone. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

from titan_dmuon.integration import cpu

cpu.enable()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    import functools

    from torchtitan.models.llama3 import model_registry

    from titan_dmuon.integration.models.attention_clip import attention_descriptions
    from titan_dmuon.math.qk_clip_factors import clip_factors, role_exponent, row_map, scale_rows
    from titan_dmuon.optim.qk_clip import _capture

    config = model_registry("debugmodel").model
    cpu.use_sdpa_attention(config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    descriptions = attention_descriptions(model)
    heads = max(d.n_heads for d in descriptions)
    running = torch.full((len(descriptions), heads), float("-inf"))
    vocab = config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))

    def step():
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    hooks = []
    times = {"off": [], "on": []}
    step()  # warm-up
    for i in range(2 * args.iters):
        on = i % 2 == 1
        if on:
            hooks = [
                d.capture.register_forward_hook(functools.partial(_capture, running, slot, d), with_kwargs=True)
                for slot, d in enumerate(descriptions)
            ]
        start = time.perf_counter()
        step()
        times["on" if on else "off"].append(time.perf_counter() - start)
        for h in hooks:
            h.remove()
        hooks = []
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(
        f"forward+backward, batch {args.batch} x seq {args.seq}: without capture {1e3 * off:.1f} ms, "
        f"with capture {1e3 * on:.1f} ms (+{1e3 * (on - off):.1f} ms, {100 * (on - off) / off:.1f}%)"
    )

    weights = []
    for slot, d in enumerate(descriptions):
        by_param = {}
        for part in d.rows:
            by_param.setdefault(part.param, []).append(
                (part.heads, role_exponent(part.role, alpha=0.5, shared_keys=d.shared_keys))
            )
        for param, parts in by_param.items():
            weights.append((slot, param, *row_map(param.shape[0], parts)))
    running.fill_(1.0)
    start = time.perf_counter()
    for _ in range(args.iters):
        gamma = clip_factors(running, 0.5)
        with torch.no_grad():
            for slot, param, head, exponent in weights:
                scale_rows(param, gamma[slot], head, exponent)
    rescale = (time.perf_counter() - start) / args.iters
    print(f"step side (gamma + rescale of {len(weights)} q/k weights): {1e3 * rescale:.2f} ms per step")


if __name__ == "__main__":
    main()
