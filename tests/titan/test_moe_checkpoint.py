"""MoE checkpoints: TorchTitan's qwen3 MoE under DMuon through TorchTitan's CheckpointManager.

The model is tests/support/titan_harness.py's tiny qwen3 MoE: the same model classes, parallelize_fn
(with DMuon's dedication), state-dict hooks and checkpoint code as the shipped ``moe_debug``
config, with small dimensions, because the shipped one costs 15-30 s per step on 2 CPU cores.
Resuming happens in NEW processes (the pool is restarted between save and load).
"""

import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import Counter, full_parameters, merge_rank_states
from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager

STEPS = 4
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


class _Job:
    """A tiny qwen3 MoE made distributed as the trainer does, with its DMuon container, LR
    schedule and checkpoint manager (``hf``: the last save is model-only in HF safetensors,
    through the model's own TorchTitan state-dict adapter; ``hf_load``: an HF checkpoint to start
    from when the checkpoint folder is empty)."""

    def __init__(self, world, experts, folder, *, hf=False, hf_load=None):
        self.dims = th.parallel_dims(world)
        config, spec = th.tiny_qwen3_moe(experts=experts)
        self.model, self.container = th.build((config, spec), self.dims, lr=0.02)
        schedule = LRSchedulersContainer.Config(warmup_steps=2)
        self.schedule = schedule.build(optimizers=self.container, training_steps=STEPS)
        self.counter = Counter()
        self.adapter = spec.state_dict_adapter(config, None) if hf or hf_load else None
        manager_config = DMuonCheckpointManager.Config(
            enable=True,
            folder="ckpt",
            interval=1,
            last_save_model_only=hf,
            last_save_in_hf=hf,
            initial_load_path=hf_load,
            initial_load_in_hf=hf_load is not None,
            initial_load_model_only=True,
        )
        self.manager = manager_config.build(
            dataloader=Counter(),
            model_parts=[self.model],
            optimizers=self.container,
            lr_schedulers=self.schedule,
            states={"train_state": self.counter},
            sd_adapter=self.adapter,
            base_folder=folder,
        )
        self.experts = experts
        self.data = th.batches(STEPS, 1, batch=4)  # the same global batches on 2 and 4 ranks

    def train(self, until):
        losses = []
        while self.counter.step < until:
            losses += th.train(self.model, self.container, self.dims, [self.data[self.counter.step]])
            self.schedule.step()
            self.counter.step += 1
        return losses

    def handle(self):
        (handle,) = self.container.dmuon_optimizers()[0].dedicated_handles()
        return handle

    def expert_layout(self):
        """ "local" (FSDP2 shards the expert weights on dim 0, DMuon updates them in place) or
        "dedicated" (each expert weight has one owner)."""
        handle = self.handle()
        local = any("inner_experts" in e.fqn for e in handle.local_experts)
        dedicated = any("inner_experts" in e.fqn for e in handle.plan.entries)
        assert local != dedicated
        for p, state in self.container.dmuon_optimizers()[0].state.items():
            if p.ndim == 3 and "momentum_buffer" in state:  # local: a DTensor; dedicated: the owner's tensor
                assert isinstance(state["momentum_buffer"], DTensor) == local
                assert state["momentum_buffer"].shape == (self.experts, *p.shape[1:])
        return "local" if local else "dedicated"

    def weights(self):
        """Every parameter and state-dict buffer in full, by canonical name (collective)."""
        out = full_parameters(self.model, self.handle())
        persistent = set(self.model.state_dict())
        for name, b in self.model.named_buffers():
            if name in persistent:
                out[canonical_fqn(name)] = b.full_tensor() if isinstance(b, DTensor) else b.detach().clone()
        return out

    def state(self):
        """Weights, Muon momentum (experts' too: DTensors when local, the owner's plain tensor when
        dedicated), AdamW moments and step counts, in full, keyed by name; merge over ranks with merge_rank_states."""
        out = {f"weight/{k}": v for k, v in self.weights().items()}
        names = {id(p): canonical_fqn(n) for n, p in self.model.named_parameters()}
        for opt in self.container.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in opt.state.get(p, {}).items():
                        if isinstance(value, DTensor):
                            value = value.full_tensor()
                        out[f"{key}/{names[id(p)]}"] = value.detach().clone()
        return out


