"""How Qwen2.5-VL whole reads its text config: as Qwen2's, whose decoder it is (the dense decoder
part's recipe and table then give it q/k/v biases). Imports no framework: ``convert`` loads it."""

from __future__ import annotations

# The decoder is Qwen2's: the dense decoder part reads its text config as such (q/k/v biases).
DECODER_MODEL_TYPE = "qwen2"


class Qwen2Text:
    """The text config seen as Qwen2's: every field its own, the model type the dense decoder part
    knows (its Qwen2 decoder has q/k/v biases and no other)."""

    model_type = DECODER_MODEL_TYPE

    def __init__(self, text):
        self._text = text

    def __getattr__(self, name):
        return getattr(self._text, name)
