"""Sibling projections of one input as one product: `patch(model, fuse=True)`.

A decoder layer's q, k and v projections read the same hidden states, and so
do its MLP's gate and up projections. At few rows a product's time is the
time to read its weight plus a launch and a ramp that a small weight does
not amortise (`bench.roofline`, H100: Llama 3.1 8B's k and v projections
ran at 0.47 of the DRAM floor, its q and o at 0.69, its gate and up at
0.83, Gemma 3 27B's fused qkv at 0.82). One product over the siblings'
weights together pays the launch once, on a weight as large as all of them:
serving engines store these weights fused, transformers apart.

`fuse(model, eligible)` copies each group's weights into one buffer, rows in
order (and their biases, where each has one, into another), and makes
every layer's weight a new parameter viewing its rows (the names, values,
state dict, hooks and `load_state_dict` stay as they were), then swaps the
layers' class for `FusedSibling`. The first sibling called with an input
computes the product of the whole buffer through the group's own
`nn.Linear` (which `patch` routes through the maps of the fused shape, the
family a shape file from `tuner shapes --from-config` lists); the others,
called with that same tensor unchanged since (an inference tensor keeps no
version: that same tensor), take their columns of it. A sibling called
with another input, under autograd, inside a compiled graph, or after its
weight stopped being a view of the buffer (`model.to(...)` and
`copy.deepcopy` make new parameters; `torch.save` keeps the views)
computes its own product as an `nn.Linear` does. `unfuse` swaps the
classes back; the weights stay views of the buffer.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Child names of one module whose layers read the same input (transformers'
# attention and gated MLP blocks).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_dynamo_compiling = torch.compiler.is_dynamo_compiling


class FusedGroup:
    """The weight buffer of sibling layers (rows: theirs in order) and their
    biases', the `nn.Linear` over them, and the product last computed with
    it until each sibling has taken its columns."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        first = layers[0].weight
        biased = layers[0].bias is not None
        # Normal tensors even when fused inside inference mode: the model
        # may run outside it after.
        with torch.inference_mode(False):
            buffer = torch.cat([layer.weight.detach() for layer in layers])
            biases = torch.cat([layer.bias.detach() for layer in layers]) if biased else None
        self.layers = layers
        self.columns: dict[nn.Linear, tuple[int, int]] = {}
        row = 0
        for layer in layers:
            rows = layer.out_features
            layer.weight = nn.Parameter(buffer[row:row + rows], requires_grad=layer.weight.requires_grad)
            if biased:
                layer.bias = nn.Parameter(biases[row:row + rows], requires_grad=layer.bias.requires_grad)
            self.columns[layer] = (row, row + rows)
            row += rows
        self.linear = nn.Linear(first.shape[1], row, bias=biased, device="meta", dtype=first.dtype)
        self.linear.weight = nn.Parameter(buffer, requires_grad=False)
        if biased:
            self.linear.bias = nn.Parameter(biases, requires_grad=False)
        self._clear()

    @staticmethod
    def _idle() -> dict:
        """The state with no product in hand: its input, that input's
        version, the product, the siblings yet to take their columns."""
        return {"_input": None, "_version": -1, "_out": None, "_waiting": set()}

    def _clear(self) -> None:
        self.__dict__.update(self._idle())

    def __getstate__(self) -> dict:
        # The product in flight belongs to the forward that made it.
        return self.__dict__ | self._idle()

    def intact(self) -> bool:
        """Whether every sibling's weight (and bias) is still its rows of the buffer."""
        return all(_views(self.linear._parameters[name], layer._parameters[name], lo)
                   for name in ("weight", "bias") for layer, (lo, _) in self.columns.items())

    def columns_for(self, layer: nn.Linear, input: torch.Tensor) -> torch.Tensor | None:
        """`layer`'s product of `input` as columns of the group's product (None:
        `layer` computes its own). A sibling still waiting for the product in
        hand takes its columns if its input is that product's, unchanged
        since, else computes its own and leaves the product to the others;
        one not waiting (the product's first, or its columns taken) starts
        a new product: a forward that stopped halfway leaves none behind for long."""
        lo, hi = self.columns[layer]
        if layer in self._waiting:
            if input is not self._input or _version(input) != self._version:
                return None
            out = self._out
            self._waiting.discard(layer)
            if not self._waiting:
                self._clear()
            return out[..., lo:hi]
        if not self.intact():
            return None
        out = self.linear(input)
        self._input, self._version, self._out = input, _version(input), out
        self._waiting = set(self.layers) - {layer}
        return out[..., lo:hi]


