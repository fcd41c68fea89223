"""What every measurement of ``affdiv.verify`` starts from: a checked step size, the inputs as a
tuple, and the module as a pure function of its trainable parameters that leaves it untouched.

``ModuleFunction(module)(θ, inputs)`` runs ``module`` with the parameters θ swapped in. It keeps
the promise that a measurement does not change what it measures:

* Parameters. torch.func.functional_call swaps tensors into *slots* (a module and an attribute
  name) and swaps the originals back afterwards, one slot per name it is given. A module used
  twice (``Sequential(lin, Tanh(), lin)``, ``self.a = self.b = lin``) has one slot under two
  names; given both (``tie_weights=True``, torch's default), the second name's swap records
  the first name's replacement as the "original" and puts it back last, so the module keeps a
  plain tensor holding θ in place of its Parameter. Here every slot is named exactly once (its
  module's first path in ``named_modules``) and mapped to its Parameter's canonical name in θ,
  with ``tie_weights=False``: each swap is undone by its own restore. Tied weights (one
  Parameter in two slots) get the same tensor in both slots, so the measurement differentiates
  through every use.
* Buffers. Every call gets fresh copies (a BatchNorm in train mode updates the copies, not its
  running statistics); a buffer shared by several slots gets one copy shared by them.
* Randomness. Every call runs from the RNG state (CPU, and every CUDA device the module or the
  inputs are on) of the moment the ModuleFunction was made, inside ``torch.random.fork_rng``: a
  Dropout draws the same mask in each of a measurement's passes, and the global RNG is left as
  it was.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call


def check_lr(lr: float) -> float:
    """``lr`` as a float; anything but a finite positive real number is a ValueError."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite positive number, got {lr!r}")
    return float(lr)


def as_inputs(inputs: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A module's positional inputs as a tuple: one Tensor, or a tuple or list of Tensors."""
    if isinstance(inputs, Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and all(isinstance(t, Tensor) for t in inputs):
        return tuple(inputs)
    raise TypeError(f"inputs must be a Tensor or a tuple of Tensors, got {type(inputs).__name__}")


class ModuleFunction:
    """``module`` as a pure function of its trainable parameters (see the module docstring).

    ``params``: θ, the trainable parameters detached, by canonical name (``named_parameters``);
    ``function(θ', inputs)`` runs the module on ``inputs`` with θ' (a dict of the same keys) in
    place of θ. The ``inputs`` given when it is made only name the CUDA devices whose RNG state
    it keeps (with the module's own).
    """

    def __init__(self, module: nn.Module, inputs: tuple[Tensor, ...]):
        self.module = module
        self.params: dict[str, Tensor] = {
            name: p.detach() for name, p in module.named_parameters() if p.requires_grad
        }
        if not self.params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters: there is no step to take")
        canonical = {id(p): name for name, p in module.named_parameters()}
        self._param_slots = {slot: canonical[id(p)] for slot, p in _slots(module, "_parameters")
                             if canonical[id(p)] in self.params}
        self._buffers: dict[str, Tensor] = {}  # each distinct buffer, by its first slot
        self._buffer_slots: dict[str, str] = {}  # every slot -> its buffer's first slot
        first_slot: dict[int, str] = {}
        for slot, b in _slots(module, "_buffers"):
            first = first_slot.setdefault(id(b), slot)
            if first == slot:
                self._buffers[slot] = b.detach()
            self._buffer_slots[slot] = first
        tensors = [*self.params.values(), *self._buffers.values(), *inputs]
        self._cuda_devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
        self._rng_state = torch.get_rng_state()
        self._cuda_rng_states = [torch.cuda.get_rng_state(device) for device in self._cuda_devices]

    def __call__(self, params: dict[str, Tensor], inputs: tuple[Tensor, ...]) -> Tensor:
        copies = {name: b.clone() for name, b in self._buffers.items()}
        swapped = {slot: params[name] for slot, name in self._param_slots.items()}
        swapped.update({slot: copies[name] for slot, name in self._buffer_slots.items()})
        with self._same_random_draws():
            return functional_call(self.module, swapped, inputs, tie_weights=False)

    @contextlib.contextmanager
    def _same_random_draws(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self._cuda_devices):
            torch.set_rng_state(self._rng_state)
            for device, state in zip(self._cuda_devices, self._cuda_rng_states):
                torch.cuda.set_rng_state(state, device)
            yield


def _slots(module: nn.Module, kind: str) -> Iterator[tuple[str, Tensor]]:
    """(dotted name, tensor) of every slot of ``kind`` ("_parameters" or "_buffers") in the
    module tree, each slot once: a module reached by several paths is named by its first."""
    for prefix, sub in module.named_modules():
        for name, t in getattr(sub, kind).items():
            if t is not None:
                yield (f"{prefix}.{name}" if prefix else name), t
