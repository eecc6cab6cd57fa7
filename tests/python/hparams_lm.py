"""TinyLM with saved hyperparameters, for the ``load_from_checkpoint`` tests: built again from a checkpoint alone."""

from __future__ import annotations

from tiny_lm import TinyLM


class HParamsLM(TinyLM):
    """``save_hyperparameters()`` over plain values (``lr``, ``tag``, ``widths``); ``on_load_checkpoint`` records the
    checkpoint's keys and ``hyper_parameters`` as it saw them."""

    def __init__(self, lr: float = 1e-2, tag: str = "default", widths: tuple[int, ...] = (1, 2)) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()
        self.loaded_keys: list[str] | None = None
        self.loaded_hparams: dict | None = None

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded_keys = sorted(checkpoint)
        self.loaded_hparams = dict(checkpoint["hyper_parameters"])
