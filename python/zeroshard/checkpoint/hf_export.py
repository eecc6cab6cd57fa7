"""Hugging Face export: what a sharded checkpoint records about the HF models inside a module, and how its tensors map
onto the names ``from_pretrained`` loads.

At save time :func:`describe_hf_models` finds each outermost ``transformers.PreTrainedModel`` (or ``peft.PeftModel``)
inside the saved module (a LightningModule holding ``self.model = AutoModelForCausalLM.from_config(...)``) and records,
as JSON in the checkpoint index: its attribute prefix (``"model."``), its class, its ``config`` and
``generation_config``, the tied keys ``save_pretrained`` leaves out (``lm_head.weight`` of GPT-2), and for a PEFT
LoRA model the adapter settings needed to merge it. Neither ``transformers`` nor ``peft`` is imported here: a module
can only hold their models if the user imported them already.

At export time (``python -m zeroshard.consolidate CKPT OUT --hf``, :func:`zeroshard.consolidate.export_hf`)
:func:`hf_tensor_plan` turns the checkpoint's tensor names into the HF model's own names: the prefix is removed, tied
duplicates are dropped (as ``save_pretrained`` does; ``from_pretrained`` re-ties them), and LoRA layers are merged,
``W + scaling * B @ A`` (transposed for ``fan_in_fan_out`` layers such as GPT-2's ``Conv1D``; ``scaling = alpha / r``,
or ``alpha / sqrt(r)`` with rsLoRA), exactly as ``peft``'s ``merge_and_unload`` computes it (``LoraLayer.
get_delta_weight``), so the output is a plain model that ``from_pretrained`` loads with no ``peft`` installed.
A per-layer ``alpha_pattern`` is looked up as peft does, but only for plain-name keys: no regular expression read from
a checkpoint is compiled (:mod:`zeroshard.checkpoint.peft_patterns`). ``rank_pattern`` is not needed: the rank is the
saved ``lora_A``'s first dimension. Every LoRA layer's shapes are checked before anything is written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.peft_patterns import pattern_value
from zeroshard.loaded_classes import peft_model_class, pretrained_model_class

__all__ = ["HFTensor", "describe_hf_models", "hf_config_files", "hf_tensor_plan", "merge_lora"]

# LoRA settings this export does not merge: the export fails naming them rather than write a wrong model
_UNSUPPORTED_LORA = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "layer_replication")
_LORA_PARTS = re.compile(
    r"^(?P<layer>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.(?P<adapter>[^.]+)"
)


def _json(value: Any) -> Any:
    """A JSON-safe copy of config values (sets, enums and dtypes as plain values)."""
    return json.loads(
        json.dumps(value, default=lambda v: sorted(v) if isinstance(v, set) else getattr(v, "value", str(v)))
    )


def _hf_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(``PreTrainedModel``,) and (``PeftModel``,) when those libraries are imported; empty tuples otherwise."""
    pretrained, peft = pretrained_model_class(), peft_model_class()
    return (pretrained,) if pretrained else (), (peft,) if peft else ()


def _lora_settings(peft_model: nn.Module) -> dict[str, Any]:
    adapter = peft_model.active_adapter
    config = peft_model.peft_config[adapter]
    settings = {"adapter": adapter, "peft_type": str(getattr(config.peft_type, "value", config.peft_type))}
    for key in ("r", "lora_alpha", "use_rslora", "fan_in_fan_out", "alpha_pattern", "rank_pattern", *_UNSUPPORTED_LORA):
        settings[key] = _json(getattr(config, key, None))
    return settings


