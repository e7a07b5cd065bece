"""TorchTitan's HF export of a DMuon job, loaded by ``transformers`` itself.

The last save with ``checkpoint.last_save_in_hf`` wrote safetensors only: ``from_pretrained``
needs ``config.json`` (and ``generation_config.json``) too, and a ``sharded/`` folder was left
beside the weights. DMuonCheckpointManager now writes both files from the model's own arguments
(titan_dmuon/integration/components/hf_export.py). Checked with transformers' own classes: a tiny llama3
(GQA, fused q/k/v, llama3 RoPE scaling) and a tiny dense qwen3 (q/k norms, head_dim set apart)
trained 2 steps with DMuon on 2 ranks, saved at step 2 as a DCP checkpoint and as an HF export;
``AutoModelForCausalLM.from_pretrained(export)`` gives the logits of TorchTitan's model loaded
from the DCP checkpoint; a tiny qwen3 MoE's config is checked the same way in one process.
"""

import json

import pytest
import torch
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import Counter
from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager

FAMILIES = {"llama3": th.tiny_llama3, "qwen3": th.tiny_qwen3}
STEP = 2


def _train_and_save(rank, world, folder, family):
    """2 DMuon steps, then TorchTitan's two saves of step 2 (the DCP checkpoint at the interval,
    the HF export as the last save), each by its own checkpoint manager (folders dcp/, hf/)."""
    config, spec = FAMILIES[family]()
    dims = th.parallel_dims(world)
    model, container = th.build((config, spec), dims, lr=0.02, param_dtype="float32")
    schedule = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=container, training_steps=STEP)
    counter = Counter()
    managers = {}
    for kind in ("dcp", "hf"):
        manager = DMuonCheckpointManager.Config(
            enable=True, folder=kind, interval=STEP, last_save_model_only=kind == "hf", last_save_in_hf=kind == "hf"
        )
        managers[kind] = manager.build(
            dataloader=Counter(),
            model_parts=[model],
            optimizers=container,
            lr_schedulers=schedule,
            states={"train_state": counter},
            sd_adapter=spec.state_dict_adapter(config, None),
            base_folder=folder,
        )
    th.train(model, container, dims, th.batches(STEP, world))
    counter.step = STEP
    managers["dcp"].save(STEP)
    managers["hf"].save(STEP, last_step=True)


