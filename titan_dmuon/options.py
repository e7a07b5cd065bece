"""DMuon's optimizer options, each declared once: name, default, check.

``DMuon`` takes them as keyword arguments (and per param group); TorchTitan's
``[optimizer]`` section and ``with_dmuon`` take the same names. Everything
else (the container's config fields, the TOML key lists, the checks of every
door) is derived from ``DMuonOptions``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from titan_dmuon.math.muon_update import NS_MODES
from titan_dmuon.math.ns_methods import NS_COEFFICIENTS, NS_DTYPES, NS_EPS, NS_METHODS, NS_STEPS
from titan_dmuon.math.update_rules import ADJUST_LR_FNS, exact_mode_refusal

ADJUST_LR_FN_NAMES = tuple(f for f in ADJUST_LR_FNS if f is not None)  # (unset: None)
LR_KEYS = ("lr", "adamw_lr")  # may be a 1-element tensor, as torch.optim.Muon's and AdamW's lr


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_lr(value) -> bool:
    """A number, or a 1-element floating-point tensor (torch.optim.Muon takes one for compiled steps)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return _is_number(value)


class OptionError(ValueError):
    """A DMuon option out of range; ``key`` names it."""

    def __init__(self, key: str, value, expected: str) -> None:
        super().__init__(f"{key} = {value!r}: expected {expected}")
        self.key, self.value, self.expected = key, value, expected


