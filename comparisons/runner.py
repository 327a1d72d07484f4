"""Training one strategy on one task with one seed, recording loss, time and drift."""

from __future__ import annotations

import inspect
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import optimizers, parametrizations
from ..manifolds import Stiefel, kernels
from . import task as tasks_mod
from .precision import precision, rounding
from .strategies import Strategy, parse
from .table import SERIES

__all__ = ["RunConfig", "run", "parse_strategy", "build_optimizers", "check_optimizer"]


def parse_strategy(text: str) -> Strategy:
    """Parse a strategy name, checking it against the registered maps and optimizers and the
    methods registered tasks build themselves (`Task.extra_methods`)."""
    methods = [*parametrizations.available(), *tasks_mod.extra_methods()]
    return parse(text, methods=methods, optimizers=optimizers.available())


def unsupported(strategy: Strategy, task: type[tasks_mod.Task]) -> str | None:
    """Why ``strategy`` cannot run on ``task`` (a class), or None: a method only tasks build
    runs on the tasks that declare it (`Task.extra_methods`)."""
    builders = tasks_mod.extra_methods().get(strategy.method)
    own = strategy.method not in parametrizations.available()
    if builders and own and task.name not in builders:
        what = tasks_mod.get(builders[0]).extra_methods[strategy.method]
        names = ", ".join(builders)
        return f"{strategy.method!r} is a method of the task(s) {names} only ({what})"
    return None


@dataclass
class RunConfig:
    task: str
    strategy: str
    seed: int = 0
    steps: int = 200
    dtype: str = "float32"
    device: str = "cpu"
    record_every: int = 10
    task_options: dict = field(default_factory=dict)
    others: str = "adam(lr=1e-3)"  # optimizer of the unconstrained weights (sequence tasks)
    lr: float | None = None  # of a strategy that names none (--lr, else configs/learning_rates)


def _create(strategy: Strategy, name: str, params, lr: float, options: dict):
    params = list(params)
    try:
        return optimizers.create(name, params, lr=lr, **options)
    except (TypeError, ValueError) as exc:
        why = _named(name, params, lr, options, exc)
        raise type(exc)(f"strategy {strategy.name!r}, optimizer {name!r}: {why}") from exc


def _named(name: str, params: list, lr: float, options: dict, exc: Exception) -> str:
    """``exc``'s message, naming the option that fails alone where it names none (torch's own
    checks may fail inside: adam's ``betas=1`` raises "'int' object is not subscriptable")."""
    if any(k in str(exc) for k in options):
        return str(exc)
    for k, v in options.items():
        try:
            optimizers.create(name, params, lr=lr, **{k: v})
        except (TypeError, ValueError):
            p = inspect.signature(optimizers.get(name)).parameters.get(k)
            known = p is not None and p.default is not p.empty
            like = f"a value like its default {k}={p.default!r}" if known else "see its signature"
            return f"option {k}={v!r} ({type(v).__name__}) is refused ({exc}); allowed: {like}"
    return str(exc)


def check_optimizer(strategy: Strategy, lr: float | None) -> None:
    """Build the strategy's optimizer over a stand-in weight: its options are checked (naming
    the one refused) before any training, and a map's free parameters are not given to an
    optimizer that steps plain matrices as Stiefel points (pogo): it would constrain them."""
    options = {k: v for k, v in strategy.optimizer_options.items() if k != "lr"}
    weight = nn.Parameter(torch.zeros(2, 2))
    with warnings.catch_warnings():  # its warning about the stand-in is not the user's
        warnings.simplefilter("ignore", RuntimeWarning)
        opt = _create(strategy, strategy.optimizer, [weight], strategy.lr(lr), options)
    points = getattr(opt, "manifold_parameters", list)()
    a_map = strategy.method in parametrizations.available() and strategy.method != "riemannian"
    if points and a_map:
        raise ValueError(
            f"strategy {strategy.name!r}: {strategy.optimizer} steps plain matrices as points of "
            f"the Stiefel manifold, so it would constrain the free parameters of the "
            f"{strategy.method!r} map; allowed: riemannian+{strategy.optimizer}, or the map "
            "with another optimizer"
        )


