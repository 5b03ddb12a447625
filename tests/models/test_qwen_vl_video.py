"""Video input for the whole Qwen-VL models: a batch with a short clip (several temporal patches of
real, distinct frames, an awkward size) beside images of different sizes, checked as the image
batch is (same harness, same report, the case named ``video``); M-RoPE positions for the clip
against transformers' own ``get_rope_index``; negative controls only a video path can catch, each
failing the video case alone and located by part."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.qwen3_vl_whole import cases as whole_cases
from mmparity.models.qwen3_vl_whole import native as whole_native
from mmparity.parity import harness

FAMILIES = ["qwen2_5_vl_whole", "qwen3_vl_whole", "qwen3_vl_moe", "qwen3_5_whole"]


def _video_case(family: str, seed: int = 4):
    fam = families.get(family)
    cfg = fam.tiny_config()
    by_name = {case.name: case for case in fam.hooks.parity.cases(cfg, seed)}
    return fam, cfg, by_name["video"]


def _native_class(family: str):
    from mmparity.models.qwen2_5_vl_whole.native import Qwen25VLModel

    return Qwen25VLModel if family == "qwen2_5_vl_whole" else whole_native.Qwen3VLModel


@pytest.mark.parametrize("family", FAMILIES)
def test_the_video_case_is_a_real_clip_beside_images(family):
    _, cfg, case = _video_case(family)
    (clip,), ((t, height, width),) = case.data["videos"], case.data["video_sizes"]
    frames = case.data["temporal"]
    assert t > 1 and clip.shape[0] == t * frames > 2
    assert clip.shape[-2:] == (height, width) and height != width
    # Distinct frames: a temporal patch is not a still image repeated.
    assert all(not torch.equal(clip[k], clip[k + 1]) for k in range(clip.shape[0] - 1))
    ids = case.data["input_ids"]
    rows_with_video = (ids == cfg.video_token_id).any(1).tolist()
    rows_with_images = (ids == cfg.image_token_id).sum(1).tolist()
    assert rows_with_video == [True, False] and rows_with_images[1] > 0
    assert len({tuple(s) for s in case.data["sizes"]}) == len(case.data["sizes"]) > 1
    rows, grid_thw = whole_cases.video_rows(case)
    p, m = case.data["patch"], case.data["merge"]
    assert grid_thw.tolist() == [[t, height // p, width // p]]
    assert rows.shape == (t * (height // p) * (width // p), cfg.vision_config.in_channels * frames * p * p)
    assert int((ids == cfg.video_token_id).sum()) == t * (height // p // m) * (width // p // m)


@pytest.mark.parametrize("family", FAMILIES)
def test_video_positions_are_transformers_get_rope_index(family):
    fam, cfg, case = _video_case(family)
    model = fam.build_reference(cfg)
    ids = case.data["input_ids"]
    p = case.data["patch"]
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    image_thw = torch.tensor([[1, h // p, w // p] for h, w in case.data["sizes"]])
    _, video_thw = whole_cases.video_rows(case)
    extra = {}
    if "video_seconds" in case.data:
        extra["second_per_grid_ts"] = torch.tensor(case.data["video_seconds"], dtype=torch.float32)
    expected, _ = model.model.get_rope_index(ids, types, image_grid_thw=image_thw,
                                             video_grid_thw=video_thw.clone(), **extra)
    owner = _native_class(family)
    runs, steps = whole_native.video_runs([tuple(g) for g in video_thw.tolist()], case.data.get("video_seconds"),
                                          frames_apart=owner.frames_apart,
                                          tokens_per_second=cfg.vision_config.tokens_per_second
                                          if hasattr(cfg.vision_config, "tokens_per_second") else 1)
    grids = [(h // p, w // p) for h, w in case.data["sizes"]]
    got = whole_native.mrope_position_ids(ids, cfg.image_token_id, grids, case.data["merge"],
                                          video_token_id=cfg.video_token_id, video_grids=runs, intervals=steps)
    assert torch.equal(got, expected)
    video = ids[0] == cfg.video_token_id
    temporal = got[0, 0][video].unique()
    if owner.frames_apart:
        # Each temporal patch its own run after its timestamp text: later frames start later.
        assert temporal.numel() == video_thw[0, 0]
    else:
        # One run whose temporal positions step by tokens_per_second x seconds, truncated:
        # 4 x 0.7 = 2.8 -> 0, 2, 5 past the start, unequal steps.
        steps_seen = (temporal - temporal[0]).tolist()
        assert steps_seen == [int(k * 2.8) for k in range(video_thw[0, 0])] and len(set(torch.diff(temporal).tolist())) > 1
        # transformers continues the text after the clip at its start + the larger merged side,
        # not past its temporal extent: the vision end token sits below the clip's last frame.
        end = int(video.nonzero().max()) + 1
        assert got[0, 0, end] < temporal.max()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_video_case_passes_with_the_tower_compared_on_the_clip(family):
    report = harness.check(family, seed=2)
    video = [r for r in report.results if r.check.startswith("video:")]
    moe = {"video:router"} if family in ("qwen3_vl_moe", "qwen3_5_whole") else set()
    assert report.passed and {r.check for r in video} == {"video:logits", "video:token_loss"} | moe
    compared = {row["module"] for row in video[0].modules}
    assert "vision_model.patch_embed" in compared and "language_model.decoder.layers.0.self_attention" in compared
    if family in ("qwen3_vl_moe", "qwen3_5_whole"):
        # Router agreement per MoE layer on the video batch's tokens too.
        routers = [row for row in video[0].modules if row["module"].endswith(".router")]
        assert routers and all(row["passed"] for row in routers)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_video_case_within_policy(family):
    report = harness.check(family, dtype="bfloat16", seed=3)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]
    assert any(r.check.startswith("video:") for r in report.results)


def _failing(report) -> dict:
    """The failing outputs' first divergences; a MoE family's router check, failing downstream
    of the change, names the same module."""
    failing = {r.check: r.first_divergence.module for r in report.failures()}
    routed = failing.pop("video:router", None)
    assert routed in (None, failing.get("video:logits")), (routed, failing)
    return failing


@pytest.mark.parametrize("family", FAMILIES)
def test_frames_swapped_in_the_native_model_only_fail_at_the_patch_embedding(family, monkeypatch):
    """Each temporal patch's frames reversed on their way into the native tower: a still image
    (its frame repeated) cannot show it; the clip's real frames do, at the tower's first module."""
    owner = _native_class(family)
    vision = owner._vision
    vc = families.get(family).tiny_config().vision_config
    channels, frames = vc.in_channels, vc.temporal_patch_size

    def swapped(self, batch_major, mask, rows, sizes, what):
        if what == "video":
            shaped = rows.reshape(*rows.shape[:-1], channels, frames, -1)
            rows = shaped.flip(-2).reshape(rows.shape)
        return vision(self, batch_major, mask, rows, sizes, what)

    monkeypatch.setattr(owner, "_vision", swapped)
    report = harness.check(family, seed=2)
    assert _failing(report) == {"video:logits": "vision_model.patch_embed",
                                "video:token_loss": "vision_model.patch_embed"}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f == "qwen2_5_vl_whole"])
def test_temporal_step_perturbed_fails_at_the_first_attention(family, monkeypatch):
    """The clip's temporal position step one token-per-second off in the native model only: the
    tower agrees, the first module reading positions (layer 0's attention) departs, on the video
    case alone."""
    owner = _native_class(family)
    monkeypatch.setattr(owner, "video_positions", lambda self, grids, seconds: whole_native.video_runs(
        grids, seconds, frames_apart=False, tokens_per_second=self.tokens_per_second + 1))
    report = harness.check(family, seed=2)
    assert _failing(report) == {"video:logits": "language_model.decoder.layers.0.self_attention",
                                "video:token_loss": "language_model.decoder.layers.0.self_attention"}


@pytest.mark.parametrize("family", ["qwen3_vl_whole", "qwen3_vl_moe"])
def test_deepstack_features_left_off_the_video_tokens_fail_after_the_first_layer(family, monkeypatch):
    """The DeepStack features added at the image tokens only, in the native model: the image case
    agrees; the video case departs where the first feature is read (layer 1's input norm), the
    tower and layer 0 agreeing."""
    owner = _native_class(family)
    joint = owner._joint

    def images_only(deep_images, deep_videos, image, video):
        dropped = [torch.zeros_like(feature) for feature in deep_videos]
        return joint(deep_images, dropped, image, video)

    monkeypatch.setattr(owner, "_joint", staticmethod(images_only))
    report = harness.check(family, seed=2)
    assert _failing(report) == {"video:logits": "language_model.decoder.layers.1.input_layernorm",
                                "video:token_loss": "language_model.decoder.layers.1.input_layernorm"}


def _layout_ids(cfg, script, frames_apart: bool, gen):
    """Rows of ids from ``script``: per row, items ``("text", n)``, ``("image", gh, gw)`` or
    ``("video", t, gh, gw)`` in merged patches; with ``frames_apart`` a clip's temporal patches are
    each a run after two timestamp tokens. -> (ids, image grids, video grids), grids in patches."""
    m = cfg.vision_config.spatial_merge_size
    text = lambda n: torch.randint(0, 90, (n,), generator=gen).tolist()  # noqa: E731 (below 93: no special ids)
    rows, images, videos = [], [], []
    for items in script:
        row = []
        for kind, *shape in items:
            if kind == "text":
                row += text(shape[0])
            elif kind == "image":
                gh, gw = shape
                images.append([1, gh * m, gw * m])
                row += [cfg.vision_start_token_id] + [cfg.image_token_id] * (gh * gw) + [cfg.vision_end_token_id]
            else:
                t, gh, gw = shape
                videos.append([t, gh * m, gw * m])
                if frames_apart:
                    for _ in range(t):
                        row += text(2) + [cfg.vision_start_token_id] + [cfg.video_token_id] * (gh * gw) + [cfg.vision_end_token_id]
                else:
                    row += [cfg.vision_start_token_id] + [cfg.video_token_id] * (t * gh * gw) + [cfg.vision_end_token_id]
        rows.append(row)
    width = max(len(r) for r in rows)
    return torch.tensor([r + text(width - len(r)) for r in rows]), images, videos


@pytest.mark.parametrize("family, tokens_per_second, seconds", [
    ("qwen2_5_vl_whole", 4, [0.35, 1.3, 0.9]), ("qwen2_5_vl_whole", 7, [0.5, 0.25, 2.0]),
    ("qwen2_5_vl_whole", 3, [1.4, 1.8, 0.9]), ("qwen2_5_vl_whole", 3, None), ("qwen3_vl_whole", 4, None)])
def test_several_clips_of_several_lengths_are_positioned_as_transformers_does(family, tokens_per_second, seconds):
    """Three clips (6, 1 and 3 temporal patches, awkward grids) and images in two rows, against
    transformers' ``get_rope_index`` with its own clip spacing. At 3 tokens per second, 1.4 s per
    temporal patch puts the sixth at 21 in fp32 (transformers' precision) but 20 in fp64."""
    fam = families.get(family)
    cfg = fam.tiny_config()
    model = fam.build_reference(cfg)
    if hasattr(cfg.vision_config, "tokens_per_second"):
        model.config.vision_config.tokens_per_second = tokens_per_second
    owner = _native_class(family)
    script = [[("text", 2), ("video", 6, 2, 3), ("text", 1), ("image", 1, 2), ("video", 1, 3, 1), ("text", 2)],
              [("image", 2, 2), ("text", 3), ("video", 3, 1, 1), ("text", 1)]]
    ids, images, videos = _layout_ids(cfg, script, owner.frames_apart, torch.Generator().manual_seed(len(script[0])))
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    extra = {} if seconds is None else {"second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}
    expected, _ = model.model.get_rope_index(ids, types, image_grid_thw=torch.tensor(images),
                                             video_grid_thw=torch.tensor(videos), **extra)
    runs, steps = whole_native.video_runs([tuple(v) for v in videos], seconds, frames_apart=owner.frames_apart,
                                          tokens_per_second=tokens_per_second)
    got = whole_native.mrope_position_ids(ids, cfg.image_token_id, [(h, w) for _, h, w in images],
                                          cfg.vision_config.spatial_merge_size, video_token_id=cfg.video_token_id,
                                          video_grids=runs, intervals=steps)
    assert torch.equal(got, expected)
