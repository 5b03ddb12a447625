"""``mmparity tiny``: a family's built-in tiny HF model with seeded random weights, on disk.

Written as transformers' ``save_pretrained`` writes it (``model.safetensors`` and ``config.json``),
so it is a small real input for ``check --hf``, ``convert`` and ``verify``, and one a bug report can
name by family and seed: the same family and seed give the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

from mmparity.cli.common import EXIT_OK, UsageError, check_seed, human_bytes


def add_arguments(parser) -> None:
    parser.add_argument("family", metavar="FAMILY", help="a registered family (mmparity list)")
    parser.add_argument("dir", metavar="DIR", help="directory to write (must not exist, see --force)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random weights (default 0)")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists")


def run(args) -> int:
    from mmparity.models import registry as families

    records = {fam.name: fam for fam in families.families()}
    names = list(records)
    if args.family not in names:
        raise UsageError(f"FAMILY {args.family!r} is not a registered family; name one of {', '.join(names)} "
                         f"(mmparity list describes them)")
    seed = check_seed(args.seed)
    destination = Path(args.dir)
    if os.path.lexists(destination) and not args.force:
        raise UsageError(f"DIR {args.dir} already exists; pass --force to replace it, or name a new directory")
    if os.path.lexists(destination) and not destination.is_dir():
        raise UsageError(f"DIR {args.dir} is not a directory; --force replaces a directory only, so name another path")

    from mmparity.io.fsio.errors import CheckpointError

    try:
        written = _write(records[args.family], destination, seed, force=args.force)
    except CheckpointError as exc:
        raise UsageError(f"DIR {exc}") from None
    count, size = written
    print(f"wrote tiny {args.family} (seed {seed}): {count} tensors, {human_bytes(size)} to {args.dir}")
    told = _told_family(destination)
    if told != args.family:
        print(f"note: without a family named, check and convert take {args.dir} for {told} (from its "
              f"config.json); name it: mmparity check {args.family} --hf {args.dir}, "
              f"mmparity convert --family {args.family} ...")
    return EXIT_OK


def _told_family(directory: Path) -> str:
    """The family ``check --hf`` and ``convert`` tell from the written config when none is named."""
    from mmparity.models import registry as families
    from mmparity.cli.common import config_facts

    facts = config_facts(directory)
    if facts is None:
        return "no family (config.json unreadable)"
    try:
        return families.detect(facts).family
    except families.DetectError:
        return "no one family"


def _write(fam, destination: Path, seed: int, *, force: bool) -> tuple[int, int]:
    """The tiny reference model, its floating tensors seeded random at a trained network's scale,
    saved into a staging sibling that replaces ``destination`` only once complete."""
    import torch

    from mmparity.models.core.inputs import random_like_state
    from mmparity.io.fsio.publish import atomic_directory, write_extra_files
    from mmparity.io.fsio.safetensors_write import write_safetensors_shards

    cfg = fam.tiny_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # whatever the build initialises and the seeding leaves alone
        model = fam.build_reference(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=seed))
    with atomic_directory(destination, force=force) as staging:
        if hasattr(model, "save_pretrained"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # one summary line is all this command prints
            model.save_pretrained(staging)
        else:  # a reference wrapper around HF modules: its tensors and config, as save_pretrained lays them
            write_safetensors_shards(staging, model.state_dict())
            write_extra_files(staging, {"config.json": cfg.to_json_string()})
        umask = os.umask(0)
        os.umask(umask)
        for path in staging.iterdir():  # some writers create files 0600; these are plain outputs
            path.chmod(0o666 & ~umask)
    from safetensors import safe_open

    files = sorted(p for p in destination.iterdir() if p.suffix == ".safetensors")
    count = 0
    for path in files:
        with safe_open(path, "pt") as handle:
            count += len(handle.keys())
    return count, sum(p.stat().st_size for p in files)
