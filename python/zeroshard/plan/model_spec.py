"""What the planner knows about a model: parameter shapes per stage-3 unit, and the dimensions that size activations
and FLOPs. Built on the meta device (nothing allocated) from a module, a ``configure_model``-style callable, a Hugging
Face ``config.json``, or GPT dimensions (minGPT's layout: Karpathy's minGPT / ``examples/gpt.py``).
"""

from __future__ import annotations

import importlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

Shape = tuple[int, ...]


def _numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class UnitSpec:
    """One stage-3 unit: the shapes of its trainable and frozen parameters, in registration order."""

    name: str
    shapes: list[Shape]
    frozen: list[Shape] = field(default_factory=list)
    is_root: bool = False

    @property
    def numel(self) -> int:
        return sum(map(_numel, self.shapes))

    @property
    def frozen_numel(self) -> int:
        return sum(map(_numel, self.frozen))


@dataclass
class ModelSpec:
    """A model as the planner sees it.

    Attributes:
        name: for tables.
        units: the root unit first (parameters no other unit claims: embeddings, final norm, head), then the units
            (transformer blocks) in forward order.
        n_layer, hidden, ffn, n_head, vocab, seq_len: dimensions for the activation and FLOP estimates (a
            transformer: ``n_layer`` blocks of width ``hidden`` with an MLP of width ``ffn``).
        gated_mlp: the MLP saves gate, up and their product (SwiGLU, Llama) instead of one activation (GELU).
        head_params: elements of the output projection (counted in FLOPs even when tied to the embedding).
        lookup_params: elements of embedding tables used only as lookups (no FLOPs): position embeddings, and the
            token embedding when the head does not share it.
    """

    name: str
    units: list[UnitSpec]
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    head_params: int = 0
    lookup_params: int = 0

    @property
    def trainable(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def frozen(self) -> int:
        return sum(u.frozen_numel for u in self.units)

    @property
    def num_params(self) -> int:
        return self.trainable + self.frozen

    def forward_flops_per_token(self, seq_len: int) -> float:
        """2 per dense parameter (lookup tables excluded) plus causal attention's 2 L h s (Kaplan et al. 2020)."""
        return 2.0 * (self.num_params - self.lookup_params) + 2.0 * self.n_layer * self.hidden * seq_len

    def trainable_shapes(self) -> list[Shape]:
        """Every trainable parameter's shape, in registration order (root's first: embeddings before blocks is
        close enough for bucketing, which takes them in reverse)."""
        return [s for u in self.units for s in u.shapes]


# -- GPT dimensions ---------------------------------------------------------------------------------------------------


def gpt_spec(
    n_layer: int,
    n_embd: int,
    n_head: int = 16,
    vocab_size: int = 50304,
    block_size: int = 1024,
    tied_head: bool = True,
    bias: bool = True,
) -> ModelSpec:
    """minGPT's layout (``examples/gpt.py``): token and position embeddings, ``n_layer`` pre-LayerNorm blocks (fused
    qkv, 4x MLP, GELU), a final LayerNorm, and an LM head tied to the token embedding (minGPT's original has an
    untied one: ``tied_head=False``). Parameters per block: 12 d^2 + 13 d (with biases)."""
    d = n_embd

    def linear(out_f: int, in_f: int) -> list[Shape]:
        return [(out_f, in_f)] + ([(out_f,)] if bias else [])

    def norm() -> list[Shape]:
        return [(d,)] + ([(d,)] if bias else [])

    block = norm() + linear(3 * d, d) + linear(d, d) + norm() + linear(4 * d, d) + linear(d, 4 * d)
    root = [(vocab_size, d), (block_size, d)] + norm() + ([] if tied_head else [(vocab_size, d)])
    units = [UnitSpec("<root>", root, is_root=True)]
    units += [UnitSpec(f"blocks.{i}", list(block)) for i in range(n_layer)]
    return ModelSpec(
        name=f"GPT {n_layer}x{n_embd}",
        units=units,
        n_layer=n_layer,
        hidden=d,
        ffn=4 * d,
        n_head=n_head,
        vocab=vocab_size,
        seq_len=block_size,
        head_params=vocab_size * d,
        lookup_params=block_size * d + (0 if tied_head else vocab_size * d),
    )


# -- any module, built on the meta device -----------------------------------------------------------------------------


def _default_unit_class(module: nn.Module) -> type | None:
    """The class to wrap as units: Hugging Face's ``_no_split_modules`` (its decoder layer), else the most frequent
    class among the children of the model's ``nn.ModuleList``s (a transformer's blocks)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    if names:
        for m in module.modules():
            if type(m).__name__ in names:
                return type(m)
    counts = Counter(type(c) for m in module.modules() if isinstance(m, nn.ModuleList) for c in m.children())
    return counts.most_common(1)[0][0] if counts else None


def module_spec(
    module: nn.Module,
    wrap_policy=None,
    *,
    name: str | None = None,
    seq_len: int | None = None,
    hidden: int | None = None,
    ffn: int | None = None,
    n_head: int | None = None,
    vocab: int | None = None,
    gated_mlp: bool | None = None,
) -> ModelSpec:
    """The spec of a built module (on the meta device or not: only shapes are read).

    Units follow :func:`zeroshard.sharding.units.plan_units` with ``wrap_policy`` (default: see
    :func:`_default_unit_class`). Dimensions not given are read from the module: ``hidden`` and ``vocab`` from its
    largest ``nn.Embedding``, ``ffn`` as 4 x hidden, ``n_head`` from an ``n_head`` / ``num_heads`` /
    ``num_attention_heads`` attribute of a unit or its children (else 1, which only affects the FLOPs of attention),
    ``seq_len`` 1024.
    """
    from zeroshard.sharding.units import plan_units

    policy = wrap_policy if wrap_policy is not None else _default_unit_class(module)
    trainable = [p for p in module.parameters() if p.requires_grad]
    plans = plan_units(module, policy, [trainable])
    units = []
    for i, plan in enumerate(plans):
        shapes = [tuple(p.shape) for b in plan.buckets for p in b.params]
        frozen = [tuple(p.shape) for p in plan.frozen.params] if plan.frozen else []
        units.append(UnitSpec(plan.name or "<root>", shapes, frozen, is_root=i == 0))
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    # a table some other module also registers (a tied LM head) is a matmul too, not only a lookup
    users = Counter(id(p) for m in module.modules() for p in m._parameters.values() if p is not None)
    lookup = sum(e.weight.numel() for e in embeddings if users[id(e.weight)] == 1)
    biggest = max(embeddings, key=lambda e: e.num_embeddings, default=None)
    hidden = hidden or (biggest.embedding_dim if biggest else max((s[-1] for s in units[0].shapes), default=1))
    vocab = vocab or (biggest.num_embeddings if biggest else 0)
    if n_head is None:
        n_head = 1
        for unit_plan in plans[1:2]:
            for m in unit_plan.module.modules():
                for attr in ("n_head", "num_heads", "num_attention_heads"):
                    if isinstance(getattr(m, attr, None), int):
                        n_head = getattr(m, attr)
    return ModelSpec(
        name=name or type(module).__name__,
        units=units,
        n_layer=max(1, len(units) - 1),
        hidden=hidden,
        ffn=ffn or 4 * hidden,
        n_head=n_head,
        vocab=vocab,
        seq_len=seq_len or 1024,
        gated_mlp=bool(gated_mlp),
        head_params=vocab * hidden,
        lookup_params=lookup,
    )


def callable_spec(target: str, wrap_policy=None, **dims) -> ModelSpec:
    """``"package.module:function"``: calls it on the meta device. It may return an ``nn.Module`` or a
    LightningModule whose ``configure_model()`` builds the model (Lightning's hook), as ``ZeroStrategy`` would.

    Raises:
        ValueError: if ``target`` is not ``module:attribute`` or does not give a module.
    """
    from zeroshard.meta_init import init_meta_context

    if ":" not in target:
        raise ValueError(f"--model {target!r}: expected 'package.module:callable' (e.g. 'mymodels:build')")
    mod_name, attr = target.split(":", 1)
    fn = getattr(importlib.import_module(mod_name), attr)
    with init_meta_context():
        model = fn() if callable(fn) and not isinstance(fn, nn.Module) else fn
        if hasattr(model, "configure_model"):
            model.configure_model()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {target!r} returned {type(model).__name__}, not an nn.Module")
    return module_spec(model, wrap_policy, name=target, **dims)


def hf_config_spec(path: str | Path, seq_len: int | None = None) -> ModelSpec:
    """A Hugging Face ``config.json`` (a file or its directory): the causal-LM model it describes, built on the meta
    device through ``transformers`` (no weights, no hub access).

    Raises:
        ValueError: if the file has no ``model_type``.
    """
    import transformers

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    raw = json.loads(file.read_text())
    if "model_type" not in raw:
        raise ValueError(f"{file}: no 'model_type' key; is it a Hugging Face config.json?")
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    get = lambda *keys: next((raw[k] for k in keys if raw.get(k) is not None), None)  # noqa: E731
    hidden = get("hidden_size", "n_embd", "d_model")
    ffn = get("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    act = str(get("hidden_act", "activation_function") or "")
    return module_spec(
        model,
        name=f"{raw['model_type']} ({file.name})",
        seq_len=seq_len or get("max_position_embeddings", "n_positions", "n_ctx") or 1024,
        hidden=hidden,
        ffn=ffn,
        n_head=get("num_attention_heads", "n_head"),
        vocab=get("vocab_size"),
        gated_mlp=act in ("silu", "swiglu", "swish") and "intermediate_size" in raw,
    )
