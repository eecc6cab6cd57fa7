"""Classes of optional libraries (transformers, peft), found only if the process already loaded their modules.

``transformers`` is a lazy module, and Lightning imports it whenever it is installed: ``transformers.PreTrainedModel``
then loads ``modeling_utils`` and everything it pulls in (389 modules with torchao and accelerate installed, 1.5 s and
about 15 MiB of host memory per rank, measured on the 2-core CI VM) in a process that never built a Hugging Face
model. A model's class is defined in a module that is loaded by the time the model exists, so looking that module up
in ``sys.modules`` finds every real instance and loads nothing.
"""

from __future__ import annotations

import sys


def loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` (a full dotted name, e.g. ``"transformers.modeling_utils"``) is in
    ``sys.modules``; ``None`` otherwise. Never imports anything."""
    return getattr(sys.modules.get(module), name, None)


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel``, if a Hugging Face model class can exist in this process."""
    return loaded_class("transformers.modeling_utils", "PreTrainedModel")


def peft_model_class() -> type | None:
    """``peft.PeftModel``, if peft is loaded."""
    return loaded_class("peft.peft_model", "PeftModel")
