"""Sizing a DMuon job before it runs: memory, traffic and Newton–Schulz per rank, and whether to run Z2 or Z3.

For a model (its weights' names and shapes) and a layout (replicate R x shard N x tensor T x
pipeline P, expert parallelism E), per rank:

* memory of FSDP2 + AdamW, DMuon-Z2 and DMuon-Z3: parameters, gradients, optimizer state, DMuon's
  packed buffers (between steps and at their peak), FSDP2's gathered weights (an estimate), and the
  total without activations;
* communication per step of the Muon targets against the floor (an all-reduce of their gradients
  over the data-parallel ranks), from ``titan_dmuon.plan.cost_model``;
* Newton–Schulz work per rank from the ownership plans ``build_plan`` makes, one owner per weight and
  with owner groups as the runtime plans them by default (an H200's stated figures: nothing is measured
  here): the busiest rank's time (its FLOPs at a given TFLOP/s and its groups' all-reduces), the groups
  formed, their Gram all-reduces and memory, beside the one-owner figures;
* which of Z2/Z3 to run on the plan that runs, and why.

    python -m titan_dmuon.sizing --model llama3 --flavor 8B --world 64
    python -m titan_dmuon.sizing --model deepseek_v3 --flavor 671B --shard 64 --ep 64 --pp 8
    python -m titan_dmuon.sizing --config train_configs/llama3_8b.toml

The figures follow the runtime: a dedicated weight lives whole (parameter dtype) on its shard
owner in every replica group; its gradient and momentum on its one global owner; each layer's
weights are broadcast into one packed buffer in the compute dtype, which Z2 keeps from forward to
backward (every layer: P_M per rank at the end of forward) and Z3 frees (two layers at a time,
the running one and the prefetched one); between steps the first layer's buffer is alive (its
broadcast for the next forward starts at the end of the step). FSDP2's weights are dim-0 shards
padded to ceil(rows / N) rows; AdamW keeps two moments and a step count. A member of an owner group
keeps its block instead (and the block's gradient and momentum; a wide weight's column blocks are
gathered in place, the weight laid out column-major), and the group's Gram workspace lives in the step.
``tests/distributed/test_sizing_memory.py`` holds these figures to what ``benchmarks/memory_table.py``
measures on the CPU-sized cases; ``tests/unit/test_sizing_groups.py`` the groups' to the stated rules.

Model weights come from ``sizing/model_shapes.py`` (shape tables without TorchTitan,
or TorchTitan's model on the meta device), imported only by ``main``; the rest is TorchTitan-free.
"""
