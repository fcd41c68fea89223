"""Which runs are analysed together: a group is the runs that differ only in method, batch size
and seed (and in how each method's step size is set, see ``_STEP_SIZE``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from affdiv.experiments.runs.config import RunConfig, unused_settings

# Config fields that never name a group: the grid's own axes, the target ladder (each target is
# analysed apart, ``analysis/critical_batch.py``), and a method's own network (part of the method).
_NOT_GROUPS = {"method", "batch_size", "seed", "target", "targets", "model", "model_digest"}
# How a method's step size is set: its rate (and the batch size it scales from) and momentum, or
# their search under the tuned rule. A preset may give each method its own ([method.NAME]), and each
# method is compared at its own step size; so such a setting that takes one value per method
# belongs to the method and names no group.
_STEP_SIZE = ("base_lr", "ref_batch_size", "momentum", "lr_grid", "grid_extensions", "momentum_grid")


def label_groups(records: list[dict]) -> str:
    """Name each record's group; returns the column to analyse by.

    If only the LR rule varies that is ``lr_rule``; if other settings vary too (depth, width,
    activation, ...), each record gets a ``group`` label such as ``lr_rule=sqrt, depth=3,
    width=512``. A setting varies only if it does among the records that use it
    (:func:`~affdiv.experiments.runs.config.unused_settings`): the grid of the tuned rule, or the
    reference batch size of the scaling rules, names no group by itself. Nor does ``data_seed``
    when it equals every record's seed (``data_seed = "seed"`` in a preset). A step-size setting
    (``_STEP_SIZE``) names groups only if it varies within one method among runs that share every
    other group setting (two studies' grids mixed in one store); one value per method (a preset's
    ``[method.NAME]`` table) keeps the methods in one group. When it does name groups it splits every
    method by its value, so a method whose own value no other method shares is alone in its group
    (the report says it has no baseline there). Any other setting that differs between methods (a
    ``[method.NAME]`` width, say) names groups too: methods are compared only under equal settings.
    """
    fields = [f for f in RunConfig.__dataclass_fields__ if f not in _NOT_GROUPS]
    if all(r.get("data_seed") == r.get("seed") for r in records):
        fields.remove("data_seed")  # each seed draws its own split: data_seed is the seed axis, not a group
    # Records with the same settings (compared by repr: 1, 1.0 and "1" differ) share their label and
    # their idle settings (unused_settings reads only lr_rule, optimizer, budget and momentum_grid,
    # all among the fields): the work is per distinct settings, not per record.
    settings = [tuple(map(repr, map(r.get, fields))) for r in records]
    first = {}
    for record, key in zip(records, settings):
        first.setdefault(key, record)
    idle = {key: unused_settings(record) for key, record in first.items()}

    def used(key, index):
        return fields[index] not in idle[key]

    def varies(index, keys):
        return len({key[index] for key in keys if used(key, index)}) > 1

    other = [i for i, f in enumerate(fields) if f not in _STEP_SIZE]
    varying = {i for i in other if varies(i, idle)}
    # The distinct settings each method ran with, per group of the other settings.
    per_method = defaultdict(set)
    for record, key in zip(records, settings):
        per_method[tuple(key[i] if used(key, i) else None for i in sorted(varying)), record.get("method")].add(key)
    varying |= {i for i, f in enumerate(fields)
                if f in _STEP_SIZE and any(varies(i, keys) for keys in per_method.values())}
    names = [fields[i] for i in sorted(varying)]
    if not names or names == ["lr_rule"]:
        return "lr_rule"
    if any("lr_rule" in record for record in records):  # records of runs; a CSV may have no such column
        names = ["lr_rule", *[f for f in names if f != "lr_rule"]]
    labels = {key: ", ".join(f"{f}={record.get(f)}" for f in names if f not in idle[key])
              for key, record in first.items()}
    for record, key in zip(records, settings):
        record["group"] = labels[key]
    return "group"


def label_curves(curves: list[dict], records: list[dict]) -> None:
    """Give each curve point its run's ``group`` label, as :func:`label_groups` put it on
    ``records`` (matched by ``config_hash``); nothing when the records have no such label. Not the
    curves' own labels: whether a setting names groups depends on the runs present, and runs without
    curve points would be missing. Raises ValueError for a point whose run has no record."""
    labels = {record["config_hash"]: record["group"] for record in records if "group" in record}
    if labels:
        for point in curves:
            if point.get("config_hash") not in labels:
                raise ValueError(f"curve point of run {point.get('config_hash')!r} has no record "
                                 "among the records analysed")
            point["group"] = labels[point["config_hash"]]


def default_primary_group(seeds: Mapping[str, set]) -> str:
    """The group whose verdict is the study's when none is named (``seeds``: {group: its seeds}):
    among the groups with the most seeds, "tuned" if it is one, else the first in sorted order. A
    group of fewer seeds (a CSV whose groups were run unequally) never decides for the study."""
    most = max(len(found) for found in seeds.values())
    candidates = sorted(group for group, found in seeds.items() if len(found) == most)
    return "tuned" if "tuned" in candidates else candidates[0]
