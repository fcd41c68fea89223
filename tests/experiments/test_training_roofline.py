"""benchmarks/stacked_training.py: the replay of a step's kernels (recorded while the engine takes
one step) runs the step's own matrix products and convolutions, and only those, and replaying
them does not touch the models."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.training import build_member, stacked_engine

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("affdiv_benchmarks_roofline", ROOT / "benchmarks" /
                                               "stacked_training.py")
roofline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)


@pytest.mark.parametrize("method, width", [("affine", 8), ("conv", 2), ("vit-affine_like", 8)])
def test_replaying_runs_the_steps_counted_kernels_and_leaves_the_models_alone(digits, method, width):
    config = RunConfig(dataset="digits", method=method, depth=1, width=width, batch_size=8, seed=0)
    models = [build_member(config, digits, seed) for seed in (0, 1)]
    split = (torch.as_tensor(digits.train.x), torch.as_tensor(digits.train.y))
    engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
    orders = torch.stack([torch.randperm(len(split[1]), generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    with FlopCounterMode(display=False) as step:
        engine.step(orders[:, 8:16])
    replay = roofline.kernel_replay(engine, orders, 8)
    before = {name: p.clone() for name, p in engine.params.items()}
    with FlopCounterMode(display=False) as replayed:
        replay()
    assert replayed.get_total_flops() == step.get_total_flops() > 0  # every counted op, once, at the step's shapes
    assert all(torch.equal(p, before[name]) for name, p in engine.params.items())


def test_a_replayed_tensor_has_the_recorded_layout_over_its_own_storage():
    base = torch.randn(3, 4)
    for recorded in (base.t(), base[:, 1:3], base.unsqueeze(0).expand(5, 3, 4), torch.empty(0, 2)):
        like = roofline._like(recorded)
        assert (like.shape, like.stride(), like.dtype) == (recorded.shape, recorded.stride(), recorded.dtype)
        assert like.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert roofline._like(3) == 3 and roofline._like([1, 2]) == [1, 2]


def test_the_compiled_variant_trains_the_models_the_stacked_engine_trains(digits):
    # the --compiled row times the same steps, through the compiled code, which takes torch's
    # products where the eager engine may take oneDNN's and reorders float32 sums within its fused
    # kernels: rounding (~1e-7 relative) either way, which three SGD steps carry into the parameters
    from torch._dynamo.testing import CompileCounterWithBackend

    config = RunConfig(dataset="digits", method="affine_like", depth=1, width=8, batch_size=8, seed=0)
    split = (torch.as_tensor(digits.train.x), torch.as_tensor(digits.train.y))
    orders = torch.stack([torch.randperm(len(split[1]), generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    counter = CompileCounterWithBackend("inductor")
    engines = []
    for compiled in (False, True):
        models = [build_member(config, digits, seed) for seed in (0, 1)]
        engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
        if compiled:
            roofline.compile_forward(engine, backend=counter)
        initial = {name: p.clone() for name, p in engine.params.items()}
        roofline._time_steps(engine, orders, 8, 3, 0)
        assert all(not torch.equal(p, initial[name]) for name, p in engine.params.items())
        engines.append(engine)
    eager, compiled = engines
    assert counter.frame_count == 1  # one graph, compiled once, for the three steps
    for name, p in eager.params.items():
        torch.testing.assert_close(compiled.params[name], p, rtol=1e-5, atol=1e-6)


def test_the_compiled_variant_names_an_engine_without_a_batched_forward():
    with pytest.raises(ValueError, match="--compiled times the batched engine's forward; object has none"):
        roofline.compile_forward(object())
