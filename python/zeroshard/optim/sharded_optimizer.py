"""Points a user's torch optimizer at the fp32 master shards instead of the module's parameters.

The optimizer object is kept (so LR schedulers built on it in ``configure_optimizers`` keep working): each param group's
``params`` list is replaced by the master shards of the buckets built from that group. The step then runs on this rank's
shard only, which is ZeRO stage 1's saving (Rajbhandari et al. 2020, section 5.1): any torch optimizer works unchanged
because every per-element state tensor it creates has the master shard's shape.

With ``offload_optimizer=True``, ``torch.optim.Adam``/``AdamW`` are swapped for
:class:`zeroshard.offload.offload.OffloadedAdam` (a :class:`zeroshard.optim.cpu_adam.CPUAdam`) with the same
hyperparameters (DeepSpeed's ZeRO-Offload does the same swap); any other optimizer runs as it is on the host copies.
Without offload, a bf16 or int8 ``optimizer_state_dtype`` swaps them the same way for ``CPUAdam`` (CPU masters) or
:class:`zeroshard.optim.device_adam.DeviceAdam` (GPU masters): :mod:`zeroshard.optim.engine_state_format`.

Several optimizers (a GAN's generator and discriminator) share one engine: :class:`OptimizerSet` numbers their param
groups in one sequence (optimizer 0's groups first), so buckets and units, which never mix param groups, never mix
optimizers either, and each optimizer gets the master shards of its own groups.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zeroshard.ops import QUANT_BLOCK, dynamic_map
from zeroshard.optim import restore_checks
from zeroshard.optim.state_format import convert_moments
from zeroshard.sharding.flat_param import FlatParam


def original_param_groups(optimizer: Optimizer) -> list[list[torch.nn.Parameter]]:
    """The parameter lists of each param group, before rewiring (kept for checkpoints in torch's format)."""
    return [list(group["params"]) for group in optimizer.param_groups]


def rewire(optimizer: Optimizer, flat_params: list[FlatParam], group_of_flat: list[int]) -> None:
    """Replaces each param group's parameters by the master shards of its buckets.

    Raises:
        RuntimeError: if the optimizer already holds state (it must be fresh, as returned by ``configure_optimizers``).
    """
    if optimizer.state:
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameters; zeroshard must "
            "shard a fresh optimizer. Restore optimizer state through the Trainer's checkpoint instead."
        )
    for gi, group in enumerate(optimizer.param_groups):
        group["params"] = [fp.master for fp, g in zip(flat_params, group_of_flat) if g == gi]


def fused_adam_kind(optimizer: Optimizer) -> str | None:
    """How :func:`to_cpu_adam` converts ``optimizer``: ``"cpu_adam"`` (a :class:`~zeroshard.optim.cpu_adam.CPUAdam`,
    its own flags and ``state_dtype`` kept), ``"adamw"`` / ``"adam"`` (torch's, without ``amsgrad`` / ``maximize``),
    or ``None`` (not converted: it runs as it is)."""
    from zeroshard.optim.cpu_adam import CPUAdam

    if isinstance(optimizer, CPUAdam):
        return "cpu_adam"
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return None
    if any(optimizer.defaults.get(k) for k in ("amsgrad", "maximize")):
        return None
    return "adamw" if type(optimizer) is torch.optim.AdamW else "adam"


