"""convert(..., following_norm=...): which normalisation modules go, which stay, and that every one
kept beside a swapped layer under "remove" is named in a warning (never kept silently). The README's
convert example runs here as written."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from affdiv.layers import AffineLike, PatchNormConv1d, PatchNormConv2d, convert


def _records(records):
    return [(r.path, r.old_type, r.new_type, r.weights_kept) for r in records]


def _no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def test_remove_takes_out_the_batchnorm2d_after_a_swapped_conv2d():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
    conv_weight = cnn[0].weight
    bn_parameters = {id(p) for p in cnn[1].parameters()}
    records = _no_warning(convert, cnn, following_norm="remove")
    assert _records(records) == [("0", "Conv2d", "PatchNormConv2d", True), ("1", "BatchNorm2d", "Identity", False)]
    assert type(cnn[0]) is PatchNormConv2d and cnn[0].weight is conv_weight and type(cnn[1]) is nn.Identity
    assert not bn_parameters & {id(p) for p in cnn.parameters()}  # γ, β gone with the running statistics
    assert cnn(torch.randn(2, 3, 5, 5)).shape == (2, 4, 5, 5)

    seq = nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.Tanh())
    assert _records(_no_warning(convert, seq, following_norm="remove")) == [
        ("0", "Conv1d", "PatchNormConv1d", True), ("1", "BatchNorm1d", "Identity", False)]
    assert type(seq[0]) is PatchNormConv1d


def test_keep_leaves_every_norm_without_a_warning():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2), nn.LayerNorm(2))
    records = _no_warning(convert, model)  # following_norm="keep" is the default
    assert [r.new_type for r in records] == ["PatchNormConv2d", "AffineLike"]
    assert type(model[1]) is nn.BatchNorm2d and type(model[4]) is nn.LayerNorm


@pytest.mark.parametrize("build, kept, why", [
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4)), "'1' (GroupNorm",
     "after a swapped Conv2d: only a BatchNorm2d is removed there"),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4)), "'1' (InstanceNorm2d",
     "only a BatchNorm2d"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.GroupNorm(2, 4)), "'1' (GroupNorm",
     "after a swapped Linear: only a LayerNorm or RMSNorm or BatchNorm1d is removed there"),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4)), "'1' (SyncBatchNorm", "only a BatchNorm2d"),
])
def test_remove_names_every_norm_it_keeps_after_a_swapped_layer(build, kept, why):
    model = build()
    norm = model[1]
    with pytest.warns(UserWarning, match=re.escape(kept)) as caught:
        records = convert(model, following_norm="remove")
    assert len(caught) == 1 and why in str(caught[0].message)
    assert model[1] is norm and [r.path for r in records] == ["0"]


class _BasicBlock(nn.Module):
    """A ResNet block: conv and norm are attributes of a plain Module, so "follows" is undefined."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.downsample = nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.downsample(x))


def test_remove_warns_about_the_norms_of_a_block_that_is_not_a_sequential():
    block = _BasicBlock()
    with pytest.warns(UserWarning) as caught:
        records = convert(block, following_norm="remove")
    (message,) = [str(w.message) for w in caught]
    assert "'bn1' (BatchNorm2d beside a swapped layer in a _BasicBlock, not an nn.Sequential" in message
    assert "'bn2' (BatchNorm2d" in message and "downsample" not in message
    assert type(block.bn1) is nn.BatchNorm2d and type(block.bn2) is nn.BatchNorm2d
    assert ("downsample.1", "BatchNorm2d", "Identity", False) in _records(records)  # in a Sequential: removed

    # skip= keeps them without the warning
    block = _BasicBlock()
    _no_warning(convert, block, following_norm="remove", skip=lambda path, m: path in ("bn1", "bn2"))
    assert type(block.bn1) is nn.BatchNorm2d and type(block.conv1) is PatchNormConv2d


def test_a_norm_before_the_swapped_layer_or_after_an_unswapped_one_stays_without_a_warning():
    pre_norm = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Tanh())
    assert [r.path for r in _no_warning(convert, pre_norm, following_norm="remove")] == ["1"]
    assert type(pre_norm[0]) is nn.LayerNorm
    conv_kept = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    records = _no_warning(convert, conv_kept, conv=False, following_norm="remove")
    assert [r.path for r in records] == ["3"] and type(conv_kept[1]) is nn.BatchNorm2d
    head_skipped = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2), nn.LayerNorm(2))
    _no_warning(convert, head_skipped, following_norm="remove", skip=lambda path, m: path == "2")
    assert type(head_skipped[2]) is nn.Linear and type(head_skipped[3]) is nn.LayerNorm


README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_block(heading: str) -> str:
    """The first python block after ``heading`` in the README."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under the README's {heading!r}"
    return match.group(1)


def _shown_output(code: str) -> list[str]:
    """The output a README block shows, in its comment lines that start with a module path ("# 0 ...")."""
    return [line[2:].split("  ")[0].rstrip() for line in code.splitlines() if re.match(r"# \d", line)]


def test_the_readme_first_layer_example_keeps_the_head_and_prints_what_it_shows(capsys):
    code = _readme_block("## The corrected layers")
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(code, "README.md (the corrected layers)", "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == _shown_output(code) != []
    model = namespace["model"]
    assert type(model[0]) is AffineLike and type(model[1]) is nn.Identity
    assert type(model[-1]) is nn.Linear  # the classifier head stays plain, as the README advises
    assert namespace["z"].shape == (32, 256)


def test_the_readme_convert_example_runs_and_prints_what_it_shows(tmp_path, monkeypatch, capsys):
    code = _readme_block("**`convert` in practice.**")
    shown = _shown_output(code)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the example keeps no norm silently, and warns about none
        exec(compile(code, "README.md (convert in practice)", "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == shown and len(shown) == 4
    cnn = namespace["cnn"]  # the whole module, loaded back with weights_only=False
    assert type(cnn[0]) is PatchNormConv2d and type(cnn[1]) is nn.Identity and type(cnn[7]) is nn.Linear
    with pytest.raises(Exception, match="weights_only"):
        torch.load(tmp_path / "cnn.pt")  # torch >= 2.6: weights_only=True refuses the layers' classes
    x = torch.randn(2, 3, 8, 8)
    expected = cnn(x)
    # the state_dict needs no flag: its keys are those of the plain layers
    torch.save(cnn.state_dict(), tmp_path / "state.pt")
    plain = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Identity(), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 8 * 8, 64), nn.Identity(), nn.Tanh(), nn.Linear(64, 10))
    plain.load_state_dict(torch.load(tmp_path / "state.pt"))
    convert(plain, skip=lambda path, module: path == "7")
    torch.testing.assert_close(plain(x), expected, rtol=0, atol=0)
    assert type(plain[4]) is AffineLike
