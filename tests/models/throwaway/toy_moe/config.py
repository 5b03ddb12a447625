"""How config.json's ``toy_moe`` text config is read without transformers: DeepSeek-V3's table."""

from mmparity.models.parts.deepseek_v3.config import HF_CONFIGS as DEEPSEEK_V3

HF_CONFIGS = {"toy_moe": DEEPSEEK_V3["deepseek_v3"]}
