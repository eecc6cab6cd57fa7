"""Parameters no rank used in a step keep DDP's ``grad = None`` semantics: the optimizer step leaves them alone.

Under DDP(find_unused_parameters=True) a parameter that got no gradient on any rank keeps ``grad = None``, so
``torch.optim.AdamW`` skips it: no weight decay, no moment update, no step count. Here parameters share a flat master
shard, which the optimizer steps as a whole with zeros where a parameter got no gradient; weight decay would still move
it and the moments would still decay. So, only in a step where some parameter was unused everywhere:

* a flat parameter none of whose parameters was used anywhere gets no gradient at all (``master.grad = None``, its
  offloaded host gradient dropped): its optimizer skips it, step count included, as DDP's does;
* otherwise the unused parameters' elements of this rank's master shard and of every per-element optimizer state
  tensor (``exp_avg``, ``exp_avg_sq``, any optimizer's) are copied at the end of backward and written back right after
  the optimizer step (a step post-hook; for the fused offloaded Adam, which also wrote the compute-dtype shard, that
  shard's elements too). Their per-shard ``step`` count still advances with the rest of the shard: torch keeps one
  count per tensor, and the shard is one tensor. Values and moments equal DDP's; a parameter used again later sees
  Adam's bias correction of the shard's count, not of its own.

A parameter left out by only some ranks is averaged with zeros from those ranks, exactly as DDP does; nothing here
applies to it. When every parameter was used somewhere (the common case) nothing is copied.
"""

from __future__ import annotations

import torch

from zeroshard.sharding.flat_param import FlatParam


class UnusedParams:
    """Keeps unused-everywhere parameters of one engine out of its optimizer steps.

    Args:
        engine: the :class:`~zeroshard.engine.engine.ZeroEngine` (its flat parameters, optimizers and offload).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._seen: set[int] = set()  # id(flat param) reduced since its optimizer last stepped
        self._pending: dict[int, list[int]] = {}  # id(flat param) -> params unused in every backward since then
        self._saved: dict[int, tuple[list[tuple[int, int]], dict[str, torch.Tensor]]] = {}
        self._hooks: list = []
        self.hook_optimizers()

    def hook_optimizers(self) -> None:
        """Registers the restoring step post-hook on the engine's (current) optimizers."""
        self.remove_hooks()
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in self.engine.optimizers]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def backward_done(self, unused: list[list[int]]) -> None:
        """After a synchronised backward, with the parameters no rank used (per flat parameter, as indices): drops
        the gradients of wholly unused flat parameters and saves the elements of partly unused ones.

        A parameter used in an earlier backward of the same step (gradients accumulated without a step between) is
        used: only parameters unused in every backward since its optimizer's last step count."""
        for fp, indices in zip(self.engine.flat_params, unused):
            key = id(fp)
            if key in self._seen:
                indices = sorted(set(indices) & set(self._pending.get(key, ())))
            self._seen.add(key)
            self._saved.pop(key, None)
            if not indices or fp.master is None:
                self._pending.pop(key, None)
                continue
            self._pending[key] = indices
            if len(indices) == len(fp.params):
                self._drop_gradient(fp)
                continue
            wanted = set(indices)
            ranges = [(s, s + n) for pi, _, s, n in fp.layout.shard_slices(fp.rank) if pi in wanted and n > 0]
            if ranges:
                self._saved[key] = (ranges, {k: _gather(t, ranges) for k, t in self._tensors(fp).items()})

    def _drop_gradient(self, fp: FlatParam) -> None:
        engine = self.engine
        fp.master.grad = None
        if engine.offload is not None:
            engine.offload.gradients_consumed([fp])

    def _tensors(self, fp: FlatParam) -> dict[str, torch.Tensor]:
        """The master shard and every per-element state tensor its optimizer holds for it, by state key."""
        master = fp.master.detach()
        state = self.engine.optim.optimizer_of(fp).state.get(fp.master, {})
        out = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel()}
        out[" master"] = master  # a key no optimizer uses
        return out

    @torch.no_grad()
    def _after_step(self, optimizer, args, kwargs) -> None:
        """Step post-hook: writes the saved elements back (state this very step created back to zeros, as it was)."""
        if not self._saved:
            return
        engine = self.engine
        offload_waited = False
        for fp in engine.optim.flat_params_of(optimizer):
            entry = self._saved.pop(id(fp), None)
            if entry is None:
                continue
            ranges, saved = entry
            for k, t in self._tensors(fp).items():
                value, at, flat = saved.get(k), 0, t.view(-1)
                for a, b in ranges:
                    if value is None:  # torch creates its state lazily, in the first step: zeros before it
                        flat[a:b].zero_()
                    else:
                        flat[a:b].copy_(value[at : at + b - a])
                    at += b - a
            if engine.offload is not None and not fp.master_aliases_shard:
                # the fused offloaded step wrote the compute-dtype shard already (after_step rewrites it for others)
                if not offload_waited and not fp.host_shard:
                    engine.offload.h2d.synchronize(engine.offload.h2d.last_ticket())
                    offload_waited = True
                master = fp.master.detach()
                for a, b in ranges:
                    fp.shard[a:b].copy_(master[a:b])

    def step_done(self, stepped: list[FlatParam]) -> None:
        """After the engine's ``after_step`` for ``stepped``: their next backward starts a new step."""
        for fp in stepped:
            self._seen.discard(id(fp))
            self._pending.pop(id(fp), None)
            self._saved.pop(id(fp), None)


def _gather(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    flat = t.view(-1)
    return torch.cat([flat[a:b] for a, b in ranges]).clone()
