"""benchmarks/fused_passes.py: inside ``routed_off(name)`` the pass ``name`` is off for the
engine being timed, whether it is chosen when the engine is built (the CNN passes, the step in
the backward) or at every call (the others), and the other passes stay on; so are the three
routes of the products."""

import importlib.util
import unittest.mock
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from affdiv.experiments.runs import (
    activations,
    stacked_attention,
    stacked_dense,
    stacked_layer_norm,
    stacked_matmul,
)
from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.layers import _fused, _native

pytestmark = pytest.mark.skipif(not _fused.available(), reason="the fused passes are not built here")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("affdiv_benchmarks_fused_passes", ROOT / "benchmarks" /
                                               "fused_passes.py")
fused_passes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fused_passes)

#: What each pass calls in a step: the kernel, or the Function, that only it runs.
CALLS = {"first block": (_fused, "conv_pool"), "later pools": (_fused, "max_pool2"),
         "dense scale": (stacked_dense.StackedAffineLike, "apply"),
         "attention": (stacked_attention.StackedAttention, "apply"),
         "layer norm": (stacked_layer_norm.StackedLayerNorm, "apply"), "tanh": (activations.Tanh, "apply"),
         "step in backward": (stacked_matmul, "sgd_step_")}


def _one_step(method: str, digits, routed: str | None, watch, width: int | None = None, depth: int = 2):
    """One SGD step of two models, built and stepped inside ``routed_off(routed)`` (no pass routed
    off for None) and inside what ``watch(stack)`` enters on the ExitStack after the routing; returns
    what ``watch`` returned."""
    width = width or (4 if method == "conv" else 8)
    config = RunConfig(dataset="digits", method=method, depth=depth, width=width, batch_size=8, seed=0)
    split = (torch.as_tensor(digits.train.x), torch.as_tensor(digits.train.y))
    with ExitStack() as stack:
        if routed is not None:
            stack.enter_context(fused_passes.routed_off(routed))
        models = [build_member(config, digits, seed) for seed in (0, 1)]
        engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
        seen = watch(stack)
        engine.step(torch.arange(16).reshape(2, 8))
    return seen


def _calls_in_a_step(method: str, digits, routed: str | None, calls=CALLS) -> dict[str, int]:
    """How often each of ``calls`` ran in one SGD step (:func:`_one_step`)."""
    def watch(stack):
        return {name: stack.enter_context(unittest.mock.patch.object(owner, attr, wraps=getattr(owner, attr)))
                for name, (owner, attr) in calls.items()}

    return {name: spy.call_count for name, spy in _one_step(method, digits, routed, watch).items()}


@pytest.mark.parametrize("method, passes", [("conv", ["first block", "later pools"]),
                                            ("affine_like", ["dense scale", "tanh", "step in backward"]),
                                            ("affine", ["tanh", "step in backward"]),
                                            ("norm_l2", ["tanh", "step in backward"]),
                                            ("vit", ["attention", "layer norm"]),
                                            ("vit-affine_like", ["dense scale", "attention", "layer norm"])])
@pytest.mark.usefixtures("small_products_on_onednn")  # (the digits models' steps are one product on oneDNN's route)
def test_a_pass_routed_off_is_off_and_the_others_stay_on(digits, method, passes):
    if not _native.onednn_enabled():  # (on oneDNN's route, which the fixture takes, the step needs it)
        passes = [name for name in passes if name != "step in backward"]
    assert all(method in fused_passes.PASSES[name][-1] for name in passes)
    assert all(_calls_in_a_step(method, digits, None)[name] > 0 for name in passes)
    for off in passes:
        calls = _calls_in_a_step(method, digits, off)
        assert calls[off] == 0 and all(calls[name] > 0 for name in passes if name != off), (off, calls)


@pytest.mark.skipif(not _native.onednn_enabled(), reason="oneDNN's matmul is not bound here")
def test_the_product_routes_routed_off_are_off(digits, monkeypatch):
    # the digits models' products are small: on torch's ops, on oneDNN with "small on torch" off
    # (on every processor: on an Intel processor with MKL the engine's products are torch's)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", True)
    onednn = {"oneDNN": (_native, "onednn_bmm_")}
    assert _calls_in_a_step("affine", digits, None, onednn)["oneDNN"] == 0
    assert _calls_in_a_step("affine", digits, "small on torch", onednn)["oneDNN"] > 0
    # every product on oneDNN, a hidden layer of 128 gets its 8-column input gradient as (gᵀ W)ᵀ:
    # a product whose first factor has the batch's 8 rows (gᵀ), which no other product of the step
    # has (the weights' rows, W xᵀ's and g xᵀ's first factors, are 128 or 10); Wᵀ g with it off
    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", 0)
    width = stacked_matmul.THIN_MIN_CONTRACTION

    def rows_of_first_factors(routed):
        def watch(stack):
            return stack.enter_context(unittest.mock.patch.object(stacked_matmul, "_product",
                                                                  wraps=stacked_matmul._product))

        spy = _one_step("affine", digits, routed, watch, width, depth=3)
        return [call.args[0].shape[1] for call in spy.call_args_list]

    assert 8 in rows_of_first_factors(None)
    off = rows_of_first_factors("thin input gradient")
    assert off and 8 not in off


@pytest.mark.skipif(not _native.onednn_enabled(), reason="oneDNN's matmul is not bound here")
def test_mkl_on_intel_routed_off_multiplies_on_onednn(digits, monkeypatch):
    # as on an Intel processor with MKL: every product torch's; routed off, oneDNN's (every size here)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", 0)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", False)
    onednn = {"oneDNN": (_native, "onednn_bmm_")}
    assert _calls_in_a_step("affine", digits, None, onednn)["oneDNN"] == 0
    assert _calls_in_a_step("affine", digits, "MKL on Intel", onednn)["oneDNN"] > 0


def test_mkl_on_intel_routed_off_takes_the_tanh_pass(digits, monkeypatch):
    # as on an Intel processor with MKL: torch's tanh; routed off, the pass
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", False)
    tanh = {"tanh": CALLS["tanh"]}
    assert _calls_in_a_step("affine", digits, None, tanh)["tanh"] == 0
    assert _calls_in_a_step("affine", digits, "MKL on Intel", tanh)["tanh"] > 0
    assert _calls_in_a_step("affine", digits, "torch's tanh on Intel", tanh)["tanh"] > 0