def to_cpu_adam(optimizer: Optimizer, cls: type | None = None, **extra) -> Optimizer:
    """Returns a :class:`~zeroshard.optim.cpu_adam.CPUAdam` (or subclass ``cls``, built with ``extra`` keyword
    arguments) equivalent to ``optimizer`` if it is Adam or AdamW (or a ``CPUAdam``: its ``adamw_mode``,
    ``bias_correction`` and, unless ``extra`` gives one, ``state_dtype`` are kept), else ``optimizer`` itself.

    Param group entries are copied as they are (``initial_lr`` and others that LR schedulers added included), so a
    scheduler can be pointed at the returned optimizer.
    """
    from zeroshard.optim.cpu_adam import CPUAdam

    cls = cls or CPUAdam

    if isinstance(optimizer, (PendingOptimizer, cls)):  # replaced by the real one, converted then; or done already
        return optimizer
    kind = fused_adam_kind(optimizer)
    d = optimizer.defaults
    if kind is None and type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        unsupported = [k for k in ("amsgrad", "maximize") if d.get(k)]
        warnings.warn(
            f"offload_optimizer=True: CPUAdam has no {unsupported}; keeping {type(optimizer).__name__} on the host.",
            stacklevel=2,
        )
        return optimizer
    if kind is None:
        warnings.warn(
            f"offload_optimizer=True with {type(optimizer).__name__}: it runs unfused on the host copies of the master "
            "weights. Return torch.optim.Adam or AdamW from configure_optimizers to get the fused CPUAdam.",
            stacklevel=2,
        )
        return optimizer
    if kind == "cpu_adam":
        flags = {"adamw_mode": d["adamw_mode"], "bias_correction": d["bias_correction"]}
        extra = {"state_dtype": optimizer.state_dtype, "min_8bit_size": optimizer.min_8bit_size, **extra}
    else:
        flags = {"adamw_mode": kind == "adamw" or bool(d.get("decoupled_weight_decay", False))}
    return cls(
        [dict(group) for group in optimizer.param_groups],
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        **flags,
        **extra,
    )


