"""When a run reads its validation accuracy, where it crosses each target, and which learning
rate reaches each target first. Torch-free: training and the store's readers share it.

Reads. A run of the ``target`` budget evaluates the validation split at *reads*. With
``read_spacing`` = None they fall every ``eval_every`` steps (and at max_steps). With
``read_spacing`` = r they are spaced geometrically,

    s_1 = 1,    s_{k+1} = s_k + max(1, floor(r s_k)),    and max_steps,

so every gap is at most r times the step it starts from: every step while r s < 1, then a fixed
fraction of the steps so far, with about log(max_steps) / log(1 + r) reads in all (r = 0.05: 155
reads up to 8000 steps, against 800 at a read every 10 steps). A crossing that the reads see
between s_{k-1} and s_k is located to within the gap, r s_{k-1}. Validation accuracy is not
monotone, though: a brief excursion above the target between two reads goes unseen, so the first
crossing the reads see tends to come later than the first at a read every step, the more so the
noisier the accuracy is from step to step. Against a read at every step, on digits with crossings
at 64-351 steps (27 crossings each): on a 431-image validation split at r = 0.05, +1.8% of S on
average (median +0.2%; +3.5% without the interpolation); on a 144-image split, +5.6% at r = 0.05
(median +1.9%, at most +30% on one run) and +1.1% at r = 0.02. On Fashion-MNIST MLPs (width 128,
a 3000-image split, crossings of 0.78-0.84 at 48-625 steps, 8 crossings) the excursions last a step
or two: +6.5% at r = 0.05, +7.3% at r = 0.02 (up to +22% on one crossing), +0.4% at r = 0.01. The
tests hold the first case under 2%; the Fashion-MNIST ladder presets read at r = 0.01.

Adaptive reads. With ``sparse_spacing`` = R (> r = ``read_spacing``) the spacing of the next read
is chosen at each read: r while some candidate still training may reach the lowest target its run
has not reached within twice the next sparse gap (:func:`near_target`: the peak accuracy so far,
the last two reads' slope, and the recent changes between reads as a margin for noise), R
otherwise. A sparse gap at whose end some candidate
first reached a target of its run is not taken as read: training goes back to the state at the read
before it (kept at every read; training is deterministic given the seed and the shuffles) and
re-trains the stretch with reads at spacing r, so that every crossing a run records is bracketed
by reads at most r·s apart, as under geometric reads (and interpolated the same way). The reads
are those of the lockstep: runs trained together read at the same steps, densely where any of
them is near a target, so which runs a sweep trains together (stacking, its ensemble memory, the
runs left when it resumed) can move an adaptive run's reads, and its crossings within their
r-brackets (geometric reads depend on the run alone). What remains of the reads' bias is an
excursion above a target that falls wholly inside a sparse gap, both ends below it; the
near-target margin makes that rare, and the tests bound the result against reads at every step as
they bound geometric reads.

Crossings. A candidate *reaches* target t at the first read k whose accuracy a_k >= t. With
geometric (or adaptive) reads its steps to t are interpolated linearly between the read before and that read,

    S_t = s_{k-1} + (t - a_{k-1}) / (a_k - a_{k-1}) (s_k - s_{k-1}),

which lies in (s_{k-1}, s_k]. A crossing at the first read, or under reads every
``eval_every`` steps, is the read's step itself, as earlier versions recorded it.

Best at each target. A run's candidates (its learning rates) each stop once, for every target
they have not reached, another candidate already has (at a read at or before theirs): none of
them could reach it in fewer steps, because every candidate is read at the same steps. So for
each target the fewest steps over the candidates that reached it is the exact minimum over all
of them, and :func:`best_at_targets` reads it from the stored curves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence


def read_steps(max_steps: int, *, eval_every: int, read_spacing: float | None) -> Iterator[int]:
    """The steps at which a run of at most ``max_steps`` steps reads its validation accuracy, in
    increasing order, max_steps last (see the module docstring)."""
    step = 0
    while step < max_steps:
        step = min(max_steps, step + eval_every) if read_spacing is None else next_read(step, max_steps, read_spacing)
        yield step


def next_read(step: int, max_steps: int, spacing: float) -> int:
    """The read after one at ``step`` at geometric ``spacing``: step + max(1, floor(spacing·step)),
    at most max_steps."""
    return min(max_steps, step + max(1, math.floor(spacing * step)))


def near_target(curve: Sequence[Mapping], ladder: Sequence[float], reached: Mapping[float, int],
                horizon: int) -> bool:
    """Whether a candidate's accuracy may reach the lowest target of ``ladder`` not in ``reached``
    within ``horizon`` steps after its last read (see *Adaptive reads* in the module docstring):
    true while it has fewer than two reads, else when

        max_k a_k + max(0, slope)·2·horizon + 2·max |Δa| >= t,

    the peak accuracy read so far, raised by the last gap's slope over twice the horizon and by
    twice the largest change between consecutive reads among the last eight (the noise a read
    can hide)."""
    target = next((t for t in ladder if t not in reached), None)
    if target is None:
        return False
    if len(curve) < 2:
        return True
    accuracies = [p["val_metric"] for p in curve]
    if not all(map(_finite, accuracies[-9:])):
        return False
    (s0, a0), (s1, a1) = ((p["step"], p["val_metric"]) for p in curve[-2:])
    recent = accuracies[-9:]
    noise = 2 * max(abs(b - a) for a, b in zip(recent, recent[1:]))
    return max(accuracies) + max(0.0, (a1 - a0) / (s1 - s0)) * 2 * horizon + noise >= target


def crossing(curve: Sequence[Mapping], target: float, *, interpolate: bool) -> tuple[float, int] | None:
    """(steps to ``target``, the read at which it was reached) for a curve of reads (``step``,
    ``val_metric``), or None if no read reached it (see the module docstring)."""
    previous = None
    for point in curve:
        if not all(_finite(point.get(key)) for key in ("train_loss", "val_loss", "val_metric")):
            return None  # diverged: a non-finite read (stored as null) is a curve's last
        accuracy = point["val_metric"]
        if accuracy >= target:
            step = point["step"]
            if not interpolate or previous is None:
                return float(step), step
            s0, a0 = previous
            return s0 + (target - a0) / (accuracy - a0) * (step - s0), step
        previous = (point["step"], accuracy)
    return None


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def rank(candidate: Mapping, reached: tuple[float, int] | None) -> tuple:
    """Larger is better: reached the target (``reached``: its steps and the read that reached it,
    from :func:`crossing`; None if not), else not diverged; fewer steps; then (ties, and every
    budget without a target) the validation accuracy and loss at the read that reached the target
    (else at the last read), the smaller lr and momentum. A candidate that diverged after reaching
    a target keeps its steps there, and a candidate that trained on towards a higher target is
    judged at this one as it was when it reached it."""
    curve = candidate["curve"]
    point = next(p for p in curve if p["step"] == reached[1]) if reached else curve[-1] if curve else {}
    diverged = bool(candidate.get("diverged")) and reached is None
    val = (0.0, 0.0) if diverged or point.get("val_loss") is None else (point["val_metric"], -point["val_loss"])
    return (reached is not None or not diverged, reached is not None, -(reached[0] if reached else 0.0), *val,
            -candidate["lr"], -(candidate.get("momentum") or 0.0))


def choose(candidates: Sequence[Mapping], target: float, *, interpolate: bool) -> tuple[int, float | None]:
    """(index of the best candidate at ``target`` by :func:`rank`, its steps to it or None)."""
    reached = [crossing(c["curve"], target, interpolate=interpolate) for c in candidates]
    best = max(range(len(candidates)), key=lambda k: rank(candidates[k], reached[k]))
    return best, reached[best] and reached[best][0]


def best_at_targets(candidates: Sequence[Mapping], targets: Sequence[float], *, max_steps: int,
                    interpolate: bool, tuned: bool) -> dict[float, dict]:
    """Per target, the run's result there from its candidates' stored curves: ``steps_to_target``
    (None if censored), ``censored``, ``diverged`` (the chosen candidate diverged), ``lr``,
    ``momentum`` and ``lr_at_grid_edge`` (``tuned`` and the chosen lr is the smallest or largest
    tried: it may not be the optimum).

    ``candidates``: ``{"lr", "momentum", "diverged", "curve": [{"step", "val_metric", ...}]}``."""
    if not candidates:
        raise ValueError("a run's results along its targets need its candidates' curves; got none")
    lrs = sorted({c["lr"] for c in candidates})
    out = {}
    for target in targets:
        index, steps = choose(candidates, target, interpolate=interpolate)
        best = candidates[index]
        diverged = steps is None and bool(best.get("diverged"))
        out[target] = {"steps_to_target": steps, "censored": int(steps is None and not diverged),
                       "diverged": int(diverged),
                       "lr": best["lr"], "momentum": best.get("momentum"),
                       "lr_at_grid_edge": int(tuned and best["lr"] in (lrs[0], lrs[-1])),
                       "max_steps": max_steps}
    return out
