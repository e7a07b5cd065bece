"""``ns_mode="exact"``: every Newton–Schulz matrix through ``torch.optim.Muon``'s own functional update, one
2-D matrix at a time (bitwise a single-process ``torch.optim.Muon`` step on any kernel), NorMuon on its output.
"""

from __future__ import annotations

from titan_dmuon.math.matrix_blocks import (
    contiguous_tile,
    matrix_at,
    put_tile,
)
from titan_dmuon.math.update_rules import adjusted_lr, apply_normuon, exact_mode_refusal, scalar, shares_memory


def exact_step(
    params,
    grads,
    momentum_buffers,
    blocks,
    *,
    lr,
    weight_decay,
    momentum,
    nesterov,
    ns_steps,
    ns_coefficients,
    eps,
    adjust_lr_fn,
    col_blocks,
    normuon_beta2,
    second_moments,
) -> int:
    """torch.optim.Muon's own functional update, one 2-D matrix at a time.

    A block that is one contiguous range of rows (of every column) is a view of
    the weight (contiguous, like a separate weight); an interleaved block
    (TorchTitan's fused wqkv) or a block of columns is gathered into a
    contiguous matrix and written back. Either way ``torch.optim._muon.muon``
    sees exactly the 2-D weight, gradient and momentum a model with separate
    weights would give it. With NorMuon, torch.optim.Muon's own steps around
    its Newton–Schulz (``exact_normuon``)."""
    from torch.optim._muon import muon as torch_muon

    refusal = exact_mode_refusal(adjust_lr_fn)
    if refusal is not None:
        raise ValueError(f"adjust_lr_fn = {adjust_lr_fn!r}: expected {refusal}")
    count = 0
    for i, (param, grad, buffer, param_blocks) in enumerate(zip(params, grads, momentum_buffers, blocks)):
        for e in range(param.shape[0] if param.ndim == 3 else 1):
            matrices = (matrix_at(param, e), matrix_at(grad, e), matrix_at(buffer, e))
            for block in param_blocks:
                for c, col_block in enumerate(col_blocks[i]):
                    weight, gradient, momentum_buffer = (contiguous_tile(m, block, col_block) for m in matrices)
                    hyper = dict(
                        lr=lr,
                        weight_decay=weight_decay,
                        momentum=momentum,
                        nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients),
                        ns_steps=ns_steps,
                        eps=eps,
                        adjust_lr_fn=adjust_lr_fn,
                    )
                    if normuon_beta2 is None:
                        torch_muon([weight], [gradient], [momentum_buffer], has_complex=False, **hyper)
                    else:
                        exact_normuon(
                            weight,
                            gradient,
                            momentum_buffer,
                            second_moments[i],
                            e,
                            block,
                            c,
                            beta2=normuon_beta2,
                            **hyper,
                        )
                    for target, updated in ((matrices[0], weight), (matrices[2], momentum_buffer)):
                        if not shares_memory(target, updated):  # (a copy: written back; a view already is)
                            put_tile(target, block, col_block, updated)
                    count += 1
    return count


def exact_normuon(
    weight,
    gradient,
    momentum_buffer,
    second_moment,
    e,
    block,
    c,
    *,
    beta2,
    lr,
    weight_decay,
    momentum,
    nesterov,
    ns_coefficients,
    ns_steps,
    eps,
    adjust_lr_fn,
) -> None:
    """torch.optim.Muon's single-tensor step (torch 2.14's ``_single_tensor_muon``) with NorMuon between
    its Newton–Schulz (torch's own ``_zeropower_via_newtonschulz``) and the update."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    lr = scalar(lr)
    momentum_buffer.lerp_(gradient, 1 - momentum)
    update = gradient.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    orthogonal = _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    orthogonal = apply_normuon(orthogonal, second_moment, e, block, c, beta2)
    weight.mul_(1 - lr * weight_decay)
    weight.add_(orthogonal, alpha=-adjusted_lr(lr, adjust_lr_fn, weight.shape))
