"""mpx for PyTorch: mpx's multi-tensor unscale-and-check and fused Adam/AdamW on torch tensors.

Everything runs on the tensors PyTorch owns, without a copy: CPU tensors on mpx's host
executor, CUDA tensors (in a CUDA build) on mpx's CUDA executor on PyTorch's current stream.
Dtypes: torch.float16, torch.bfloat16 and torch.float32; others raise mpx_torch.Error (a
ValueError) with mpx's message.

* non_finite_check_and_unscale_(grads, found_inf, inv_scale): a drop-in for
  torch._amp_foreach_non_finite_check_and_unscale_ (GradScaler's check).
* unscale_and_check_(grads, found_inf, inv_scale, names=None): the same, returning a
  GradientReport: which gradient held the first NaN or inf, per-tensor and global norms.
* Adam, AdamW: torch.optim.Optimizer subclasses over mpx's fused update, with float32
  master weights for 16-bit parameters; they take grad_scale and found_inf from
  torch.amp.GradScaler as torch's fused Adam does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from . import _C

Error = _C.Error
#: Whether this build runs CUDA tensors (otherwise CPU tensors only).
built_with_cuda: bool = bool(_C.cuda)

__all__ = ["Adam", "AdamW", "Error", "GradientReport", "built_with_cuda", "non_finite_check_and_unscale_",
           "unscale_and_check_"]


def non_finite_check_and_unscale_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                                  inv_scale: torch.Tensor) -> None:
    """grads[i] *= inv_scale in place, each value rounded once to its dtype; found_inf (a
    one-element float32 tensor) set to 1.0 when any gradient holds a NaN or inf, and left as
    it was otherwise. Arguments as torch._amp_foreach_non_finite_check_and_unscale_'s; on
    CUDA it only enqueues work on the current stream."""
    _C.non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)


@dataclass(frozen=True)
class GradientReport:
    """What mpx's check saw, in unscaled units (after the multiplication by inv_scale)."""

    found_nonfinite: bool
    first_nonfinite: int | None  #: index in the list of the first gradient holding a NaN or inf
    first_nonfinite_name: str | None  #: its name, when names were given
    norm: float  #: global L2 norm of all gradients (inf or NaN when one was found)
    norms: list[float]  #: L2 norm of each gradient, in list order
    names: list[str]

    def __str__(self) -> str:
        if self.found_nonfinite:
            what = f"'{self.first_nonfinite_name}' (gradient {self.first_nonfinite})" if self.first_nonfinite_name \
                else f"gradient {self.first_nonfinite}"
            bad = sum(1 for n in self.norms if not math.isfinite(n))
            return (f"non-finite gradients: {what} is the first of {bad} holding a NaN or inf "
                    f"(of {len(self.norms)}); skip this step")
        largest = max(range(len(self.norms)), key=self.norms.__getitem__, default=None)
        tail = "" if largest is None else f"; largest {self.names[largest]} {self.norms[largest]:.4g}"
        return f"{len(self.norms)} gradients finite, global norm {self.norm:.4g}{tail}"


