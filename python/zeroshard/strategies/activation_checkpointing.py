"""Activation checkpointing for chosen submodules, without changing the module tree.

Each selected submodule's ``forward`` runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its
intermediate activations are dropped after forward and recomputed in backward, so only the region's inputs are kept.
With ``offload_to_cpu=True`` those kept inputs go to host memory through ``torch.autograd.graph.save_on_cpu`` (the
role of DeepSpeed's ``cpu_checkpointing``).

How it is applied, and why: we set an instance attribute ``forward`` on each selected module (a small callable that
calls the original forward through ``checkpoint``). ``nn.Module.__call__`` looks ``forward`` up on the instance, so:

* the module tree, parameter names and ``state_dict()`` keys are unchanged (unlike FSDP1's ``CheckpointWrapper``,
  which inserts ``_checkpoint_wrapped_module`` into every name), and no class is patched or swapped;
* the module's own forward hooks stay *outside* the checkpointed region and run once per forward; recomputation in
  backward re-runs only the forward body. A ZeRO-3 unit's gather/reshard hooks on the same module are therefore not
  re-run during recomputation: the engine must have the unit's parameters gathered when the unit's backward starts
  (its pre-backward hook on the unit's outputs fires before the recomputation, which happens lazily when autograd
  first unpacks a tensor saved inside the region);
* PyTorch's composable ``torch.distributed._composable.checkpoint`` (present in torch 2.13, works on CPU) also keeps
  names, but it is private API, opens the region in a forward pre-hook and closes it in a forward hook (so other hooks
  end up inside or outside depending on registration order), and recomputes by calling the whole module again, which
  re-runs every other forward hook of the module (a ZeRO-3 reshard-after-forward hook would then free the parameters
  in the middle of backward). The instance-level forward is simpler and gives the engine one fixed rule.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "is_checkpointed", "policy_predicate"]

Policy = type | tuple | Callable[[str, nn.Module], bool]


class _CheckpointedForward:
    """The instance-level ``forward`` of a checkpointed module.

    It calls the forward the module had before (an instance-level one if there was one, else its class's ``forward``,
    looked up at call time) under non-reentrant checkpointing. It holds the module itself rather than a bound method,
    so ``copy.deepcopy`` and pickling of the model re-bind it to the copy instead of the original.
    """

    def __init__(self, module: nn.Module, inner: Callable | None, offload_to_cpu: bool) -> None:
        self.module = module
        self.inner = inner  # the previous instance-level forward, or None for the class's forward
        self.offload_to_cpu = offload_to_cpu

    def __call__(self, *args, **kwargs):
        fn = self.inner if self.inner is not None else functools.partial(type(self.module).forward, self.module)
        if kwargs:  # passed through the closure, so checkpoint's own keywords never collide with the module's
            fn = functools.partial(fn, **kwargs)
        # save_on_cpu must enclose the checkpoint call: checkpoint saves the region's inputs through the enclosing
        # saved-tensor hooks before installing its own (inside the region, its hooks replace ours).
        ctx = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if self.offload_to_cpu
            else contextlib.nullcontext()
        )
        with ctx:
            return checkpoint(fn, *args, use_reentrant=False)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` has checkpointed ``module``'s forward."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def policy_predicate(policy) -> Callable[[str, nn.Module], bool]:
    """``policy`` as ``(qualified_name, module) -> bool``; a callable's result must be a bool (``TypeError``).

    Raises:
        TypeError: if ``policy`` is not an ``nn.Module`` subclass, a non-empty tuple of them, or a callable.
    """

    def is_module_class(c) -> bool:
        return isinstance(c, type) and issubclass(c, nn.Module)

    if is_module_class(policy):
        return lambda _name, m: isinstance(m, policy)
    if isinstance(policy, tuple):
        if policy and all(is_module_class(c) for c in policy):
            return lambda _name, m: isinstance(m, policy)
    elif callable(policy) and not isinstance(policy, type):

        def predicate(name: str, m: nn.Module) -> bool:
            out = policy(name, m)
            if not isinstance(out, bool):
                raise TypeError(
                    f"activation checkpointing policy {policy!r} must return a bool, returned {out!r} for '{name}'"
                )
            return out

        return predicate
    raise TypeError(
        f"activation checkpointing policy must be an nn.Module subclass, a non-empty tuple of them, or a callable "
        f"(name, module) -> bool; got {policy!r}"
    )


def apply_activation_checkpointing(module: nn.Module, policy: Policy, *, offload_to_cpu: bool = False) -> list[str]:
    """Recompute the forward of every submodule of ``module`` selected by ``policy`` in backward, in place.

    Args:
        module: the model (it may itself be selected; its name is then ``""``). Not restructured: parameter names and
            ``state_dict()`` keys stay the same, and outputs and gradients are those of the unchanged model (dropout
            included: checkpoint restores the RNG state for recomputation).
        policy: an ``nn.Module`` subclass (e.g. the transformer block class), a tuple of such classes, or a callable
            ``(qualified_name, submodule) -> bool``. Modules are visited in ``named_modules()`` order; the descendants
            of a selected or already-checkpointed module are not visited (no nested checkpointing).
        offload_to_cpu: also move what checkpointing keeps (each region's inputs) to host memory until backward, via
            ``torch.autograd.graph.save_on_cpu`` (pinned when CUDA is available).

    Returns:
        The qualified names of the selected submodules, in ``named_modules()`` order; after the call all of them are
        checkpointed. Applying again with the same ``offload_to_cpu`` is a no-op for modules already checkpointed
        (they are not wrapped twice) and returns the same names.

    Raises:
        TypeError: if ``policy`` is none of the above (the message shows it), or a callable policy returns a non-bool.
        ValueError: if a selected module is already checkpointed with a different ``offload_to_cpu``, or contains an
            already-checkpointed module (from an earlier call); checked before anything is changed.
    """
    predicate = policy_predicate(policy)
    selected: list[tuple[str, nn.Module]] = []
    inside: list[str] = []  # selected or already-checkpointed modules: their descendants are not visited
    for name, sub in module.named_modules():
        if any(p == "" or name.startswith(p + ".") for p in inside):
            continue
        if predicate(name, sub):
            if is_checkpointed(sub):
                if sub.__dict__["forward"].offload_to_cpu != offload_to_cpu:
                    raise ValueError(
                        f"'{name}' is already checkpointed with offload_to_cpu={not offload_to_cpu}; refusing to "
                        f"checkpoint it again with offload_to_cpu={offload_to_cpu}"
                    )
            else:
                nested = [
                    f"{name}.{n}".lstrip(".") for n, d in sub.named_modules() if d is not sub and is_checkpointed(d)
                ]
                if nested:
                    raise ValueError(
                        f"'{name}' matches the checkpointing policy but contains already-checkpointed modules {nested} "
                        "(nested checkpointing would recompute them twice)"
                    )
            selected.append((name, sub))
            inside.append(name)
        elif is_checkpointed(sub):
            inside.append(name)
    for _, sub in selected:
        if not is_checkpointed(sub):
            # Instance attribute: nn.Module.__setattr__ stores a plain callable in __dict__, outside _parameters,
            # _buffers and _modules, so names and state_dict keys do not change.
            sub.forward = _CheckpointedForward(sub, sub.__dict__.get("forward"), offload_to_cpu)
    return [name for name, _ in selected]
