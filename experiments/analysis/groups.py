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
    unused = [unused_settings(r) for r in records]
    varying = [f for f in fields if len({repr(r.get(f)) for r, idle in zip(records, unused) if f not in idle}) > 1]
    if not varying or varying == ["lr_rule"]:
        return "lr_rule"
    varying = ["lr_rule", *[f for f in varying if f != "lr_rule"]]
    for record, idle in zip(records, unused):
        record["group"] = ", ".join(f"{f}={record.get(f)}" for f in varying if f not in idle)
    return "group"