class FusedSibling(nn.Linear):
    """An `nn.Linear` of a `FusedGroup`: its product is its group's columns where it may be."""

    tuner_group: FusedGroup

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]
        if not (_dynamo_compiling() or (torch.is_grad_enabled() and w.requires_grad)
                or type(input) is not torch.Tensor or input.dtype != w.dtype):
            out = self.tuner_group.columns_for(self, input)
            if out is not None:
                return out
        return F.linear(input, w, self._parameters["bias"])


def fuse(model: nn.Module, eligible: Callable[[nn.Module], bool]) -> list[FusedGroup]:
    """Fuse every group of `SIBLINGS` children of a module of `model` that
    are all `eligible`, of one width, dtype and device, with a bias each or
    none (a group fused before is kept as it is while intact); the model's
    groups."""
    for _, layers in _siblings(model):
        if _fused(layers):
            continue
        for layer in layers:
            if type(layer) is FusedSibling:
                _plain(layer)
        if all(_fusible(layer, layers[0], eligible) for layer in layers):
            group = FusedGroup(layers)
            for layer in layers:
                layer.__class__ = FusedSibling
                layer.tuner_group = group
    return groups(model)


def sibling_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    """(names joined by "+", N, K) of each distinct shape `fuse` may give a
    group of `model`'s siblings (as `fuse` groups them, any nn.Linear eligible):
    the families its fused products look up."""
    found: dict[tuple[int, int], str] = {}
    linear = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    for names, layers in _siblings(model):
        if all(_fusible(layer, layers[0], linear) for layer in layers):
            shape = (sum(layer.out_features for layer in layers), layers[0].in_features)
            found.setdefault(shape, "+".join(names))
    return [(label, n, k) for (n, k), label in found.items()]


def groups(model: nn.Module) -> list[FusedGroup]:
    """The fused groups of `model`'s layers, in module order."""
    found = {id(m.tuner_group): m.tuner_group for m in model.modules() if type(m) is FusedSibling}
    return list(found.values())


def unfuse(model: nn.Module) -> nn.Module:
    """Every `FusedSibling` of `model` an `nn.Linear` again (its weight stays a
    view of its group's buffer)."""
    for layer in model.modules():
        if type(layer) is FusedSibling:
            _plain(layer)
    return model


def _siblings(model: nn.Module):
    """(names, layers) of each `SIBLINGS` group of children that a module of `model` has all of."""
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in SIBLINGS:
            if all(name in children for name in names):
                yield names, [children[name] for name in names]


def _fused(layers: list[nn.Module]) -> bool:
    """Whether `layers` are one intact group already, in this order."""
    first = layers[0]
    return (all(type(layer) is FusedSibling for layer in layers) and first.tuner_group.layers == layers
            and first.tuner_group.intact())


def _views(whole: torch.Tensor | None, part: torch.Tensor | None, row: int) -> bool:
    """Whether `part` is `whole` from row `row` on (both None: no bias)."""
    if whole is None or part is None:
        return whole is part
    return (part.dtype == whole.dtype
            and part.data_ptr() == whole.data_ptr() + row * whole.stride(0) * whole.element_size())


def _version(t: torch.Tensor) -> int:
    """`t`'s version counter; an inference tensor keeps none (and a module
    does not write its input between its siblings' calls)."""
    return -2 if t.is_inference() else t._version


def _plain(layer: FusedSibling) -> None:
    layer.__class__ = nn.Linear
    del layer.tuner_group


def _fusible(layer: nn.Module, first: nn.Module, eligible: Callable[[nn.Module], bool]) -> bool:
    """Whether `layer` may share a group with `first` (itself `fusible`, checked first)."""
    if not eligible(layer):
        return False
    w, w0 = layer.weight, first.weight
    return ((layer.bias is None) == (first.bias is None) and w.dim() == 2 and w.is_contiguous()
            and layer.in_features == first.in_features and w.dtype == w0.dtype and w.device == w0.device)
