"""What `mmparity convert` writes loads strictly into Megatron's own classes (issue 15).

The stock classes of the installed megatron-core (``CLIPViTModel`` for clip and siglip,
``LLaVAModel`` for llava), built by ``mmparity.upstream.models`` as a Megatron-LM user would build
them, receive the legacy rank files (``load_state_dict`` per rank) and the torch_dist checkpoint
(``dist_checkpointing.load`` against the class's own ``sharded_state_dict()``) at TP 1 and TP 2
(spawned gloo ranks). Nothing may be unexpected, missing (but TE's ``_extra_state``, which carries
no weights and which mmparity does not write) or mis-shaped, and what was loaded must be the converted tensors themselves. What the
class has no place for is in the side file, never in the state dict.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlavaConfig

from mmparity import families, runtime
from mmparity.checkpoint import read_manifest
from mmparity.checkpoint.legacy import load_rank_file
from mmparity.checkpoint.fsio import load_safetensors_state_dict
from mmparity.checkpoint.streaming import SIDE_FILE
from mmparity.checkpoint.torch_dist import load_torch_dist
from mmparity.cli.main import main
from mmparity.converters.rules import side_keys
from mmparity.upstream import models
from tests.test_convert_roundtrips import save_hf

STOCK = ("clip", "siglip", "llava")


def llava_clip_config():
    """LLaVA on the CLIP tiny tower (stock megatron-core's LLaVAModel builds CLIP-like towers
    only): penultimate-layer features, class token dropped, the llava tiny text model."""
    base = families.get("llava").tiny_config()
    return LlavaConfig(vision_config=families.get("clip").tiny_config(), text_config=base.text_config,
                       image_token_index=base.image_token_index, projector_hidden_act="gelu",
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       multimodal_projector_bias=True, tie_word_embeddings=False)


def config_for(family: str):
    return llava_clip_config() if family == "llava" else families.get(family).tiny_config()


def _load_strictly(model: torch.nn.Module, state: dict) -> dict:
    """Loads ``state``; returns the problems a strict load would have (none but missing
    ``_extra_state``) and the keys loaded."""
    result = model.load_state_dict(state, strict=False)
    return {"missing": [k for k in result.missing_keys if not k.endswith("._extra_state")],
            "unexpected": list(result.unexpected_keys)}


def _rank(rank: int, world: int, family: str, fmt: str, path: str, hf_dir: str) -> dict:
    runtime.init_parallel(world, 1)
    try:
        cfg = config_for(family)
        model = models.build(family, cfg)
        if fmt == "legacy":
            state = load_rank_file(Path(path) / "iter_0000001" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
        else:
            # TE's `_extra_state` objects carry no weights and are not written (as in the legacy
            # files): everything else of the class's own sharded state dict must be found.
            wanted = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("._extra_state")}
            state = load_torch_dist(path, wanted)
        problems = _load_strictly(model, state)
        # The weights are the converter's for this TP size (torch_dist's vocabulary, padded as for
        # TP 1, is re-padded by Megatron's own load), not whatever the class was initialised with.
        expected = families.get(family).hf_to_mcore(load_safetensors_state_dict(hf_dir), cfg, tp_size=world)
        loaded = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        differ = [k for k, v in expected[rank].items() if not torch.equal(loaded[k], v)]
        return {**problems, "differ": differ, "keys": sorted(expected[rank])}
    finally:
        runtime.teardown_parallel()


def _hf_dir(family: str, path: Path) -> Path:
    return save_hf(family, path, seed=3, cfg=config_for(family))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: _hf_dir(f, root / f) for f in STOCK}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", STOCK)
def test_convert_output_loads_strictly_into_megatron(family, fmt, tp, hf_dirs, tmp_path):
    dst = tmp_path / "mcore"
    assert main(["convert", "--family", family, "--src", str(hf_dirs[family]), "--dst", str(dst),
                 "--to", "mcore", "--format", fmt, "--tp", str(tp), "--quiet"]) == 0
    if tp == 1:
        results = [_rank(0, 1, family, fmt, str(dst), str(hf_dirs[family]))]
    else:
        results = runtime.spawn(_rank, tp, family, fmt, str(dst), str(hf_dirs[family]))
    for rank, result in enumerate(results):
        assert result["missing"] == [] and result["unexpected"] == [], (family, fmt, tp, rank, result)
        assert result["differ"] == [] and result["keys"], (family, fmt, tp, rank)
    side = {r.key for r in read_manifest(dst).tensors if r.file == SIDE_FILE}
    assert side == set(side_keys(families.get(family).rule_set(config_for(family))))