@dataclass(frozen=True, kw_only=True)
class DMuonOptions:
    """Muon's settings for the dedicated weights, AdamW's (``adamw_*``) for the rest.

    The Muon defaults are ``torch.optim.Muon``'s, the AdamW ones ``torch.optim.AdamW``'s
    (betas as TorchTitan's)."""

    lr: float = 1e-3
    """Muon's learning rate."""
    weight_decay: float = 0.1
    """Muon's decoupled weight decay."""
    momentum: float = 0.95
    """Muon momentum."""
    nesterov: bool = True
    """Muon Nesterov momentum."""
    ns_steps: int = NS_STEPS
    """Newton–Schulz iterations."""
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    """(a, b, c) of the quintic Newton–Schulz step, torch.optim.Muon's; ns_method "torch" only."""
    eps: float = NS_EPS
    """Newton–Schulz's input is divided by its Frobenius norm clamped at eps (torch.optim.Muon's)."""
    adjust_lr_fn: Literal[ADJUST_LR_FN_NAMES] | None = None
    """Muon per-shape learning-rate scaling, as torch.optim.Muon's (unset = "original")."""
    ns_mode: Literal[NS_MODES] = "batched"
    """"batched": equally shaped matrices share one Newton–Schulz call (fast; torch.optim.Muon up to
    GEMM rounding); "exact": each matrix through torch.optim.Muon's own update (bitwise on any kernel)."""
    ns_method: Literal[NS_METHODS] = "torch"
    """Newton–Schulz method: "torch" (torch.optim.Muon's coefficients), "polar_express" (the Polar Express
    per-step schedule) or "gram" (the same, by Gram Newton–Schulz where that takes fewer FLOPs); see
    ``titan_dmuon.math``. ns_mode "exact" runs "torch" only. Job-wide (not a param-group option, not
    in checkpoints)."""
    ns_dtype: Literal[NS_DTYPES] = "bfloat16"
    """The Newton–Schulz iteration's dtype: "bfloat16" (torch.optim.Muon's) or "float16" (3 more mantissa
    bits; the input normalised in float32 first), for every ns_method; ns_mode "exact" runs "bfloat16"
    only. Job-wide (not a param-group option, not in checkpoints)."""
    normuon_beta2: float | None = None
    """NorMuon (arXiv 2510.05491): the decay of a per-row second moment of each Newton–Schulz output,
    which rescales its rows (then its Frobenius norm back to the output's), over whole rows on the owner;
    unset: Muon. Job-wide (not a param-group option); its state is in checkpoints."""
    ns_graphs: bool = False
    """Replay each Newton–Schulz batch from a CUDA graph (captured on its second step, one per batch of each
    shape class, its buffers the step's workspace): the host launches one graph instead of ~30 kernels per
    iteration. CUDA only, ns_mode "batched"; on other devices its code path runs eagerly. Job-wide (not a
    param-group option, not in checkpoints)."""
    adamw_lr: float = 1e-3
    """AdamW learning rate of the non-Muon parameters (with TorchTitan: of the catch-all param group,
    pattern ".*"; other param groups keep their own settings)."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's betas for the non-Muon parameters."""
    adamw_eps: float = 1e-8
    """AdamW's eps for the non-Muon parameters."""
    adamw_weight_decay: float = 0.1
    """AdamW's decoupled weight decay for the non-Muon parameters."""
    qk_clip_threshold: float | None = None
    """QK-clip (MuonClip) threshold tau on each attention head's largest pre-softmax logit; None: off.
    Job-wide (not a param-group option)."""
    qk_clip_alpha: float = 0.5
    """QK-clip's split of gamma between q (gamma ** alpha) and k (gamma ** (1 - alpha)) rows, in [0, 1]."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ns_coefficients", tuple(self.ns_coefficients))
        object.__setattr__(self, "adamw_betas", tuple(self.adamw_betas))
        for key in LR_KEYS:
            if not _is_lr(getattr(self, key)) or getattr(self, key) < 0:
                raise OptionError(key, getattr(self, key), "a number >= 0 (or a 1-element tensor)")
        for key in ("weight_decay", "adamw_weight_decay", "adamw_eps", "eps"):
            if not _is_number(getattr(self, key)) or getattr(self, key) < 0:
                raise OptionError(key, getattr(self, key), "a number >= 0")
        if not _is_number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise OptionError("momentum", self.momentum, "a number in [0, 1)")
        if not isinstance(self.nesterov, bool):
            raise OptionError("nesterov", self.nesterov, "true or false")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool) or not 1 <= self.ns_steps < 100:
            raise OptionError("ns_steps", self.ns_steps, "an integer in [1, 100)")
        if len(self.ns_coefficients) != 3 or not all(_is_number(c) for c in self.ns_coefficients):
            raise OptionError("ns_coefficients", self.ns_coefficients, "three numbers")
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise OptionError("adjust_lr_fn", self.adjust_lr_fn, f"one of {ADJUST_LR_FNS}")
        if self.ns_mode not in NS_MODES:
            raise OptionError("ns_mode", self.ns_mode, f"one of {NS_MODES}")
        if self.ns_mode == "exact" and exact_mode_refusal(self.adjust_lr_fn) is not None:
            raise OptionError("adjust_lr_fn", self.adjust_lr_fn, exact_mode_refusal(self.adjust_lr_fn))
        if self.ns_method not in NS_METHODS:
            raise OptionError("ns_method", self.ns_method, f"one of {NS_METHODS}")
        if self.ns_mode == "exact" and self.ns_method != "torch":
            raise OptionError(
                "ns_method",
                self.ns_method,
                "'torch' with ns_mode 'exact' (torch.optim.Muon's own update), or ns_mode 'batched'",
            )
        if not isinstance(self.ns_graphs, bool):
            raise OptionError("ns_graphs", self.ns_graphs, "true or false")
        if self.ns_graphs and self.ns_mode == "exact":
            raise OptionError(
                "ns_graphs",
                self.ns_graphs,
                "false with ns_mode 'exact' (torch.optim.Muon's own update, one matrix at a time), "
                "or ns_mode 'batched'",
            )
        if self.ns_dtype not in NS_DTYPES:
            raise OptionError("ns_dtype", self.ns_dtype, f"one of {NS_DTYPES}")
        if self.ns_mode == "exact" and self.ns_dtype != "bfloat16":
            raise OptionError(
                "ns_dtype",
                self.ns_dtype,
                "'bfloat16' with ns_mode 'exact' (torch.optim.Muon's own update), or ns_mode 'batched'",
            )
        if self.normuon_beta2 is not None and (
            not _is_number(self.normuon_beta2) or not 0.0 <= self.normuon_beta2 < 1.0
        ):
            raise OptionError("normuon_beta2", self.normuon_beta2, "a number in [0, 1), or unset (Muon)")
        if self.ns_method != "torch" and self.ns_coefficients != NS_COEFFICIENTS:
            raise OptionError(
                "ns_coefficients",
                self.ns_coefficients,
                f"torch.optim.Muon's {NS_COEFFICIENTS} with ns_method {self.ns_method!r} (its own "
                "per-step schedule), or ns_method 'torch'",
            )
        if len(self.adamw_betas) != 2 or not all(_is_number(b) and 0.0 <= b < 1.0 for b in self.adamw_betas):
            raise OptionError("adamw_betas", self.adamw_betas, "two numbers in [0, 1)")
        if self.qk_clip_threshold is not None and (
            not _is_number(self.qk_clip_threshold) or not 0.0 < self.qk_clip_threshold < float("inf")
        ):
            raise OptionError("qk_clip_threshold", self.qk_clip_threshold, "a finite number > 0, or unset (off)")
        if not _is_number(self.qk_clip_alpha) or not 0.0 <= self.qk_clip_alpha <= 1.0:
            raise OptionError("qk_clip_alpha", self.qk_clip_alpha, "a number in [0, 1]")

    def muon(self) -> dict:
        """The Muon group settings, under their own names."""
        return {key: getattr(self, key) for key in MUON_KEYS}

    def adamw(self) -> dict:
        """The AdamW group settings, under AdamW's names (``lr``, ``betas``, ``eps``, ``weight_decay``)."""
        return {plain: getattr(self, key) for key, plain in ADAMW_KEYS.items()}


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(DMuonOptions))
ADAMW_KEYS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps", "adamw_weight_decay": "weight_decay"}
# One value for the whole optimizer, not per param group, kept out of the param groups and so out of
# checkpoints: ns_method, ns_dtype and ns_graphs are how the step computes, not training state (a job may resume with
# another); normuon_beta2 is the job's choice of rule (its second moments are in the optimizer state, and a
# job that resumes decides whether it uses them, not the checkpoint).
JOB_KEYS = ("ns_method", "ns_dtype", "ns_graphs", "normuon_beta2", "qk_clip_threshold", "qk_clip_alpha")
MUON_KEYS = tuple(name for name in OPTION_NAMES if name not in ADAMW_KEYS and name not in JOB_KEYS)
DEFAULTS = DMuonOptions()