def unscale_and_check_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
                       names: Sequence[str] | None = None) -> GradientReport:
    """non_finite_check_and_unscale_, then the report of what it found. `names` (one per
    gradient, e.g. from model.named_parameters()) label the report. Reading the report
    synchronises a CUDA stream."""
    grads = list(grads)
    if names is not None and len(names) != len(grads):
        raise ValueError(f"mpx_torch.unscale_and_check_: {len(names)} names for {len(grads)} gradients")
    labels = list(names) if names is not None else [f"gradient {i}" for i in range(len(grads))]
    found, first, norm, norms = _C.unscale_and_check_report(grads, found_inf, inv_scale)
    return GradientReport(found_nonfinite=found, first_nonfinite=first if first >= 0 else None,
                          first_nonfinite_name=labels[first] if first >= 0 and names is not None else None,
                          norm=norm, norms=list(norms), names=labels)


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam's update (lr, betas, eps, weight_decay as L2 added to the gradient)
    by mpx's fused multi-tensor kernel. 16-bit parameters are updated through a float32
    master copy (state "master"); the moments are float32 for every dtype. Under
    torch.amp.GradScaler it does what fused Adam does: a step whose found_inf is set
    changes nothing (not even the step count), and gradients are divided by grad_scale
    as they are read (here they are not written back unscaled).

    The step count is kept per parameter, as in PyTorch (state "step", an int64 tensor);
    parameters stepped together share one count, so a step is one launch per dtype.
    """

    _decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, amsgrad: bool = False, maximize: bool = False):
        kind = type(self).__name__
        if amsgrad:
            raise ValueError(f"mpx_torch.{kind}: amsgrad is not supported (mpx's Adam keeps no running maximum)")
        if maximize:
            raise ValueError(f"mpx_torch.{kind}: maximize is not supported; negate the loss instead")
        if weight_decay < 0:
            raise ValueError(f"mpx_torch.{kind}: weight_decay must be >= 0, got {weight_decay}")
        lr = float(lr)
        # mpx checks the hyperparameters (an empty step validates and returns).
        self._update()([], [], [], [], [], torch.zeros((), dtype=torch.int64), lr, betas[0], betas[1], eps,
                       weight_decay, None, None)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False)
        super().__init__(params, defaults)
        # torch.amp.GradScaler then hands over grad_scale and found_inf instead of
        # unscaling the gradients itself (as for fused=True).
        self._step_supports_amp_scaling = True

    def _update(self):
        return _C.adamw_step_ if self._decoupled else _C.adam_step_

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            self._split_idle_step_counts(group)
            calls: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
            fresh: dict[torch.device, torch.Tensor] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    if p.device not in fresh:
                        fresh[p.device] = torch.zeros((), dtype=torch.int64, device=p.device)
                    state["step"] = fresh[p.device]
                self._init_state(p, state)
                calls.setdefault(id(state["step"]), (state["step"], []))[1].append(p)
            beta1, beta2 = group["betas"]
            for steps, params in calls.values():
                device = steps.device
                states = [self.state[p] for p in params]
                self._update()(params, [p.grad for p in params], [s.get("master") for s in states],
                               [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps,
                               float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"],
                               None if grad_scale is None else grad_scale.to(device, non_blocking=True),
                               None if found_inf is None else found_inf.to(device, non_blocking=True))
        return loss

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if p.dtype != torch.float32 and "master" not in state:
            state["master"] = p.detach().to(torch.float32, copy=True).contiguous()

    def _split_idle_step_counts(self, group: dict) -> None:
        """A parameter without a gradient this step keeps its count (PyTorch skips it):
        it gets a count of its own when it shared one with parameters that do step."""
        holders: dict[int, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p in self.state and "step" in self.state[p]:
                holders.setdefault(id(self.state[p]["step"]), []).append(p)
        for ps in holders.values():
            idle = [p for p in ps if p.grad is None]
            if idle and len(idle) < len(ps):
                own = self.state[idle[0]]["step"].clone()
                for p in idle:
                    self.state[p]["step"] = own

    def reload_master_weights(self) -> None:
        """Copies 16-bit parameters into their float32 master copies, after you changed the
        parameters yourself (loaded or re-initialised them)."""
        with torch.no_grad():
            for state_p, state in self.state.items():
                if "master" in state:
                    state["master"].copy_(state_p)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim.Optimizer casts every saved tensor to its parameter's dtype; the
        # master copy and the moments must stay float32, so they are put back as saved.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        kept = {i: {k: v for k, v in state_dict["state"].get(i, {}).items()
                    if k in ("exp_avg", "exp_avg_sq", "master")} for i in saved_ids}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in kept[i].items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
        # Parameters whose counts agree share one again (one launch per step); PyTorch's
        # float32 counts become int64. Reading them synchronises, once per load.
        for group in self.param_groups:
            shared: dict[tuple[torch.device, int], torch.Tensor] = {}
            for p in group["params"]:
                state = self.state.get(p)
                if state is None or "step" not in state:
                    continue
                key = (p.device, int(state["step"]))
                if key not in shared:
                    shared[key] = torch.tensor(key[1], dtype=torch.int64, device=p.device)
                state["step"] = shared[key]


class AdamW(Adam):
    """torch.optim.AdamW's update (weight decay decoupled: w -= lr * weight_decay * w
    before the Adam step; default 0.01) by mpx's fused kernel; otherwise as Adam."""

    _decoupled = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad=amsgrad, maximize=maximize)