class OptimizerSet:
    """The optimizers of one engine, with their param groups numbered in one sequence.

    ``QUANT_BLOCK``: elements per int8 state block (2048), for readers of checkpoints.

    Args:
        optimizers: one torch optimizer or several, fresh (no state), over disjoint parameters of one module.

    Attributes:
        optimizers: the optimizers to step, in the order given (an Adam/AdamW becomes its
            :class:`~zeroshard.offload.offload.OffloadedAdam` after :meth:`offload_adam`).
        group_optimizer: for each global param group, the index of the optimizer that owns it.

    Raises:
        TypeError: if an element is not a ``torch.optim.Optimizer``.
        ValueError: if no optimizer is given, or one parameter is in two optimizers.
    """

    QUANT_BLOCK = QUANT_BLOCK

    def __init__(self, optimizers: Optimizer | Sequence[Optimizer]) -> None:
        optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
        if not optimizers:
            raise ValueError("zeroshard needs at least one optimizer over the module's parameters")
        bad = [type(o).__name__ for o in optimizers if not isinstance(o, Optimizer)]
        if bad:
            raise TypeError(f"zeroshard shards torch.optim.Optimizer objects; got {bad}")
        seen: dict[int, int] = {}
        for oi, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if seen.setdefault(id(p), oi) != oi:
                        raise ValueError(
                            f"a parameter of shape {tuple(p.shape)} is in optimizers {seen[id(p)]} and {oi}: each "
                            "parameter must belong to one optimizer (one param group)"
                        )
        self.optimizers: list[Optimizer] = optimizers
        self.group_optimizer = [oi for oi, opt in enumerate(optimizers) for _ in opt.param_groups]
        self._flat: list[list[FlatParam]] = [[] for _ in optimizers]
        self._owner: dict[int, int] = {}  # id(flat param) -> optimizer index

    def original_groups(self) -> list[list[torch.nn.Parameter]]:
        """Every optimizer's parameter lists, one per param group, in the global group order."""
        return [group for opt in self.optimizers for group in original_param_groups(opt)]

    def group_slice(self, oi: int) -> slice:
        """The global indices of optimizer ``oi``'s param groups."""
        start = self.group_optimizer.index(oi)
        return slice(start, start + len(self.optimizers[oi].param_groups))

    def rewire(self, flat_params: list[FlatParam], group_of_flat: list[int]) -> None:
        """Points every optimizer at the master shards of its own groups' flat parameters (see :func:`rewire`)."""
        for oi, opt in enumerate(self.optimizers):
            first = self.group_slice(oi).start
            mine = [(fp, g - first) for fp, g in zip(flat_params, group_of_flat) if self.group_optimizer[g] == oi]
            rewire(opt, [fp for fp, _ in mine], [g for _, g in mine])
            self._flat[oi] = [fp for fp, _ in mine]
            self._owner.update({id(fp): oi for fp, _ in mine})

    def offload_adam(self, cls: type, state_dtypes: Sequence[Any] | None = None, **extra) -> None:
        """Replaces each Adam/AdamW (and ``CPUAdam``) by ``cls`` over the same groups (:func:`to_cpu_adam`), with
        ``flat_of``; ``state_dtypes``: the moments' format of each optimizer (default: fp32, or a ``CPUAdam``'s
        own)."""
        flat_of = {id(fp.master): fp for flats in self._flat for fp in flats}
        formats = list(state_dtypes) if state_dtypes is not None else [None] * len(self.optimizers)
        self.optimizers = [
            to_cpu_adam(opt, cls, flat_of=flat_of, **extra, **({"state_dtype": f} if f is not None else {}))
            for opt, f in zip(self.optimizers, formats)
        ]

    def replace_adam(self, classes: Sequence[type | None], state_dtypes: Sequence[Any]) -> None:
        """Without offload: replaces optimizer ``i`` by ``classes[i]`` (a fused Adam over the same groups and
        hyperparameters, in format ``state_dtypes[i]``: :func:`to_cpu_adam`) where it is not ``None``. The engine's
        optimizers change as with :meth:`offload_adam`; the strategies point LR schedulers at the new ones."""
        self.optimizers = [
            opt if cls is None else to_cpu_adam(opt, cls, state_dtype=fmt)
            for opt, cls, fmt in zip(self.optimizers, classes, state_dtypes)
        ]

    def master_device(self, oi: int) -> torch.device | None:
        """The device of optimizer ``oi``'s master shards (after :meth:`rewire`), or ``None`` if it steps none."""
        return self._flat[oi][0].master.device if self._flat[oi] else None

    def index(self, optimizer: Optimizer) -> int:
        """The position of ``optimizer`` (or of the optimizer a Lightning/Fabric wrapper holds).

        Raises:
            ValueError: if it is none of this engine's optimizers.
        """
        optimizer = unwrap_optimizer(optimizer)
        for oi, opt in enumerate(self.optimizers):
            if opt is optimizer:
                return oi
        raise ValueError(
            f"{type(optimizer).__name__} is not one of the optimizers zeroshard set up; step, clip and save the "
            "optimizers that the strategy returned (with optimizer offload, Adam/AdamW are replaced by OffloadedAdam)"
        )

    def flat_params_of(self, optimizer: Optimizer | None) -> list[FlatParam]:
        """The trainable flat parameters ``optimizer`` steps (every optimizer's when ``None``)."""
        if optimizer is None:
            return [fp for flats in self._flat for fp in flats]
        return list(self._flat[self.index(optimizer)])

    def optimizer_of(self, fp: FlatParam) -> Optimizer:
        return self.optimizers[self._owner[id(fp)]]

    def group_index_of(self, fp: FlatParam) -> int:
        """The global param group index of a trainable flat parameter."""
        oi = self._owner[id(fp)]
        first = self.group_slice(oi).start
        groups = self.optimizers[oi].param_groups
        return first + next(gi for gi, g in enumerate(groups) if any(p is fp.master for p in g["params"]))

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's param group dicts (live), in the global group order."""
        return [group for opt in self.optimizers for group in opt.param_groups]

    # -- state formats, for checkpoints (:mod:`zeroshard.optim.state_format`; the checkpoint layer imports no optim) --

    def state_format_of(self, fp: FlatParam) -> torch.dtype | str:
        """The format ``fp``'s optimizer keeps its master's moments in: a ``CPUAdam``'s ``state_format`` (under int8,
        fp32 for a flat parameter of small parameters), else ``torch.float32``."""
        opt = self.optimizer_of(fp)
        return opt.state_format(fp.master) if hasattr(opt, "state_format") else torch.float32

    def convert_shard_moments(self, fp: FlatParam, moments: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"exp_avg", "exp_avg_sq"}`` of ``fp``'s shard (fp32 values, or any format) as new tensors in the format
        of ``fp``'s optimizer (:func:`~zeroshard.optim.state_format.convert_moments`: int8 requantised by the kernel's
        rule, bf16 rounded to nearest even; deterministic), 1-D of ``shard_numel``, on the master's device."""
        device = fp.master.device
        out = convert_moments({k: v.cpu() for k, v in moments.items()}, self.state_format_of(fp), torch.Size([-1]))
        return {k: v.to(device) for k, v in out.items()}

    def quant_maps(self) -> dict[str, torch.Tensor]:
        """The dynamic maps int8 moments are codes of (``exp_avg``: signed, ``exp_avg_sq``: unsigned; 256 fp32 each),
        if any optimizer keeps int8 moments, else ``{}``: a checkpoint stores them so it can be read without the
        kernel (``map[code] * absmax``, blocks of :data:`QUANT_BLOCK` elements)."""
        if not any(getattr(o, "state_dtype", None) == "int8" for o in self.optimizers):
            return {}
        return {"exp_avg": dynamic_map(True), "exp_avg_sq": dynamic_map(False)}

    # -- restoring from a checkpoint (:mod:`zeroshard.optim.restore_checks`; the checkpoint layer imports no optim) -

    def kinds(self) -> list[str]:
        """The class each optimizer is recorded as in a checkpoint (:func:`restore_checks.optimizer_kind`)."""
        return [restore_checks.optimizer_kind(opt) for opt in self.optimizers]

    def check_restore(self, source: str, saved: Any, layouts: list, flat_params, tensor_names) -> list[dict]:
        """Checks a sharded checkpoint's optimizer state before anything loads (:func:`restore_checks.check_sharded`;
        ``tensor_names``: rank file 0's); returns the values to assign to each param group.

        Raises:
            OptimizerRestoreError (a ``ValueError``): naming ``source``, the group, the key, the value and the fix.
        """
        keys = restore_checks.saved_state_keys(tensor_names)
        return restore_checks.check_sharded(source, saved, layouts, self, flat_params, keys)

    def drop_restore(self, source: str, saved: Any, tensor_names) -> None:
        """``optimizer_state='reset'``: clears every optimizer's state and warns with what the checkpoint held."""
        saved = saved if isinstance(saved, dict) else {}
        keys = {k for ks in restore_checks.saved_state_keys(tensor_names).values() for k in ks}
        scalar = saved.get("scalar_state")
        keys |= {k for st in scalar.values() if isinstance(st, dict) for k in st} if isinstance(scalar, dict) else set()
        groups = saved.get("param_groups") if isinstance(saved.get("param_groups"), list) else []
        kinds = saved.get("classes") if isinstance(saved.get("classes"), list) else []
        for opt in self.optimizers:
            opt.state.clear()
        restore_checks.warn_reset(source, kinds, groups, keys, self.optimizers)


class PendingOptimizer(Optimizer):
    """Stands in for the optimizer of a model set up alone, before its optimizer exists (``fabric.setup(model)`` then
    ``fabric.setup_optimizers(opt)``, as LitGPT does): one param group over every parameter, so the engine can
    materialise and shard the model; replaced when the real optimizer is set up
    (:meth:`~zeroshard.engine.engine.ZeroEngine.adopt_optimizers`). It holds no state and cannot step.
    """

    def __init__(self, params) -> None:
        super().__init__(list(params), {"lr": 0.0})

    def step(self, closure=None):
        raise RuntimeError(
            "this model was set up without an optimizer: create one over the set-up model's parameters and pass it to "
            "fabric.setup_optimizers(optimizer), then step the optimizer that call returns"
        )


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` or Fabric's ``_FabricOptimizer`` (both keep it as
    ``_optimizer``), or ``optimizer`` itself."""
    return getattr(optimizer, "_optimizer", optimizer)
