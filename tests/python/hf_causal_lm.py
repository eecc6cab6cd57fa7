"""A LightningModule around a tiny Hugging Face causal LM built from a config (no hub access), for the export tests.

``arch`` picks GPT-2 (tied embedding and head, ``Conv1D`` layers) or Llama (rotary embedding with non-persistent
``inv_freq`` buffers). The HF model is ``self.model``, so every state-dict key of the LightningModule starts with
``model.``. ``build="init"`` builds it in ``__init__`` (eager); ``"configure"`` in ``configure_model`` (on the meta
device at ZeRO stage 3), where ``pretrained`` (a ``save_pretrained`` directory) is loaded with
``zeroshard.load_pretrained``. ``lora=True`` wraps it in a ``peft`` LoRA model (r=4 on the attention input
projection). Hyperparameters are plain values, so ``load_from_checkpoint`` can rebuild the module.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

VOCAB = 64  # matches tiny_lm.token_dataset
FIXED_BATCH = torch.arange(32).remainder(VOCAB).view(2, 16)  # (2, 16) token ids whose logits the export tests compare


def hf_config(arch: str):
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    raise ValueError(f"arch {arch!r}: use 'gpt2' or 'llama'")


def build_hf_model(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config(arch))


def block_class(arch: str):
    """The transformer block class: the ZeRO-3 unit."""
    if arch == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def with_lora(model, arch: str):
    from peft import LoraConfig, get_peft_model

    targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=arch == "gpt2"))


class HFCausalLM(L.LightningModule):
    def __init__(
        self, arch: str = "gpt2", build: str = "init", lr: float = 1e-2, pretrained: str = "", lora: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None
        if build == "init":
            self.configure_model()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = build_hf_model(self.hparams.arch)
        if self.hparams.pretrained:
            import zeroshard

            zeroshard.load_pretrained(model, self.hparams.pretrained)
        self.model = with_lora(model, self.hparams.arch) if self.hparams.lora else model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)