def build_optimizers(
    task: tasks_mod.Task, model: nn.Module, strategy: Strategy, others: str, lr: float | None = None
) -> list[torch.optim.Optimizer]:
    """The strategy's optimizer for the constrained matrix, ``others`` for the rest (the
    scaled Cayley paper's split); a model the task builds itself (`Task.extra_methods`) has
    every trainable weight trained by the strategy's optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt_kw = {k: v for k, v in strategy.optimizer_options.items() if k != "lr"}
    if strategy.method in task.extra_methods:
        return [_create(strategy, strategy.optimizer, params, strategy.lr(lr), opt_kw)]
    constrained = task.constrained(model)
    cparams = [p for p in constrained.parameters() if p.requires_grad]
    ids = {id(p) for p in cparams}
    rest = [p for p in params if id(p) not in ids]
    out = [_create(strategy, strategy.optimizer, cparams, strategy.lr(lr), opt_kw)]
    if rest:
        other = parse("none+" + others)
        kw = {k: v for k, v in other.optimizer_options.items() if k != "lr"}
        out.append(_create(other, other.optimizer, rest, other.lr(), kw))
    return out


def run(cfg: RunConfig, progress=None) -> dict:
    """Train and return a JSON-ready record: steps, losses, wall times, drift, metrics."""
    strategy = parse_strategy(cfg.strategy)
    dtype, autocast = precision(cfg.dtype)  # Note [Autocast precisions]
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    task = tasks_mod.make(cfg.task, dtype, device, cfg.seed, **cfg.task_options)
    reason = unsupported(strategy, type(task))
    if reason is not None:
        raise ValueError(f"strategy {cfg.strategy!r} on task {cfg.task!r}: {reason}")
    model = task.build(strategy.method, strategy.method_options)  # in the task's dtype
    opts = build_optimizers(task, model, strategy, cfg.others, cfg.lr)

    record = dict(task=cfg.task, strategy=strategy.name, seed=cfg.seed, dtype=cfg.dtype)
    record.update(device=cfg.device, task_options=task.describe(), lr=strategy.lr(cfg.lr))
    record.update(optimum=task.optimum, baseline=task.baseline, diverged=False)
    record.update({k: [] for k in ("step", *SERIES)})
    record["threads"] = torch.get_num_threads()  # the CPU clock counts this thread only
    elapsed = cpu = 0.0
    peak = None  # the largest drift of any step, recorded or not (`higher`)
    for step in range(cfg.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        for o in opts:
            o.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss = task.loss(model, step)
        loss.backward()
        for o in opts:
            o.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed, cpu = elapsed + time.perf_counter() - t0, cpu + time.thread_time() - c0
        value = float(loss.detach())
        drift = _drift(task, model)  # every step: the steps between records have a drift too
        peak = higher(peak, drift)
        if step % cfg.record_every == 0 or step == cfg.steps - 1 or not math.isfinite(value):
            now = (step, value, elapsed, drift, cpu)
            for k, v in zip(("step", *SERIES), now, strict=True):
                record[k].append(v)
        if progress is not None:
            progress.update(1)
        if not math.isfinite(value):
            record["diverged"] = True
            break
    record["max_drift"] = peak
    record["final_loss"] = record["loss"][-1]
    record["metrics"] = task.evaluate(model)
    if task.optimum is not None:
        tol = rounding(cfg.dtype, task.optimum, task)
        record["gap"] = gap_to_optimum(record["final_loss"], task.optimum, tol)
    # a map's weight is exact whatever trains it; a Riemannian weight is as its optimizer
    feasible = strategy.method != "riemannian" or optimizers.info(strategy.optimizer).feasible
    record["off_manifold"] = off_manifold(record, task.weight(model), feasible)
    record["failed"] = failure(record, task)
    return record


#: ‖XᴴX − I‖_F up to which the point of an optimizer that stays near the manifold by
#: design (``feasible=False``: landing, pogo) counts as on it, in every dtype: its distance
#: follows its steps, not the rounding, and its projection is within about half of it
INFEASIBLE_ATOL = 1e-3


@torch.no_grad()
def off_manifold(record: dict, weight: torch.Tensor | None, feasible: bool = True) -> str | None:
    """Why a run ended off the manifold, or None: its final ‖XᴴX − I‖_F is above the tolerance
    of `Stiefel.check_point_on_manifold` (100·n·eps of the weight's dtype; at least
    `INFEASIBLE_ATOL` for an optimizer that is not ``feasible``), or its final loss is below
    the optimum beyond rounding (no point on the manifold is)."""
    drift = record["drift"][-1] if record["drift"] else None
    if weight is not None and drift is not None and math.isfinite(drift):
        n, m = sorted(weight.shape[-2:], reverse=True)
        tol = Stiefel(n, m, complex=weight.is_complex()).default_atol(weight.dtype)
        tol = tol if feasible else max(tol, INFEASIBLE_ATOL)
        if drift > tol:
            return f"‖XᴴX − I‖_F {drift:.3g} > {tol:.2g}"
    if record.get("gap", 0.0) < 0:
        return f"loss {-record['gap']:.3g} below the optimum"
    return None


def gap_to_optimum(final: float, optimum: float, tol: float) -> float:
    """``final − optimum``, 0 within the rounding ``tol`` on either side (an ulp above is at it)."""
    return 0.0 if abs(final - optimum) <= tol else final - optimum


def failure(record: dict, task: tasks_mod.Task) -> str | None:
    """Why a run failed, or None: ``"diverged"`` (a loss not finite), or why it did not converge:
    it ended off the manifold (`off_manifold`), its final gap to a known optimum is above
    `Task.converged_fraction` of its first; with no optimum its final loss is above the baseline
    (chance level) or a held-out metric at chance."""
    if record["diverged"] or not math.isfinite(record["final_loss"]):
        return "diverged"
    if record.get("off_manifold"):  # its loss is not the loss of a point of the problem
        return f"off the manifold: {record['off_manifold']}"
    if task.optimum is not None:
        gap, start = record["final_loss"] - task.optimum, record["loss"][0] - task.optimum
        if gap > task.converged_fraction * start:
            return f"gap {gap:.3g} above {task.converged_fraction:g} of its first, {start:.3g}"
    elif task.baseline is not None and record["final_loss"] > task.baseline:
        return f"final loss {record['final_loss']:.3g} above the baseline {task.baseline:.3g}"
    for key, level in task.chance.items():
        value = record["metrics"].get(key)
        if value is not None and value <= level:
            return f"{key} {value:.3g} at or below chance {level:.3g}"
    return None


def higher(peak: float | None, value: float | None) -> float | None:
    """The larger of two drifts (None: not measured); a NaN, once seen, stays."""
    keep = value is None or (peak is not None and (math.isnan(peak) or value <= peak))
    return peak if keep else value


@torch.no_grad()
def _drift(task: tasks_mod.Task, model: nn.Module) -> float | None:
    w = task.weight(model)
    if w is None:
        return None
    return float(kernels.orthogonality_error(w.detach()).max())
