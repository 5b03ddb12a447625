"""Key tables: CLIP's, without the LLaVA-tower role (CLIP itself holds that for its model type)."""

import dataclasses

from mmparity.models.clip import mapping as clip

SPEC = dataclasses.replace(clip.SPEC, tower=None)