def _titan_model_from_dcp(family, folder):
    """TorchTitan's model (unparallelized, one process) with the weights of the DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    config, _ = FAMILIES[family]()
    th.cpu.use_sdpa_attention(config)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # (the RoPE tables: buffers that no checkpoint holds)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(state)
    return model.eval()


def _titan_rope_frequencies(model) -> torch.Tensor:
    """The rotary frequencies of TorchTitan's RoPE table (llama3: complex exp(i pos f); qwen3: cos | sin)."""
    table = dict(model.named_buffers())["layers.0.attention.rope.cache"]
    if table.is_complex():
        return table[1].angle()
    half = table.shape[1] // 2
    return torch.atan2(table[1, half:], table[1, :half])[: half // 2]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_loads_the_export_and_gives_titans_logits(pool2, tmp_path, family):
    """fp32 both, the same arithmetic in other orders (TorchTitan's complex-number or cos/sin RoPE vs
    HF's rotate_half, SDPA vs HF's eager attention, the adapter's permuted q/k rows): the logits
    (|logit| < 4) agree to a few fp32 ulps (2.4e-7 measured); 1e-5 is 20 ulps, and below what a
    wrong config gives (RMSNorm eps 1e-6 instead of 1e-5: 2e-5; RoPE theta 1e4: 4e-4; a wrong
    head_dim or GQA grouping does not load or is far off). On 16 positions RoPE's scaling (llama3's
    low-frequency factor) hardly shows in the logits, so the rotary frequencies are compared
    directly: HF's, from config.json, equal TorchTitan's table to fp32 rounding."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    pool2.run(_train_and_save, str(tmp_path), family)
    export = tmp_path / "hf" / f"step-{STEP}"
    assert not (export / "sharded").exists()  # consolidated into the folder: not left beside it
    with open(export / "config.json") as f:
        assert json.load(f)["model_type"] == {"llama3": "llama", "qwen3": "qwen3"}[family]
    hf = AutoModelForCausalLM.from_pretrained(str(export), attn_implementation="eager").eval()
    GenerationConfig.from_pretrained(str(export))
    titan = _titan_model_from_dcp(family, str(tmp_path / "dcp" / f"step-{STEP}"))
    tokens = th.batches(1, 1, batch=2, seed=7)[0][:, : th.SEQ]
    with torch.no_grad():
        expected, got = titan(tokens), hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, _titan_rope_frequencies(titan), rtol=1e-6, atol=0)


def test_config_follows_the_model_arguments():
    """The written config is the model's, not a template's: GQA head counts, head_dim, the FFN
    width, eps, RoPE theta and scaling, tying; families without an HF architecture are named."""
    from titan_dmuon.integration.components.hf_export import NoHFConfig, hf_config

    llama_config = th.tiny_llama3(dim=96)[0]
    llama = hf_config(llama_config, bos_token_id=1, eos_token_id=2)
    # the norm's eps (a wrong one shows in the logits by only 2e-5 against the 1e-5 bound above)
    assert llama["rms_norm_eps"] == llama_config.norm.eps
    assert (
        llama["hidden_size"],
        llama["intermediate_size"],
        llama["num_attention_heads"],
        llama["num_key_value_heads"],
        llama["head_dim"],
        llama["num_hidden_layers"],
    ) == (96, 192, 4, 2, 24, 2)
    assert llama["rope_scaling"]["rope_type"] == "llama3" and llama["rope_theta"] == 500000
    assert (llama["bos_token_id"], llama["eos_token_id"], llama["tie_word_embeddings"]) == (1, 2, False)
    qwen3 = hf_config(th.tiny_qwen3()[0])
    assert (qwen3["head_dim"], qwen3["rope_scaling"], qwen3["rms_norm_eps"]) == (32, None, 1e-6)
    moe = hf_config(th.tiny_qwen3_moe(experts=8)[0])
    assert (moe["model_type"], moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (
        "qwen3_moe",
        8,
        2,
        32,
    )
    with pytest.raises(NoHFConfig, match="not llama3 or qwen3"):
        hf_config(th.tiny_deepseek_v3()[0])


@pytest.mark.parametrize("route_norm", [True, False])
def test_qwen3_moe_config_loads_in_transformers(tmp_path, route_norm):
    """qwen3 MoE (Qwen3MoeForCausalLM): TorchTitan's adapter's HF weights of a tiny model (8 experts,
    top 2; one process, its initial weights: the load-balancing bias is still zero) with the written
    config.json load in transformers and give TorchTitan's logits to bf16 rounding: TorchTitan's
    routed experts always compute in bf16 (its grouped matmul), HF's in fp32, so the bound is 2^-8
    of the logits' size (2.5e-3 here; 1.4e-4 measured); a wrong top-k or normalisation is off by
    1.5e-2 and more. With the top-k weights normalised (``route_norm``, HF's ``norm_topk_prob``) and
    not: regression, a config that always wrote True passed, the only model tested normalising."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from titan_dmuon.integration.components.hf_export import hf_config

    config, spec = th.tiny_qwen3_moe(experts=8)
    for layer in config.layers:
        if layer.moe is not None:
            layer.moe.router.route_norm = route_norm
    assert hf_config(config)["norm_topk_prob"] is route_norm
    state = th.initial_state((config, spec))
    with torch.device("meta"):
        titan = config.build()
    titan.to_empty(device="cpu")
    with torch.no_grad():
        titan.init_weights(buffer_device=None)
    titan.load_state_dict(state)
    hf_state = spec.state_dict_adapter(config, None).to_hf(dict(state))
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config)))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = th.batches(1, 1, batch=2, seed=7)[0][:, : th.SEQ]
    with torch.no_grad():
        expected, got = titan.eval()(tokens), hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=2**-8 * expected.abs().max().item())
