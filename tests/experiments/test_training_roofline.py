"""benchmarks/stacked_training.py: the replay of a step's kernels (recorded while the engine takes
one step, on the paths it takes unrecorded) runs the step's own matrix products and convolutions,
and only those, and replaying them does not touch the models."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.layers import _fused, _native

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("affdiv_benchmarks_roofline", ROOT / "benchmarks" /
                                               "stacked_training.py")
roofline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)


def _package_pass_flops(func, args) -> int:
    """The FLOPs of one of the package's passes that hold products, from its arguments: 2 per
    multiply-add of its products (as torch.utils.flop_counter counts a product)."""
    name = func.__name__
    if name == "onednn_bmm_":  # out (K, M, N) ← a (K, M, L) b (K, L, N)
        _out, a, b = args[:3]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name in ("attention_scores", "attention_probabilities"):  # q kᵀ per sequence and head, rows (N·T, H·d)
        q, _k, tokens, _heads = args
        return 2 * q.shape[0] * tokens * q.shape[1]
    if name == "attention_values":  # p v
        p, v = args
        return 2 * v.shape[0] * p.shape[2] * v.shape[1]
    if name == "attention_backward":  # pᵀ gy, gy vᵀ, ds k, dsᵀ q
        q, _k, _v, p, _gy = args
        return 8 * q.shape[0] * p.shape[2] * q.shape[1]
    if name in ("conv_pool", "conv_pool_backward"):  # one input channel → C channels, per model
        xp, (kh, kw) = args[0], (args[4] if name == "conv_pool" else args[3])
        channels = args[3] if name == "conv_pool" else args[1].shape[1] // xp.shape[0]
        models, batch, hq, wq = xp.shape
        return 2 * models * batch * channels * kh * kw * (hq - kh + 1) * (wq - kw + 1)
    raise AssertionError(f"no FLOP count for {name}")


ATTENTION = {"attention_scores", "attention_values", "attention_backward"}
FIRST_BLOCK = {"conv_pool", "conv_pool_backward"}


#: method → (width, the package passes its step runs, the bounds of its replayed FLOPs over the
#: floor's). The plain methods' steps (and norm_l2's, whose row norms one model's layer also
#: computes outside any product) run the floor's arithmetic exactly. The others' passes compute
#: some of it outside any product and add small products of their own; in these small models the
#: ratios are 0.994 (affine_like: its row norms out, ⟨gy, b⟩ per row in), 0.978 (the vit's
#: AffineLike), 0.804 (PatchNorm's patch norms, which one model's layer computes as a box-filter
#: convolution) and 1.019 (conv+batchnorm: the BatchNorm folded into the first block's weights),
#: held here within ±0.5% (a regression bound on these numbers; the exact check is the plain
#: methods': a pass left out of ``PACKAGE_PRODUCTS`` fails the names' check on every method).
CELLS = {"affine": (8, {"onednn_bmm_"}, (1, 1)), "norm_l2": (8, {"onednn_bmm_"}, (1, 1)),
         # at width 32 the vit's heads are the harness's (16 tokens of 8 entries): scores and softmax in one pass
         "vit at width 32": (32, {"onednn_bmm_", "attention_values", "attention_backward", "attention_probabilities"
                                  if _fused.attention_probabilities_built() else "attention_scores"},
                             (1, 1)),
         "conv": (2, {"onednn_bmm_", *FIRST_BLOCK}, (1, 1)),
         **{method: (8, {"onednn_bmm_", *ATTENTION}, (1, 1)) for method in ("vit", "vit-qknorm", "vit-nonorm")},
         "affine_like": (8, {"onednn_bmm_"}, (0.989, 0.999)),
         **{method: (8, {"onednn_bmm_", *ATTENTION}, (0.973, 0.983))
            for method in ("vit-affine_like", "vit-affine_like-qknorm")},
         "patchnorm": (2, {"onednn_bmm_", *FIRST_BLOCK}, (0.800, 0.808)),
         "conv+batchnorm": (2, {"onednn_bmm_", *FIRST_BLOCK}, (1.014, 1.024))}


@pytest.mark.usefixtures("small_products_on_onednn")  # (these small models' products too)
@pytest.mark.parametrize("method", list(CELLS))
def test_the_recorded_kernels_are_the_steps_own_and_replaying_them_leaves_the_models_alone(digits, method):
    # the step as it runs (on the package's passes where they run) holds the arithmetic of the
    # floor, each product and convolution once: the models × one model's FLOPs (counted on torch's
    # ops; not the stacked composite's count, which torch.utils.flop_counter overstates for a
    # grouped convolution: it counts its weight gradient as if every group saw every channel)
    width, passes, bounds = CELLS[method]
    calls = _replayed(digits, method, width, bounds)
    names = {func.__name__ for func, _args, _kwargs in calls if not isinstance(func, torch._ops.OpOverload)}
    if _fused.available():  # (oneDNN's products where it is bound, too)
        assert names == (passes if _native.onednn_enabled() else passes - {"onednn_bmm_"})


@pytest.mark.parametrize("method", ["affine", "norm_l2", "affine_like"])
def test_the_recorded_kernels_hold_the_sgd_step_made_by_torchs_product(digits, monkeypatch, method):
    # where the products are torch's (ONEDNN_PREFERRED false, as on MKL on an Intel processor), the
    # fused SGD step is torch's in-place baddbmm_, which torch.utils.flop_counter does not count: the
    # replay holds it too, so the step's arithmetic is the floor's (these MLPs' products at every
    # size: ONEDNN_MIN_FLOPS 0)
    from affdiv.experiments.runs import stacked_matmul

    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", 0)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", False)
    width, _passes, bounds = CELLS[method]
    calls = _replayed(digits, method, width, bounds)
    assert not any(func.__name__ == "onednn_bmm_" for func, _args, _kwargs in calls)
    assert sum(func is torch.ops.aten.baddbmm_.default for func, _args, _kwargs in calls) == 2  # (two layers)


def _replayed(digits, method: str, width: int, bounds: tuple[float, float]) -> list[tuple]:
    """The kernels recorded in one step of two stacked models of ``method`` (depth 1, ``width``),
    after checking that replaying them runs the floor's FLOPs within ``bounds`` of it and leaves
    the models' parameters alone."""
    config = RunConfig(dataset="digits", method=method.split()[0], depth=1, width=width, batch_size=8, seed=0)
    models = [build_member(config, digits, seed) for seed in (0, 1)]
    split = (torch.as_tensor(digits.train.x), torch.as_tensor(digits.train.y))
    engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
    orders = torch.stack([torch.randperm(len(split[1]), generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    calls = roofline.kernel_calls(engine, orders, 8)
    before = {name: p.clone() for name, p in engine.params.items()}
    with FlopCounterMode(display=False) as replayed:
        roofline.replay(calls)
    flops = replayed.get_total_flops() + sum(_uncounted_flops(func, args) for func, args, _kwargs in calls)
    floor = 2 * sum(roofline._step_flops(config, digits).values())
    low, high = bounds
    assert floor > 0 and low * floor <= flops <= high * floor, (flops, floor)
    assert all(torch.equal(p, before[name]) for name, p in engine.params.items())
    return calls


def _uncounted_flops(func, args) -> int:
    """The FLOPs of a recorded call that torch.utils.flop_counter does not count: the package's
    passes (:func:`_package_pass_flops`) and torch's in-place batched product (self + a b, a (K,
    M, L), b (K, L, N)); 0 for the ops it counts."""
    if func is torch.ops.aten.baddbmm_.default and func.overloadpacket not in flop_registry:
        _self, a, b = args[:3]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if isinstance(func, torch._ops.OpOverload):
        return 0
    return _package_pass_flops(func, args)


def test_a_replayed_tensor_has_the_recorded_layout_over_its_own_storage_shared_as_in_the_step():
    base, other = torch.randn(3, 4), torch.randn(3, 4)
    storages = {}
    views = (base[1], base.t(), base[:, 1:3], base.unsqueeze(0).expand(5, 3, 4))  # (the first, a part)
    likes = [roofline._like(recorded, storages) for recorded in views]
    for recorded, like in zip(views, likes):
        assert (like.shape, like.stride(), like.storage_offset(), like.dtype) == \
            (recorded.shape, recorded.stride(), recorded.storage_offset(), recorded.dtype)
        assert like.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    # the views of one tensor share one storage of its size, as they did in the step; another
    # tensor of the same shape gets its own
    assert len({like.untyped_storage().data_ptr() for like in likes}) == 1
    assert likes[0].untyped_storage().nbytes() == base.untyped_storage().nbytes()
    assert torch.equal(likes[2], likes[1].t()[:, 1:3]) and torch.equal(likes[0], likes[1].t()[1])
    assert roofline._like(other, storages).untyped_storage().data_ptr() != likes[0].untyped_storage().data_ptr()
    assert roofline._like(torch.empty(0, 2), storages).shape == (0, 2)
    assert roofline._like(3, storages) == 3 and roofline._like([1, 2], storages) == [1, 2]
    # indices a pass follows: a copy of what each reads, taken at each call (a freed address may
    # hold other indices later), never shared
    which = torch.randint(0, 4, (3, 1, 5), dtype=torch.uint8).expand(3, 2, 5)
    copied = roofline._like(which, storages)
    assert copied.stride() == which.stride() and torch.equal(copied, which)
    assert copied.untyped_storage().data_ptr() != which.untyped_storage().data_ptr()
    which.fill_(7)
    again = roofline._like(which, storages)
    assert torch.equal(again, which) and not torch.equal(copied, which)
    part = torch.arange(10)[3:9:2]  # (from an offset, strided)
    assert torch.equal(roofline._like(part, storages), part)


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


def test_the_memory_passes_read_and_update_their_buffer_and_count_its_bytes():
    passes = roofline.memory_timers(4 * 1000)
    (read, read_bytes), (update, update_bytes) = passes["read"], passes["update"]
    before = read().item()
    after = update()
    assert (read_bytes, update_bytes) == (4 * 1000, 2 * 4 * 1000) and after.numel() == 1000
    assert read().item() == pytest.approx(before + 0.5 * 1000, rel=1e-5)  # (the sum read the updated buffer)


def test_the_roof_is_the_larger_of_the_arithmetic_and_the_parameters_three_passes(digits, monkeypatch):
    # the MLP arm on digits' 64 inputs, 3 models: its parameters counted by hand; the forward's
    # read at the best read rate of the rounds, the update's read and write at the best update rate
    width, models = 256, 3
    nbytes = 4 * models * ((64 * width + width) + 2 * (width * width + width) + (width * 10 + 10))
    row = roofline.measure("mlp", 16, digits, rounds=2, seconds=0.01, members=models)
    assert row["parameter_mib"] * 2**20 == nbytes
    assert row["read_gib_per_s"] == max(row["read_gib_per_s_rounds"])
    assert row["update_gib_per_s"] == max(row["update_gib_per_s_rounds"])
    read, update = row["read_gib_per_s"] * 2**30, row["update_gib_per_s"] * 2**30
    torch.testing.assert_close(row["memory_floor_ms_per_model_step"] * models / 1e3,
                               nbytes / read + 2 * nbytes / update, rtol=1e-12, atol=0)
    # passes counted 1000 times as slow: the memory floor is the roof (and met); 1e6 times as fast: the arithmetic
    real = roofline.memory_timers
    slow = lambda n: {name: (fn, moved / 1000) for name, (fn, moved) in real(n).items()}  # noqa: E731
    fast = lambda n: {name: (fn, moved * 1e6) for name, (fn, moved) in real(n).items()}  # noqa: E731
    for timers, bound in ((slow, "memory_floor_ms_per_model_step"), (fast, "floor_ms_per_model_step")):
        monkeypatch.setattr(roofline, "memory_timers", timers)
        row = roofline.measure("mlp", 16, digits, rounds=1, seconds=0.01, members=models)
        torch.testing.assert_close(row["stacked_over_roof"], row["stacked_ms_per_model_step"] / row[bound],
                                   rtol=1e-12, atol=0)
        if bound == "memory_floor_ms_per_model_step":
            assert row["roof_met"]


def test_the_split_variant_trains_the_stacks_models_as_smaller_stacks_one_after_the_other(digits):
    # 7 models (seeds 0 and 1: the cell's models are seed-major, 6 learning rates a seed) as stacks of
    # 3, 2 and 2 (nearly equal sizes, the larger first), each stepped 3 times in turn: the same nets, lrs
    # and shuffles as one stack of 7, so
    # the same parameters, up to the order of summation inside a batched product of fewer matrices:
    # float32 rounding (~1e-7 relative, as the benchmark trains), carried through three steps
    config = RunConfig(dataset="digits", method="affine_like", depth=1, width=8, batch_size=8, seed=0)
    kind = stacked_engine(build_member(config, digits, 0))
    [(whole, orders)] = roofline._stacks(kind, config, digits, 7, 7)
    split = roofline._stacks(kind, config, digits, 7, 3)
    assert [len(o) for _engine, o in split] == [3, 2, 2]
    assert torch.equal(torch.cat([o for _engine, o in split]), orders)
    assert not torch.equal(orders[5], orders[6])  # (the seed boundary: other shuffles)
    for name, p in whole.params.items():
        assert torch.equal(torch.cat([engine.params[name] for engine, _o in split]), p)
    assert [lr for engine, _o in split for lr in engine.optimizer.lrs] == whole.optimizer.lrs
    initial = {name: p.clone() for name, p in whole.params.items()}
    for stacks in ([(whole, orders)], split):
        assert roofline._time_stacks(stacks, 8, 3, 0) > 0
    for name, p in whole.params.items():
        assert not torch.equal(p, initial[name])
        torch.testing.assert_close(torch.cat([engine.params[name] for engine, _o in split]), p,
                                   rtol=1e-5, atol=1e-6)


def test_the_split_rows_pair_the_smaller_stacks_with_the_one_stack_round_by_round(digits, monkeypatch):
    # a clock that charges a step of a stack of n models cost[n] seconds a model, times a factor
    # that changes from round to round (a round's steps start at its own batch number): each
    # round's paired ratio is then exactly one stack's cost over the smaller stacks' mean cost
    cost = {8: 4e-3, 3: 3e-3, 2: 1e-3, 1: 2e-3}  # (8: one at a time, on 8 models)

    calls = []

    def clock(engine, orders, batch, steps, start):
        calls.append((start, id(engine)))
        return steps * len(orders) * cost[len(orders)] * (1 + start)

    monkeypatch.setattr(roofline, "_time_steps", clock)
    row = roofline.measure("mlp", 16, digits, rounds=3, seconds=0.01, members=3, stack_sizes=[2, 3, 2, 5, 1],
                           vmap=True, plain=True)
    assert [s["max_models_per_stack"] for s in row["split"]] == [1, 2] and row["split_left_out"] == [3, 5]
    ones, twos = row["split"]
    assert ones["stack_sizes"] == [1, 1, 1] and twos["stack_sizes"] == [2, 1]
    for s, mean in ((ones, 2e-3), (twos, (2 * 1e-3 + 1 * 2e-3) / 3)):
        assert s["speedup_over_stacked_rounds"] == pytest.approx([3e-3 / mean] * 3, rel=1e-12)
        assert s["speedup_over_stacked"] == pytest.approx(3e-3 / mean, rel=1e-12)
    # the per-model times, against the rounds' own factors (their median: the middle round's)
    factors = sorted(1 + start for start in {roofline.WARM_UP + r * row["steps_per_round"] for r in range(3)})
    assert twos["ms_per_model_step"] == pytest.approx(1e3 * 4e-3 / 3 * factors[1], rel=1e-12)
    assert row["stacked_ms_per_model_step"] == pytest.approx(1e3 * 3e-3 * factors[1], rel=1e-12)
    assert row["vmap_ms_per_model_step"] == row["plain_ms_per_model_step"] == row["stacked_ms_per_model_step"]
    # over the floor: the one stack's, over the paired ratio (the same in every round)
    assert twos["over_floor"] == pytest.approx(row["stacked_over_floor"] * (4e-3 / 3) / 3e-3, rel=1e-12)
    # the variants' order, reversed every other round (a variant's stacks in their order either way)
    rounds = [[engine for start, engine in calls if start == roofline.WARM_UP + r * row["steps_per_round"]]
              for r in range(3)]
    # round 0: alone, stacked, vmap, plain, the 3 stacks of 1, the stacks of 2 and 1; round 1 the
    # variants in reverse, each variant's stacks in their own order
    first, second, third = rounds
    variants = [first[0:1], first[1:2], first[2:3], first[3:4], first[4:7], first[7:9]]
    assert len(first) == 9 and second == [engine for stacks in variants[::-1] for engine in stacks]
    assert third == first
    lines = roofline.format_table([row]).splitlines()
    assert len(lines) == 5 and lines[2].startswith("  mlp B=16 as stacks of 1/1/1: ")
    assert lines[4] == "  mlp B=16: stacks of at most 3, 5 left out: the cell stacks 3"
    with pytest.raises(ValueError, match=r"stack_sizes: each stack size must be >= 1, got \[0\]"):
        roofline.measure("mlp", 16, digits, rounds=1, seconds=0.01, members=3, stack_sizes=[0])


def test_the_compiled_variant_compiles_its_own_engine_and_not_the_one_stacks(digits, monkeypatch):
    compiled, replayed, timed = [], [], set()
    monkeypatch.setattr(roofline, "compile_forward", compiled.append)
    monkeypatch.setattr(roofline, "kernel_calls", lambda engine, orders, batch: replayed.append(engine) or [])

    def clock(engine, orders, batch, steps, start):
        timed.add(id(engine))
        return 1e-3 * steps

    monkeypatch.setattr(roofline, "_time_steps", clock)
    row = roofline.measure("mlp", 16, digits, rounds=1, seconds=0.01, members=3, compiled=True, stack_sizes=[2])
    [engine], [stacked] = compiled, replayed
    assert engine is not stacked and id(engine) in timed and len(engine.optimizer.lrs) == 3
    assert row["compiled_ms_per_model_step"] == row["stacked_ms_per_model_step"]


@pytest.mark.parametrize("sizes", [["0"], ["48"], ["12", "-1"]])
def test_the_command_refuses_a_split_outside_a_cells_models_in_one_line(sizes, capsys):
    with pytest.raises(SystemExit) as stop:
        roofline.main(["--split", *sizes])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"--split: each K must be in 1..47 (fewer than a cell's models), got [{', '.join(sizes)}]")
