"""Every input of a conversion is protected from its destination, not only ``--src``.

``convert --to hf --base HF_DIR`` reads the release the checkpoint came from (config, tokenizer,
the tensors Megatron has no place for); ``--hf-config FILE`` reads one config. A destination that
is the base, lies inside it, or holds it (the same for the config file), named directly or through
a symlink, would be replaced by the publish: the conversion refuses it before anything is written,
naming the flag, and every input stays byte for byte as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.test_faults import copy_tree, one_line_error, run_cli, snapshot, sources  # noqa: F401
from tests.faults.test_faults import _as_megatron_wrote_it

pytestmark = pytest.mark.fault


@pytest.fixture
def layout(sources, tmp_path):
    """A Megatron-written checkpoint and, beside it, a writable copy of the release it came from."""
    return (_as_megatron_wrote_it(sources["legacy"], tmp_path / "trained"),
            copy_tree(sources["hf"], tmp_path / "releases" / "hf"))


# how the destination relates to the base directory
DESTINATIONS = {
    "the base itself": lambda base: base,
    "inside the base": lambda base: base / "exported",
    "deeper inside the base": lambda base: base / "a" / "b",
    "holding the base": lambda base: base.parent,
    "the base through a trailing ..": lambda base: base / "x" / "..",
}


@pytest.mark.parametrize("case", sorted(DESTINATIONS))
def test_destination_overlapping_the_base_is_refused(capsys, layout, case):
    trained, base = layout
    before = snapshot(base)
    dst = DESTINATIONS[case](base)
    (base / "x").mkdir()
    code, out, err = run_cli(capsys, "convert", "--src", trained, "--dst", dst, "--base", base, "--to", "hf",
                             "--force", "--quiet")
    line = one_line_error(code, out, err, "--base")
    assert "--dst" in line
    (base / "x").rmdir()
    assert snapshot(base) == before


@pytest.mark.parametrize("link", ["--base is a link to --dst", "--dst's parent is a link into --base"])
def test_overlap_through_a_symlink_is_refused(capsys, layout, tmp_path, link):
    trained, base = layout
    before = snapshot(base)
    if link == "--base is a link to --dst":
        given_base, dst = tmp_path / "base-link", base
        os.symlink(base, given_base)
    else:
        given_base, dst = base, tmp_path / "into-base" / "exported"
        os.symlink(base, tmp_path / "into-base")
    code, out, err = run_cli(capsys, "convert", "--src", trained, "--dst", dst, "--base", given_base, "--to", "hf",
                             "--force", "--quiet")
    one_line_error(code, out, err, "--base", "--dst")
    assert snapshot(base) == before


@pytest.mark.parametrize("case", ["the file's directory", "the file itself", "a directory holding it"])
def test_destination_overlapping_the_hf_config_file_is_refused(capsys, layout, case):
    trained, base = layout
    config = base / "config.json"
    before = snapshot(base)
    dst = {"the file's directory": base, "the file itself": config, "a directory holding it": base.parent}[case]
    code, out, err = run_cli(capsys, "convert", "--src", trained, "--dst", dst, "--hf-config", config, "--to", "hf",
                             "--family", "pixtral", "--force", "--quiet")
    one_line_error(code, out, err, "--hf-config", "--dst")
    assert snapshot(base) == before


def test_a_destination_beside_the_inputs_still_converts(capsys, layout):
    """Inside the config file's directory but not over the file, or beside the base: allowed."""
    trained, base = layout
    config_dir = base.parent / "configs"
    config_dir.mkdir()
    (config_dir / "config.json").write_bytes((base / "config.json").read_bytes())
    code, out, err = run_cli(capsys, "convert", "--src", trained, "--dst", config_dir / "exported",
                             "--hf-config", config_dir / "config.json", "--to", "hf", "--quiet")
    assert code == 0, err
    code, out, err = run_cli(capsys, "convert", "--src", trained, "--dst", base.parent / "beside", "--base", base,
                             "--to", "hf", "--quiet")
    assert code == 0, err