def describe_hf_models(module: nn.Module) -> list[dict[str, Any]]:
    """The outermost Hugging Face models inside ``module`` (``module`` itself included), as JSON-ready dicts.

    Each dict: ``prefix`` (state-dict prefix of the HF model's own keys, e.g. ``"model."``, or
    ``"model.base_model.model."`` under a ``PeftModel``), ``name`` (its attribute path), ``class`` (e.g.
    ``"GPT2LMHeadModel"``), ``config`` and ``generation_config`` (the JSON HF writes), ``tied`` (HF-local keys
    ``save_pretrained`` drops because they are tied to another weight) and ``lora`` (PEFT adapter settings or None).
    Returns ``[]`` when ``transformers`` is not imported or the module holds no HF model.
    """
    pretrained, peft = _hf_classes()
    if not pretrained:
        return []
    found: list[dict[str, Any]] = []
    taken: list[str] = []
    for name, m in module.named_modules():
        if any(t == "" or name == t or name.startswith(t + ".") for t in taken):  # "": the root is an HF model
            continue
        lora = None
        if peft and isinstance(m, peft):
            lora, hf, prefix = _lora_settings(m), m.get_base_model(), (f"{name}." if name else "") + "base_model.model."
        elif isinstance(m, pretrained):
            hf, prefix = m, f"{name}." if name else ""
        else:
            continue
        taken.append(name)
        refs = hf.state_dict(keep_vars=True)
        tied = getattr(hf, "all_tied_weights_keys", None) or {}
        generation = getattr(hf, "generation_config", None) if hf.can_generate() else None
        found.append(
            {
                "name": name,
                "prefix": prefix,
                "class": type(hf).__name__,
                "config": json.loads(hf.config.to_json_string(use_diff=False)),
                "generation_config": json.loads(generation.to_json_string()) if generation is not None else None,
                "tied": sorted(t for t, s in tied.items() if t in refs and s in refs and refs[t] is refs[s]),
                "lora": lora,
            }
        )
    return found


@dataclass
class HFTensor:
    """One tensor of the exported model: ``name`` (HF's own key) from checkpoint tensor ``source``, or, for a LoRA
    layer, merged from the base weight ``source`` and the adapter tensors ``lora_a`` / ``lora_b``."""

    name: str
    source: str
    lora_a: str | None = None
    lora_b: str | None = None
    scaling: float = 1.0
    transpose: bool = False


def merge_lora(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, transpose: bool) -> torch.Tensor:
    """``base + scaling * (b @ a)`` (transposed when ``transpose``), in fp32, returned in ``base``'s dtype.

    Shapes: Linear ``base (out, in)``, ``a (r, in)``, ``b (out, r)``; ``fan_in_fan_out`` (``Conv1D``) ``base (in,
    out)``; Embedding ``base (num, dim)``, ``a (r, num)``, ``b (dim, r)`` with ``transpose=True``.
    """
    delta = b.float() @ a.float()
    return (base.float() + scaling * (delta.T if transpose else delta)).to(base.dtype)


def _check_lora_shapes(layer: str, base: list[int], a: list[int], b: list[int], transpose: bool) -> int:
    """The LoRA rank ``r`` after checking that ``base + b @ a`` (transposed when ``transpose``) has ``base``'s shape, so
    the export fails before writing anything rather than in the middle of a file.

    Raises:
        ValueError: naming the layer and the three shapes.
    """
    ok = len(base) == len(a) == len(b) == 2 and a[0] == b[1] and a[0] > 0
    if ok:
        ok = [b[0], a[1]] == (base[::-1] if transpose else base)
    if not ok:
        raise ValueError(
            f"LoRA layer {layer}: the checkpoint's shapes do not merge: weight {base}, lora_A {a}, lora_B {b} "
            f"(need lora_A (r, in), lora_B (out, r) and weight {'(in, out)' if transpose else '(out, in)'}); the "
            "index was edited or the adapter is not a plain LoRA layer. Merge it in your script "
            "(model.merge_and_unload() under zeroshard.gathered_parameters, then save_pretrained)"
        )
    return a[0]


