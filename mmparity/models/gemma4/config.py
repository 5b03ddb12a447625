"""transformers' ``Gemma4Config`` as config.json is read without transformers: the whole model's
fields and its two sub-configs (the tower's and the decoder's tables are their packages'). The
audio config is kept as the file has it: no audio is converted or checked."""

from __future__ import annotations

from mmparity.config import ConfigType

HF_CONFIGS = {
    "gemma4": ConfigType({"text_config": None, "vision_config": None, "audio_config": None, "boi_token_id": 255_999,
                          "eoi_token_id": 258_882, "image_token_id": 258_880, "video_token_id": 258_884,
                          "boa_token_id": 256_000, "eoa_token_index": 258_883, "audio_token_id": 258_881,
                          "initializer_range": 0.02, "tie_word_embeddings": True},
                         subs={"vision_config": ("gemma4_vision", False, None),
                               "text_config": ("gemma4_text", False, {})}),
}
