"""transformers' ``Llama4Config`` as config.json is read without transformers: the whole model's
fields and its two sub-configs (the tower's and the decoder's tables are their packages')."""

from __future__ import annotations

from mmparity.config import ConfigType

HF_CONFIGS = {
    "llama4": ConfigType({"vision_config": None, "text_config": None, "boi_token_index": 200080,
                          "eoi_token_index": 200081, "image_token_index": 200092, "tie_word_embeddings": False},
                         aliases={"image_token_id": "image_token_index", "boi_token_id": "boi_token_index",
                                  "eoi_token_id": "eoi_token_index"},
                         subs={"vision_config": ("llama4_vision_model", False, {}),
                               "text_config": ("llama4_text", False, {})}),
}
