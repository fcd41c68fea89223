"""Which runs are analysed together: a group is the runs that differ only in method, batch size
and seed."""

from __future__ import annotations

from affdiv.experiments.runs.config import RunConfig, unused_settings

# Config fields that never name a group: the grid's own axes.
_NOT_GROUPS = {"method", "batch_size", "seed"}


def label_groups(records: list[dict]) -> str:
    """Name each record's group; returns the column to analyse by.

    If only the LR rule varies that is ``lr_rule``; if other settings vary too (depth, width,
    activation, ...), each record gets a ``group`` label such as ``lr_rule=sqrt, depth=3,
    width=512``. A setting varies only if it does among the records that use it
    (:func:`~affdiv.experiments.runs.config.unused_settings`): the grid of the tuned rule, or the
    reference batch size of the scaling rules, names no group by itself. Nor does ``data_seed``
    when it equals every record's seed (``data_seed = "seed"`` in a preset).
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
    varying = [f for i, f in enumerate(fields) if len({key[i] for key, unused in idle.items() if f not in unused}) > 1]
    if not varying or varying == ["lr_rule"]:
        return "lr_rule"
    varying = ["lr_rule", *[f for f in varying if f != "lr_rule"]]
    labels = {key: ", ".join(f"{f}={record.get(f)}" for f in varying if f not in idle[key])
              for key, record in first.items()}
    for record, key in zip(records, settings):
        record["group"] = labels[key]
    return "group"
