"""Tiny Hugging Face causal LMs built from configs (no hub access) and a LightningModule around them.

``build(kind)`` gives a 2-layer ``GPT2LMHeadModel`` (tied embedding/head, ``Conv1D``, depth-scaled ``c_proj`` init)
or ``LlamaForCausalLM`` (RMSNorm, rotary ``inv_freq`` buffers, GQA), hidden 32-64, vocab 128, dropout off so that
runs can be compared step by step. The token data is ``tiny_lm.token_dataset`` (ids < 64).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

VOCAB = 128
BLOCKS = {"gpt2": GPT2Block, "llama": LlamaDecoderLayer}
LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}


def config(kind: str, hidden: int = 32):
    if kind == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_embd=hidden, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    if kind == "llama":
        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=None,
        )  # fmt: skip
    raise ValueError(kind)


def build(kind: str, hidden: int = 32):
    return (GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM)(config(kind, hidden))


def add_lora(model, kind: str):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[kind], lora_dropout=0.0))


class HFLM(L.LightningModule):
    """Next-token cross-entropy on an HF causal LM.

    ``in_configure_model=True`` builds the model in ``configure_model`` (on the meta device at stage 3), else in
    ``__init__``. ``lora=True`` wraps it with peft LoRA (r=4); only the adapters train.
    """

    def __init__(self, kind: str, *, in_configure_model: bool = False, lora: bool = False, lr: float = 3e-3) -> None:
        super().__init__()
        self.kind, self.lora, self.lr = kind, lora, lr
        self.model = None
        self.losses: list[float] = []
        if not in_configure_model:
            self.configure_model()

    def configure_model(self) -> None:
        if self.model is None:
            model = build(self.kind)
            self.model = add_lora(model, self.kind) if self.lora else model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)