def hf_tensor_plan(
    names: list[str], shapes: dict[str, list[int]], model: dict[str, Any]
) -> tuple[list[HFTensor], list[str]]:
    """Maps checkpoint tensor names (module keys, tied aliases included) onto the HF model's keys.

    Args:
        names: every tensor name of the checkpoint, in order.
        shapes: name -> shape (for the LoRA rank).
        model: one entry of :func:`describe_hf_models`.

    Returns:
        ``(tensors, left_out)``: the HF model's tensors in checkpoint order, and checkpoint names outside the HF model
        (e.g. a LightningModule's own extra layers), which the export leaves out.

    Raises:
        ValueError: for a PEFT model that is not LoRA or uses a setting this merge does not support (named, with the
            fix), a LoRA layer whose base weight or adapter half is missing or whose shapes do not merge, or an
            ``alpha_pattern`` key that is not a plain layer name (no regular expression from a checkpoint is compiled:
            :mod:`zeroshard.checkpoint.peft_patterns`) or a non-finite alpha.
    """
    prefix, lora = model["prefix"], model["lora"]
    tied = set(model.get("tied", []))
    left_out = [n for n in names if not n.startswith(prefix)]
    local = [n[len(prefix) :] for n in names if n.startswith(prefix)]
    if lora is None:
        return [HFTensor(n, prefix + n) for n in local if n not in tied], left_out
    if lora["peft_type"] != "LORA":
        raise ValueError(
            f"--hf merges LoRA adapters only; this model uses PEFT {lora['peft_type']}. Merge it in your script "
            "(model.merge_and_unload() under zeroshard.gathered_parameters, then save_pretrained)"
        )
    bad = [k for k in _UNSUPPORTED_LORA if lora.get(k)]
    if bad:
        raise ValueError(
            f"--hf cannot merge a LoRA adapter with {', '.join(f'{k}={lora[k]!r}' for k in bad)}. Merge it in your "
            "script (model.merge_and_unload() under zeroshard.gathered_parameters, then save_pretrained)"
        )
    alpha = lora.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"LoRA lora_alpha in the checkpoint's index is {alpha!r}: not a finite number")
    pattern_value(lora.get("alpha_pattern"), "", None, "alpha_pattern")  # refuses a non-plain key whatever the layers
    adapter = lora["adapter"]
    parts: dict[str, dict[str, str]] = {}  # layer -> {"lora_A": checkpoint name, ...} for the active adapter
    plain: list[str] = []
    for n in local:
        m = _LORA_PARTS.match(n)
        if m is None:
            plain.append(n)
        elif m["adapter"] == adapter:
            parts.setdefault(m["layer"], {})[m["part"].replace("embedding_", "")] = prefix + n
    tensors = []
    for n in plain:
        if ".base_layer." not in n:
            if n not in tied:
                tensors.append(HFTensor(n, prefix + n))
            continue
        layer, leaf = n.split(".base_layer.", 1)
        out = f"{layer}.{leaf}"
        pair = parts.pop(layer, None) if leaf == "weight" else None
        if pair is None:
            tensors.append(HFTensor(out, prefix + n))  # a bias, or a layer the active adapter does not touch
            continue
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA layer {layer}: the checkpoint holds only {sorted(pair)} of lora_A and lora_B")
        a = pair["lora_A"]
        embedding = ".lora_embedding_A." in a
        transpose = embedding or bool(lora.get("fan_in_fan_out"))
        r = _check_lora_shapes(layer, shapes[prefix + n], shapes[a], shapes[pair["lora_B"]], transpose)
        alpha = pattern_value(lora.get("alpha_pattern"), layer, lora["lora_alpha"], "alpha_pattern")
        scaling = alpha / math.sqrt(r) if lora.get("use_rslora") else alpha / r
        tensors.append(HFTensor(out, prefix + n, a, pair["lora_B"], scaling, transpose))
    if parts:
        raise ValueError(f"LoRA adapter tensors without a base weight in the checkpoint: {sorted(parts)}")
    return tensors, left_out


def hf_config_files(model: dict[str, Any], dtype: torch.dtype | None) -> dict[str, dict[str, Any]]:
    """``{"config.json": ..., "generation_config.json": ...}`` for the export, as ``save_pretrained`` writes them:
    ``architectures`` names the class, ``dtype`` the floating dtype the weights were written in."""
    config = dict(model["config"])
    config["architectures"] = [model["class"]]
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = str(
            dtype
        ).removeprefix("torch.")
    files = {"config.json": config}
    if model.get("generation_config"):
        files["generation_config.json"] = model["generation_config"]
    return files