# ---- rules that need each whole matrix on one rank (no owner group) ------------------------------------
def whole_matrix_rules(*, ns_mode: str, ns_dtype: str, normuon_beta2: float | None) -> list[tuple[str, str]]:
    """The rules among these settings that need each Muon matrix whole on one rank, each as (what it is,
    how else to run): ``ns_mode`` "exact" (torch.optim.Muon's own update on one owner), NorMuon's per-row
    statistics, the float16 iteration (an owner group's Newton–Schulz runs in bf16). Written once: DMuon
    refuses a grouped weight under each (``check_whole_matrix_rules``), TorchTitan's door turns groups off."""
    rules = []
    if ns_mode == "exact":
        rules.append(("ns_mode 'exact' is torch.optim.Muon's own update on one owner", "or use ns_mode 'batched'"))
    if normuon_beta2 is not None:
        rules.append(
            (
                "NorMuon (normuon_beta2) normalises each row of the whole orthogonalised matrix on one owner",
                "or leave normuon_beta2 unset",
            )
        )
    if ns_dtype != "bfloat16":
        rules.append(
            (
                f"ns_dtype {ns_dtype!r} iterates on one owner (an owner group's Newton–Schulz runs in bfloat16)",
                "or use ns_dtype 'bfloat16'",
            )
        )
    return rules


def check_whole_matrix_rules(
    param_groups: list[dict], handles: list, *, ns_dtype: str, normuon_beta2: float | None
) -> None:
    """ValueError (on every rank: the plan and the options are the same everywhere) when a weight of an
    owner group is to get a rule that needs its whole matrix on one rank (``whole_matrix_rules``; ns_mode
    is a param group's)."""
    for group in param_groups:
        if not group.get("use_muon"):
            continue
        for rule, other in whole_matrix_rules(ns_mode=group["ns_mode"], ns_dtype=ns_dtype, normuon_beta2=normuon_beta2):
            for p in group["params"]:
                member = next((m for h in handles if (m := h.member_of(p)) is not None), None)
                if member is not None and member.group is not None:
                    raise ValueError(
                        f"{rule}, and the plan split {member.fqn!r} over an owner group of {member.group.size} "
                        "ranks: dedicate with owner_groups=None (TorchTitan: optimizer.owner_groups = false, which "
                        f"these settings imply there), {other}"
                    )