def _differing(a, b):
    return [k for k in b if not torch.equal(a[k], b[k])]


def _metadata(folder):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(folder).read_metadata().state_dict_metadata


def _read(folder, keys):
    """Tensors from a DCP checkpoint, read in this (non-distributed) process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    nested = _load_state_dict_from_keys(set(keys), storage_reader=FileSystemReader(folder))
    flat, mapping = flatten_state_dict(nested)
    return {".".join(map(str, mapping[k])): v for k, v in flat.items()}


def _expert_keys(layers=2):
    """(model key, flat optimizer key of its momentum) of every expert weight, in TorchTitan's names."""
    for layer in range(layers):
        for w in EXPERT_WEIGHTS:
            fqn = f"layers.{layer}.moe.routed_experts.inner_experts.{w}"
            yield fqn, f"optimizer.state.{fqn}.momentum_buffer"


def _check_experts_stored_once(folder, state, experts):
    """Every expert weight and its Muon momentum are in the checkpoint under TorchTitan's normal
    names (the model's key; the optimizer's flat ``state.<fqn>.momentum_buffer``), once (chunks that
    tile the tensor exactly), with the full 3-D shape, and with the values the job held."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _metadata(folder)
    keys = [k for pair in _expert_keys() for k in pair]
    for key in keys:
        entry = metadata[key]
        assert isinstance(entry, TensorStorageMetadata), key
        assert len(entry.size) == 3 and entry.size[0] == experts, (key, entry.size)
        covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
        assert covered == entry.size.numel(), (key, [(c.offsets, c.sizes) for c in entry.chunks])
    written = _read(folder, keys)
    for fqn, momentum in _expert_keys():
        assert torch.equal(written[fqn], state[f"weight/{fqn}"]), fqn
        assert torch.equal(written[momentum], state[f"momentum_buffer/{fqn}"]), momentum
        assert written[momentum].abs().sum() > 0, momentum  # a real momentum, not a placeholder


# ---- HF export -----------------------------------------------------------------------------------
def _export_hf(job, step):
    """TorchTitan's last-step save (model only, through the adapter's to_hf and DCP's HF writer);
    returns what it should hold: the model's full weights in HF names (wqkv split as TorchTitan's
    state-dict hook does, then the adapter's offline path, which splits out every expert of a
    plain full tensor), and the full weights under TorchTitan's names. Collective."""
    from torchtitan.models.common.attention import FusedQKVLinear

    job.manager.save(step, last_step=True)
    weights = job.weights()
    full = dict(weights)
    for module_name, module in job.model.named_modules():
        if isinstance(module, FusedQKVLinear):
            prefix = canonical_fqn(module_name) + "."
            split = {f"{prefix}wqkv.weight": full.pop(f"{prefix}wqkv.weight")}
            FusedQKVLinear._split_qkv_on_save(module, split, prefix, None)
            full.update(split)
    config, spec = th.tiny_qwen3_moe(experts=job.experts)
    return spec.state_dict_adapter(config, None).to_hf(full), weights


def _load_hf(rank, world, experts, export, folder):
    """A fresh job whose checkpoint folder is empty starts from the HF export (TorchTitan's
    initial_load_in_hf: DCP's HF reader, then the adapter's from_hf)."""
    job = _Job(world, experts, folder, hf_load=export)
    assert job.manager.load()
    return job.weights()


def _check_hf_loaded(loaded, weights):
    """Loaded back from HF into a DMuon job: every weight equal (expert_bias_E is not in the
    qwen3 adapter's map, so HF does not carry it)."""
    assert loaded.keys() == weights.keys()
    # (the trained bias may also have come back to zero, the loaded one's start)
    assert set(_differing(loaded, weights)) <= {f"layers.{n}.moe.expert_bias_E" for n in range(2)}


def _check_hf_export(folder, expected, weights, n_experts):
    """The export loads with safetensors and equals the model's full weights, key for key; each
    expert's gate/up/down_proj is its slice of w1/w3/w2 (checked without the adapter)."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]  # what HF's loaders read (sharded/ holds DCP's parts)
    exported = {}
    for name in sorted(set(weight_map.values())):
        exported.update(load_file(os.path.join(folder, name)))
    assert weight_map.keys() == exported.keys()
    assert exported.keys() == expected.keys(), sorted(set(exported) ^ set(expected))[:6]
    assert _differing(exported, expected) == []
    for layer in range(2):
        prefix = f"layers.{layer}.moe.routed_experts.inner_experts."
        for e in range(n_experts):
            hf = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(exported[hf + "gate_proj.weight"], weights[prefix + "w1_EFD"][e])
            assert torch.equal(exported[hf + "up_proj.weight"], weights[prefix + "w3_EFD"][e])
            assert torch.equal(exported[hf + "down_proj.weight"], weights[prefix + "w2_EDF"][e])


# ---- 1. resume is bit-exact ------------------------------------------------------------------------
def _straight(rank, world, experts, folder):
    job = _Job(world, experts, folder, hf=True)
    losses = job.train(STEPS)
    assert job.expert_layout() == "local"
    state = job.state()
    return losses, state, _export_hf(job, STEPS)


def _first_half(rank, world, experts, folder):
    job = _Job(world, experts, folder)
    losses = job.train(STEPS // 2)
    job.manager.save(job.counter.step)
    job.manager.close()
    return losses, job.state()


def _second_half(rank, world, experts, folder):
    job = _Job(world, experts, folder)
    assert job.manager.load()
    assert job.counter.step == STEPS // 2
    losses = job.train(STEPS)
    return losses, job.state()


def test_qwen3_moe_resume_is_bit_exact_and_exports_to_hf(pool2, tmp_path):
    """8 experts on 2 ranks (FSDP2 shards them on dim 0; DMuon runs per-expert Muon on each rank's 4,
    momentum a DTensor like the weight). 4 steps straight == 2 steps + save + new processes + load +
    2 steps, bit for bit: weights (experts, expert_bias_E), Muon momentum (experts' too), AdamW
    moments and step counts, and the loss at every step. The 2-step checkpoint holds every expert weight and its
    momentum once, under TorchTitan's names, full 3-D. The straight run ends with TorchTitan's
    last-step HF export (model only, the qwen3 adapter's to_hf), which safetensors loads back equal
    to the model's full weights, 8 per-expert gate/up/down_proj keys per layer included, and which
    a fresh DMuon job loads back (TorchTitan's initial_load_in_hf) into the same weights."""
    experts = 8
    straight = pool2.run(_straight, experts, str(tmp_path / "a"))
    first = pool2.run(_first_half, experts, str(tmp_path / "b"))
    pool2.restart()
    second = pool2.run(_second_half, experts, str(tmp_path / "b"))
    export = str(tmp_path / "a" / "ckpt" / f"step-{STEPS}")
    from_hf = pool2.run(_load_hf, experts, export, str(tmp_path / "c"))
    for rank in range(2):
        assert first[rank][0] + second[rank][0] == straight[rank][0]
    a, b = merge_rank_states(s for _, s, _ in straight), merge_rank_states(s for _, s in second)
    assert a.keys() == b.keys()
    for fqn, _ in _expert_keys():
        assert f"momentum_buffer/{fqn}" in a, fqn
    assert any(k.startswith("exp_avg/") for k in a)
    assert _differing(a, b) == []
    _check_experts_stored_once(str(tmp_path / "b" / "ckpt" / "step-2"), merge_rank_states(s for _, s in first), experts)
    expected, weights = (
        merge_rank_states(e for _, _, (e, _) in straight),
        merge_rank_states(w for _, _, (_, w) in straight),
    )
    _check_hf_export(export, expected, weights, experts)
    for loaded in from_hf:
        _check_hf_loaded(loaded, weights)


# ---- 2. resharding across the dim-0 / dedicated boundary -------------------------------------------------
def _save_for_reshard(rank, world, experts, folder):
    """2 steps, a full save, then 2 more steps on this layout; then TorchTitan's last-step HF
    export (or the error it raises), and the same export's outcome for TorchTitan's own FSDP2 +
    AdamW build of the same layout."""
    job = _Job(world, experts, folder, hf=True)
    job.train(2)
    job.manager.save(job.counter.step)
    state = job.state()
    losses = job.train(4)
    try:
        hf = ("exported", _export_hf(job, 4))
    except ValueError as e:  # TorchTitan's adapter cannot split an uneven Shard(0) expert weight
        hf = ("error", str(e))
    job.manager.close()
    titan = None
    if hf[0] == "error":  # the same adapter on TorchTitan's own FSDP2 + AdamW model of this layout
        config, spec = th.tiny_qwen3_moe(experts=experts)
        adamw, _ = th.build((config, spec), th.parallel_dims(world), optimizer="AdamW")
        try:
            titan = ("exported", sorted(spec.state_dict_adapter(config, None).to_hf(adamw.state_dict())))
        except ValueError as e:
            titan = ("error", str(e))
    return job.expert_layout(), state, losses, hf, titan


def _load_after_reshard(rank, world, experts, folder):
    job = _Job(world, experts, folder)
    assert job.manager.load(step=2)  # (step-4 is the HF export)
    assert job.counter.step == 2
    return job.expert_layout(), job.state(), job.train(4)


@pytest.mark.parametrize("save_world, load_world", [(2, 4), (4, 2)])
def test_reshard_across_the_expert_sharding_boundary(pool2, pool4, tmp_path, save_world, load_world):
    """3 experts: on 2 ranks FSDP2 shards each expert weight on dim 0 (2 + 1 experts, DMuon updates
    them in place, momentum a DTensor); on 4 ranks (more ranks than experts) each expert weight is
    dedicated (one owner holds the weight and momentum as plain tensors). A checkpoint written on
    either layout loads on the other with every weight, every expert's momentum and every AdamW
    moment identical; the next step's loss equals the saving layout's (same global batch and weights;
    the ranks' partial sums add in another order: observed <= 1e-7 relative, tolerance 1e-6) and
    training goes on. (Momentum does not enter that loss; it is compared bit for bit. The loss one
    Muon step later is no test of it: the two layouts' updates differ by bf16 Newton-Schulz rounding,
    observed up to 3e-4, more than zeroing the loaded expert momentum moves it.) The checkpoint
    stores each expert weight and momentum once, under TorchTitan's names, full 3-D.

    The same runs export to HF (TorchTitan's last-step save): dedicated experts (4 ranks) export
    and load back equal. Experts local with E % N != 0 (3 on 2 ranks) cannot be exported by
    TorchTitan itself: its adapter's to_hf raises the same ValueError for TorchTitan's own FSDP2 +
    AdamW model of that layout, so this is outside DMuon (moe-report §9); even E on N is
    covered by the resume test's export."""
    experts = 3
    pools = {2: pool2, 4: pool4}
    folder = str(tmp_path)
    saved = pools[save_world].run(_save_for_reshard, experts, folder)
    loaded = pools[load_world].run(_load_after_reshard, experts, folder)
    layout = {2: "local", 4: "dedicated"}
    assert {r[0] for r in saved} == {layout[save_world]} and {r[0] for r in loaded} == {layout[load_world]}
    before = merge_rank_states(r[1] for r in saved)
    after = merge_rank_states(r[1] for r in loaded)
    assert before.keys() == after.keys()
    for fqn, _ in _expert_keys():
        assert f"momentum_buffer/{fqn}" in before, fqn
    assert _differing(before, after) == []
    next_loss = saved[0][2][0]
    for _, _, losses in loaded:  # and training goes on
        assert losses[0] == pytest.approx(next_loss, rel=1e-6, abs=0), (losses, next_loss)
        assert torch.isfinite(torch.tensor(losses)).all()
    _check_experts_stored_once(os.path.join(folder, "ckpt", "step-2"), before, experts)

    exports = [r[3] for r in saved]
    if layout[save_world] == "dedicated":
        assert {outcome for outcome, _ in exports} == {"exported"}
        expected = merge_rank_states(result[0] for _, result in exports)
        weights = merge_rank_states(result[1] for _, result in exports)
        export = os.path.join(folder, "ckpt", "step-4")
        _check_hf_export(export, expected, weights, experts)
        for loaded in pools[save_world].run(_load_hf, experts, export, str(tmp_path / "from_hf")):
            _check_hf_loaded(loaded, weights)
    else:
        for _, _, _, hf, titan in saved:
            assert hf[0] == titan[0] == "error" and hf[1] == titan[1], (hf, titan)
            assert "cannot be evenly divided" in hf[1], hf[1]
