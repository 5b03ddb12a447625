"""Benchmark: `mmparity convert` on a real-size checkpoint against two baselines (not a test).

The checkpoint is the Qwen3.5 vision tower at its published size (depth 27, hidden 1152, 16 heads,
intermediate 4304, patch 16, temporal patch 2, out_hidden_size 2048 = the language model width of
Qwen3.5-35B-A3B), synthetic bf16 weights, written as a sharded HF `save_pretrained` layout. Every
measured job runs in a fresh child process (so imports and earlier jobs do not blur memory), and the
parent samples the child's RssAnon from /proc every few milliseconds: anonymous memory only, not the
page cache that reading and writing a checkpoint necessarily goes through.

Jobs, all reading the same (warm) source bytes:

* `copy`: a plain copy of the source files, fsynced (the baseline of the wall-time target);
* `copy_writeback`: the same bytes copied with the converters' own I/O (`copy_file_range`, and
  writeback started every 64 MB by `fsio.syscalls.start_writeback`): the floor on this disk, against which
  the converters' own overhead shows (column `x floor`);
* `transformers`: `from_pretrained` + `state_dict()` + `save_file`, fsynced (what people do today);
* `hf -> legacy tp1 / tp2`, `hf -> torch_dist tp1 / tp2`, and back `legacy tp2 -> hf`,
  `torch_dist -> hf`, through `mmparity.convert.convert` (atomic, fsynced, checksummed).

On a machine whose disk or memory speed drifts (shared, virtual), single runs are noise: jobs run
in rounds, `--repeat` times, and `--paired` times the plain copy right before every job run so that
each run is judged against the copy made in the same state (column `x the copy just before`).
The copy's wait in fsync, once its bytes are in the page cache, is printed beside its speed: where
it is most of the copy, the disk sets the pace of every job, and the ratios say more about the disk
than about the jobs.

Usage: python benchmarks/convert_throughput.py [--workdir DIR] [--depth 27] [--repeat 2] [--settle 3] [--max-shard-size 500MB] [--keep] [--paired] [--against SCRIPT PYTHONPATH]
       [--workers P] [--perf]
       [--log FILE]
Numbers go to benchmarks/RESULTS.md; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN35_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                     patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                     num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (a job's ranks), as the kernel lists them now."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/task/{current}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        found += children
        todo += children
    return found


def _is_perf(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "perf"
    except OSError:
        return False


def _rss_anon_kb(pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------------------------------
# child jobs (run as `python benchmarks/convert_throughput.py --child JOB ...`)


def _fsync_tree(root: Path) -> None:
    for current, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(Path(current) / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


_TIMED_CPU = [0.0]  # this process's CPU seconds when its timed region began


def _cpu_seconds() -> float:
    """User + system CPU of this process so far (every thread: the writers' pwrite and hashing too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child(job: str, src: str, dst: str, extra: list[str]) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    phases = {}
    if job == "copy":
        ready = _rss_anon_kb()
        _TIMED_CPU[0] = _cpu_seconds()
        started = time.perf_counter()
        Path(dst).mkdir()
        for path in sorted(Path(src).iterdir()):
            shutil.copyfile(path, Path(dst) / path.name)
        phases["into_page_cache"] = time.perf_counter() - started
        _fsync_tree(Path(dst))
    elif job == "copy_writeback":
        from mmparity.io.fsio.syscalls import copy_file_range_all, start_writeback

        ready = _rss_anon_kb()
        _TIMED_CPU[0] = _cpu_seconds()
        started = time.perf_counter()
        Path(dst).mkdir()
        chunk = 64 << 20
        for path in sorted(Path(src).iterdir()):
            size = path.stat().st_size
            source = os.open(path, os.O_RDONLY)
            target = os.open(Path(dst) / path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            for offset in range(0, size, chunk):
                count = min(chunk, size - offset)
                copy_file_range_all(source, offset, target, offset, count)
                start_writeback(target, offset, count)
            os.fsync(target)
            os.close(target)
            os.close(source)
    elif job == "transformers":
        import torch
        from safetensors.torch import save_file
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        ready = _rss_anon_kb()
        _TIMED_CPU[0] = _cpu_seconds()
        started = time.perf_counter()
        model = Qwen3_5MoeVisionModel.from_pretrained(src, dtype=torch.bfloat16)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        Path(dst).mkdir()
        save_file(state, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
        _fsync_tree(Path(dst))
    elif job == "convert":
        options = json.loads(extra[0])
        workers = options.pop("workers", 1)
        if workers > 1:  # this process only starts and times the ranks: it imports nothing
            ready = _rss_anon_kb()
            seconds, phases, cpu = _run_ranks(workers, src, dst, options)
            return {"seconds": seconds, "ready_anon_kb": ready, "phases": phases, "cpu_s": cpu}
        import torch  # noqa: F401  (import cost outside the timed region, as for the others)

        from mmparity.convert import ConvertOptions, convert

        by_phase = options.pop("memory_phases", False)
        profile = options.pop("perf", None)
        _import_for(options)
        ready = _rss_anon_kb()
        progress = _PhaseMemory(ready) if by_phase else None
        recorder = _start_perf(profile) if profile else None
        _TIMED_CPU[0] = _cpu_seconds()
        started = time.perf_counter()
        try:
            convert(ConvertOptions(src=Path(src), dst=Path(dst), **options), progress)
        finally:
            if progress is not None:
                phases = progress.stop()
            if recorder is not None:
                _stop_perf(recorder)
    else:
        raise SystemExit(f"unknown job {job}")
    seconds = time.perf_counter() - started
    # The CPU of the timed region, every thread included (the plain copy runs in this process too).
    return {"seconds": seconds, "ready_anon_kb": ready, "phases": phases, "cpu_s": _cpu_seconds() - _TIMED_CPU[0]}


class _PhaseMemory:
    """A `convert()` progress (the pipeline's public hook) that samples this process's RssAnon
    every 2 ms and keeps its peak per phase, in kB above `ready` (the process before `convert`):

    * ``setup``: up to the first tensor: opening the source, the plan, the writer's layout;
    * ``streaming``: from the first tensor to the last the writer announced;
    * ``finish``: after the last one: closing files, the manifest, `.metadata`, the publish.

    Where a conversion's memory grows with the checkpoint, this says in which part. Only with
    `--phases` (convert_memory.py): the sampling thread costs a little CPU.
    """

    def __init__(self, ready_kb: int | None):
        self.ready = ready_kb or 0
        self.phase_name, self.expected, self.done = "setup", None, 0
        self.peaks = {"setup": 0, "streaming": 0, "finish": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            value = (_rss_anon_kb() or 0) - self.ready
            self.peaks[self.phase_name] = max(self.peaks[self.phase_name], value)
            time.sleep(0.002)

    def phase(self, description: str, tensors: int | None = None, nbytes: int | None = None,
              unit: str = "tensors") -> None:
        self.expected = tensors

    def advance(self, tensors: int = 0, nbytes: int = 0) -> None:
        if self.phase_name == "setup" and tensors:
            self.phase_name = "streaming"
        self.done += tensors
        if self.expected is not None and self.done >= self.expected:
            self.phase_name = "finish"

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {f"peak_above_start_kb_{name}": kb for name, kb in self.peaks.items()}


def _start_perf(path: str) -> subprocess.Popen:
    """Linux `perf record` of this process (every thread), from now until `_stop_perf`: the timed
    region only, not the imports. Sampled without call graphs, so it costs the job little."""
    recorder = subprocess.Popen(["perf", "record", "-q", "-F", "499", "-p", str(os.getpid()), "-o", path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while not Path(path).exists() and recorder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # attached to every thread before the work starts
    return recorder


def _stop_perf(recorder: subprocess.Popen) -> None:
    import signal

    if recorder.poll() is None:
        recorder.send_signal(signal.SIGINT)
    try:
        recorder.wait(timeout=60)  # perf writes its file on SIGINT; one that does not is not waited on
    except subprocess.TimeoutExpired:
        recorder.kill()
        recorder.wait()


# Where a conversion's CPU goes, by the symbol a sample fell in (`perf report --sort dso,sym`).
# Tested in this order; the first that matches takes the sample.
_CPU_KINDS = (
    ("kernel copy", lambda dso, sym: dso == "kernel" and any(w in sym for w in ("memcpy", "memmove", "copy_user", "copy_page", "movs"))),
    ("page zeroing", lambda dso, sym: dso == "kernel" and any(w in sym for w in ("memset", "clear_page"))),
    ("lock spin", lambda dso, sym: dso == "kernel" and any(w in sym for w in ("spin_on_owner", "osq_lock", "queued_spin_lock_slowpath", "down_write_slowpath"))),
    ("other kernel", lambda dso, sym: dso == "kernel"),
    ("hashing", lambda dso, sym: "xxhash" in dso or "XXH" in sym),
    ("Python", lambda dso, sym: "libpython" in dso or dso.startswith("python")),
    ("torch", lambda dso, sym: "torch" in dso or "c10" in dso),
    ("other", lambda dso, sym: True),
)


def _cpu_kinds(path: Path) -> dict | None:
    """Shares of a `perf record` file's samples by `_CPU_KINDS` (percent), and their count; None
    where perf cannot read it. Without root (and `kernel.perf_event_paranoid` above 1) perf sees
    user space only: the kernel's part then reads 0 and the report says so."""
    try:
        report = subprocess.run(["perf", "report", "-i", str(path), "--stdio", "--no-children", "-g", "none",
                                 "--sort", "dso,sym"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    shares = {name: 0.0 for name, _ in _CPU_KINDS}
    samples = None
    for line in report.stdout.splitlines():
        if line.startswith("# Samples:"):
            samples = line.split(":", 1)[1].split()[0]
        fields = line.split()
        if len(fields) < 4 or not fields[0].endswith("%") or fields[0].startswith("#"):
            continue
        dso = "kernel" if fields[1] == "[kernel.kallsyms]" else fields[1]
        sym = fields[-1]
        for name, matches in _CPU_KINDS:
            if matches(dso, sym):
                shares[name] += float(fields[0].rstrip("%"))
                break
    return {"samples": samples, **shares} if samples else None


def _import_for(options: dict) -> None:
    """Imports outside the timed region, as for the baselines: they are per process, not per byte."""
    from mmparity.models import registry as families

    families.get("qwen3_5").hooks  # loads the reference and native modules with the family
    # Every family's config module: a conversion reads the source's config with them before it
    # knows the family (32 modules; 23 ms where Python writes no bytecode cache, as on the VM).
    families.config_modules()
    if options.get("format") == "torch_dist" and options["to"] == "mcore":
        import mmparity.io.torch_dist_write  # noqa: F401  (imports no megatron)


def _run_ranks(workers: int, src: str, dst: str, options: dict) -> tuple[float, dict, float]:  # (seconds, phases, CPU s)
    """One conversion by ``workers`` ranks as torchrun starts them (RANK, WORLD_SIZE, MASTER_*),
    each a fresh interpreter. Timed as the one-process job is: from when every rank has its imports
    done (interpreter start-up is per process, not per byte) until the last rank has finished, so the
    ranks' meeting, their share of the work and rank 0's publish are all in it."""
    from mmparity.parallel.runtime import LAUNCHER_VARIABLES, free_port

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", src, dst, json.dumps(options)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for r in range(workers)]
    try:
        for rank in ranks:
            if rank.stdout.readline().strip() != "ready":
                raise SystemExit("a rank failed before its conversion started")
        started = time.perf_counter()
        for rank in ranks:
            rank.stdin.write("go\n")
            rank.stdin.flush()
        reports = [json.loads(rank.stdout.readline() or "null") for rank in ranks]
        # Timed to the last rank's report, not its exit: a one-process job's interpreter tear-down
        # is not timed either.
        finished = time.perf_counter()
        codes = [rank.wait() for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    if codes != [0] * workers or None in reports:
        raise SystemExit(f"ranks exited {codes}")
    return (finished - started, {f"rank{r}_convert": report["seconds"] for r, report in enumerate(reports)},
            sum(report["cpu_s"] for report in reports))


def _rank(src: str, dst: str, options: dict) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from mmparity.io import team as team_mod
    from mmparity.convert import ConvertOptions, convert

    _import_for(options)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu = _cpu_seconds()
    started = time.perf_counter()
    team = team_mod.join()
    try:
        convert(ConvertOptions(src=Path(src), dst=Path(dst), team=team, **options))
    finally:
        team.close()
    print(json.dumps({"seconds": time.perf_counter() - started, "cpu_s": _cpu_seconds() - cpu}), flush=True)


# --------------------------------------------------------------------------------------------------
# parent


def _warm(root: Path) -> None:
    """Reads a job's source into the page cache: every job is timed from warm source bytes, as the
    copy is. Once the benchmark's working set outgrows the page cache, a job whose source had been
    pushed out would otherwise pay for reading it back from the disk (up to 3x its wall time)."""
    buffer = bytearray(64 << 20)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _settle(seconds: float) -> None:
    """Lets the disk finish what earlier runs left it (writeback, and the discards a deleted output
    issues on a filesystem mounted with `discard`) so that no run pays for the one before it: on
    such a disk, at 1.7 GB, the same job otherwise swung between 1.2 s and 4.6 s, the plain copy
    too. Three seconds also outlast the 2 s after which a VM with free page reporting hands freed
    memory (a deleted output's page cache) back to its host, which makes writing into it again
    cost up to twice the kernel time: with a shorter pause a run may or may not pay that, and the
    copy paired with it may pay differently."""
    os.sync()
    time.sleep(seconds)


def _steal_ticks() -> int:
    """Clock ticks of CPU steal: time a virtual CPU wanted to run and was not given (0 on bare
    metal). A run slowed by steal is the machine's, not the job's."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def _schedstat(pid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) of a process so far."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return None


def _measure(job: str, src: Path, dst: Path, *extra: str, tree: tuple | None = None) -> dict:
    """Runs one child job; returns its timing, the peak RssAnon seen while it ran, and where its
    time went (the child's CPU and fault counts, its wait for a CPU, the system's CPU steal), which is
    what tells a stalled run from a slow one. ``tree``: (script, PYTHONPATH) of another checkout
    whose own benchmark script runs the job instead."""
    script, env = __file__, None
    if tree is not None:
        script, env = tree[0], {**os.environ, "PYTHONPATH": tree[1]}
    command = [sys.executable, script, "--child", job, str(src), str(dst), *extra]
    usage_before, steal_before = resource.getrusage(resource.RUSAGE_CHILDREN), _steal_ticks()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0]
    sched = [None]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            # A job of several ranks holds the memory of all of them at once; `--perf`'s recorder
            # is the job's child too, but not the job's memory.
            values = [_rss_anon_kb(p) for p in (proc.pid, *_descendants(proc.pid)) if not _is_perf(p)]
            value = sum(v for v in values if v is not None)
            if values[0] is not None:
                peak[0] = max(peak[0], value)
            sched[0] = _schedstat(proc.pid) or sched[0]
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed ({proc.returncode}):\n{err[-3000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_anon_kb"] = peak[0]
    # Whole child process, imports included: for comparing runs of one job, not jobs.
    result["child"] = {
        "user_s": usage.ru_utime - usage_before.ru_utime, "system_s": usage.ru_stime - usage_before.ru_stime,
        "minor_faults": usage.ru_minflt - usage_before.ru_minflt, "major_faults": usage.ru_majflt - usage_before.ru_majflt,
        "waits": usage.ru_nvcsw - usage_before.ru_nvcsw, "preempted": usage.ru_nivcsw - usage_before.ru_nivcsw,
        "cpu_wait_s": sched[0][1] / 1e9 if sched[0] else None,
        "cpu_steal_s": (_steal_ticks() - steal_before) / os.sysconf("SC_CLK_TCK")}
    return result


def _make_source(path: Path, max_shard_size: str, depth: int) -> int:
    """Synthetic bf16 Qwen3.5 vision tower in HF layout, written tensor by tensor (never all in RAM)."""
    import torch
    from transformers import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    from mmparity.io.fsio.safetensors_write import StreamingSafetensorsWriter

    cfg = Qwen3_5MoeVisionConfig(**{**QWEN35_VISION, "depth": depth})
    cfg.architectures = ["Qwen3_5MoeVisionModel"]
    cfg.dtype = "bfloat16"
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3_5MoeVisionModel(cfg).state_dict().items()}
    path.mkdir(parents=True)
    entries = [(k, torch.bfloat16, s) for k, s in shapes.items()]
    writer = StreamingSafetensorsWriter(path, entries, max_shard_size=max_shard_size)
    generator = torch.Generator().manual_seed(0)
    for name, _, shape in entries:
        writer.write(name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
    writer.close()
    cfg.save_pretrained(path)
    return writer.total_bytes


def _same_tensors(a: Path, b: Path, left_out: tuple = ()) -> bool:
    """Whether ``b`` holds ``a``'s tensors, bit for bit, but those under the ``left_out`` prefixes
    (what the conversion leaves out of a release, and says so)."""
    import torch

    from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint

    with SafetensorsCheckpoint(a) as x, SafetensorsCheckpoint(b) as y:
        kept = {k for k in x.keys() if not k.startswith(left_out)} if left_out else set(x.keys())
        if kept != set(y.keys()):
            return False
        return all(torch.equal(x.get(k), y.get(k)) and x.info(k).dtype == y.info(k).dtype for k in kept)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--max-shard-size", default="500MB",
                        help="source shard size; the tower is ~0.9 GB, so 500MB makes it a sharded checkpoint")
    parser.add_argument("--keep", action="store_true",
                        help="keep the checkpoints the jobs wrote (the source in a --workdir is kept either way)")
    parser.add_argument("--depth", type=int, default=QWEN35_VISION["depth"],
                        help="tower depth; the published 27, or more to see that memory does not grow")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds to wait after a sync before every run (see _settle)")
    parser.add_argument("--paired", action="store_true",
                        help="also run the plain copy right before every job run and report the job's "
                             "time over that copy's (for disks whose speed drifts within a round)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per job, in rounds; the table shows the fastest run and the highest "
                             "peak. On a shared or virtual machine one run is noisy: use several, with --paired")
    parser.add_argument("--against", nargs=2, metavar=("SCRIPT", "PYTHONPATH"), default=None,
                        help="also run every conversion job with another checkout (its own benchmark "
                             "script, its tree on PYTHONPATH) in the same rounds, each run paired with "
                             "its own copy, the two trees' order alternating round by round: a before/after "
                             "comparison in which a disk stall cannot fall on one tree only")
    parser.add_argument("--workers", type=int, default=1, metavar="P",
                        help="also run four conversions by P processes (ranks as torchrun starts them; each "
                             "job's output has at least P files), paired with their own copy like the rest")
    parser.add_argument("--perf", action="store_true",
                        help="profile every one-process conversion's timed region with Linux perf and print "
                             "where its CPU went (kernel copy, page zeroing, lock spin, hashing, Python, torch); "
                             "the kernel's share needs root or kernel.perf_event_paranoid <= 1")
    parser.add_argument("--log", default=None,
                        help="append every run (and its paired copy) as a JSON line: wall, phases, the "
                             "child's CPU, faults and wait for a CPU, the system's CPU steal")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mmparity-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"hf-depth{args.depth}"
    log = None
    written: list[Path] = []
    try:
        if not src.exists():
            print("writing the synthetic source checkpoint ...", file=sys.stderr)
            _make_source(src, args.max_shard_size, args.depth)
        source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        files = sorted(p.name for p in src.iterdir())
        print(f"source: {src} ({source_bytes / 1e9:.3f} GB in {', '.join(files)})", file=sys.stderr)

        jobs = [
            ("copy (baseline)", "copy", src, work / "copy", None),
            ("copy, writeback started as it goes (reference)", "copy_writeback", src, work / "copy_wb", None),
            ("transformers from_pretrained+save_file (baseline)", "transformers", src, work / "tf", None),
            ("hf -> legacy tp1", "convert", src, work / "legacy1", dict(to="mcore", family="qwen3_5", format="legacy")),
            ("hf -> legacy tp2", "convert", src, work / "legacy2", dict(to="mcore", family="qwen3_5", format="legacy", tp=2)),
            ("hf -> torch_dist tp1", "convert", src, work / "dist1", dict(to="mcore", family="qwen3_5", format="torch_dist")),
            ("hf -> torch_dist tp2", "convert", src, work / "dist2", dict(to="mcore", family="qwen3_5", format="torch_dist", tp=2)),
            ("legacy tp2 -> hf", "convert", work / "legacy2", work / "back_legacy", dict(to="hf", max_shard_size=args.max_shard_size)),
            ("torch_dist -> hf", "convert", work / "dist1", work / "back_dist", dict(to="hf", max_shard_size=args.max_shard_size)),
        ]
        if args.workers > 1:
            p = args.workers
            # Output units are whole files: sizes that give every rank some.
            jobs += [
                (f"hf -> torch_dist tp1, {p} processes", "convert", src, work / "dist1_p",
                 dict(to="mcore", family="qwen3_5", format="torch_dist", max_shard_size="256MB", workers=p)),
                (f"hf -> legacy tp2, {p} processes", "convert", src, work / "legacy2_p",
                 dict(to="mcore", family="qwen3_5", format="legacy", tp=2, workers=p)),
                (f"legacy tp2 -> hf, {p} processes", "convert", work / "legacy2", work / "back_legacy_p",
                 dict(to="hf", max_shard_size="256MB", workers=p)),
                (f"torch_dist -> hf, {p} processes", "convert", work / "dist1", work / "back_dist_p",
                 dict(to="hf", max_shard_size="256MB", workers=p)),
            ]
        # Rounds: every job once per round, so a disk that slows down as the benchmark writes
        # (some do: on one, by the end of a depth-54 run the plain copy took 1.3x as long as at the
        # start) slows every job alike instead of whichever ran last.
        written = [job_dst for _, _, _, job_dst, _ in jobs] + [work / "copy_pair"]
        if args.against:
            written += [job_dst.with_name(job_dst.name + "_against") for _, job, _, job_dst, _ in jobs if job == "convert"]
        runs: dict[str, list[dict]] = {label: [] for label, *_ in jobs}
        against_runs: dict[str, list[dict]] = {label: [] for label, job, *_ in jobs if job == "convert"}

        log = open(args.log, "a") if args.log else None  # noqa: SIM115  (closed in `finally`)

        def run_once(label, job, job_src, job_dst, extra, tree=None) -> dict:
            if job_dst.exists():
                shutil.rmtree(job_dst)
            paired = None
            if args.paired and job != "copy":
                pair_dst = work / "copy_pair"
                _warm(src)
                _settle(args.settle)
                paired = _measure("copy", src, pair_dst)
                shutil.rmtree(pair_dst)
            profile = None
            if args.perf and job == "convert" and tree is None and json.loads(extra[0]).get("workers", 1) == 1:
                profile = work / f"perf-{len(runs[label])}.data"
                extra = [json.dumps({**json.loads(extra[0]), "perf": str(profile)})]
            _warm(job_src)
            _settle(args.settle)
            result = _measure(job, job_src, job_dst, *extra, tree=tree)
            if profile is not None:
                result["cpu_kinds"] = _cpu_kinds(profile)
                profile.unlink(missing_ok=True)
            result["paired_copy_seconds"] = paired["seconds"] if paired else None
            result["paired_copy_phases"] = paired["phases"] if paired else None
            result["written"] = _dir_bytes(job_dst)
            if log:
                log.write(json.dumps({"round": attempt + 1, "label": label, "tree": tree[1] if tree else "this",
                                      "at": time.time(), "run": result, "paired_copy": paired}) + "\n")
                log.flush()
            return result

        def against_path(path: Path) -> Path:  # the other checkout's outputs, beside this one's
            return path if path == src else path.with_name(path.name + "_against")

        for attempt in range(max(1, args.repeat)):
            print(f"round {attempt + 1} of {max(1, args.repeat)} ...", file=sys.stderr)
            last_round = attempt + 1 == max(1, args.repeat)
            for label, job, job_src, job_dst, options in _round_order(jobs, attempt, max(1, args.repeat)):
                extra = [json.dumps(options)] if options is not None else []
                trees = [None]
                if args.against and job == "convert":
                    trees = [None, tuple(args.against)] if attempt % 2 == 0 else [tuple(args.against), None]
                for tree in trees:
                    if tree is None:
                        runs[label].append(run_once(label, job, job_src, job_dst, extra))
                        out = job_dst
                    else:
                        out = against_path(job_dst)
                        against_runs[label].append(run_once(label, job, against_path(job_src), out, extra, tree))
                    # Outputs no later job reads go at once (the round trips' are compared at the
                    # end): it keeps the disk footprint, and what the page cache must hold, small.
                    if job_dst.name in ("copy", "copy_wb", "tf", "legacy1", "dist2", "dist1_p", "legacy2_p") or (
                            job_dst.name.startswith("back_") and not (last_round and tree is None)):
                        shutil.rmtree(out)
        rows = []
        for label, *_ in jobs:
            result = dict(min(runs[label], key=lambda r: r["seconds"]))
            result.update(label=label, all_seconds=[r["seconds"] for r in runs[label]],
                          peak_anon_kb=max(r["peak_anon_kb"] for r in runs[label]))
            rows.append(result)
        exact = {name: _same_tensors(src, work / name) for name in ("back_legacy", "back_dist")
                 + (("back_legacy_p", "back_dist_p") if args.workers > 1 else ())}

        copy_seconds, floor_seconds = rows[0]["seconds"], rows[1]["seconds"]
        print(f"\nQwen3.5 vision tower, depth {args.depth}: {source_bytes / 1e9:.3f} GB (bf16, {sum(name.endswith('.safetensors') for name in files)} shards), "
              f"{os.cpu_count()} CPUs, round trips bit-exact: {exact}")
        print()
        paired_column = args.paired
        fastest_copy = _fastest_copy(runs, against_runs)
        copies = sorted(_copy_seconds(runs))
        print(f"plain copy (shutil.copyfile + fsync) of the {source_bytes / 1e9:.3f} GB: fastest "
              f"{source_bytes / fastest_copy / 1e9:.2f} GB/s, median {source_bytes / copies[len(copies) // 2] / 1e9:.2f} GB/s "
              f"over {len(copies)} copies")
        flushes = _copy_flush_seconds(runs)
        if flushes:
            print(f"a copy's wait in fsync, after its bytes were in the page cache: median {statistics.median(flushes):.2f} s "
                  f"of the median copy's {copies[len(copies) // 2]:.2f} s")
        print()
        # CPU s/GB: user + system CPU of the job's timed region (every thread and rank) per GB of
        # source, the median over the runs: near the copy's, a job waits on the disk; far above
        # it, on the CPU, and a faster disk will not make it faster.
        print("| job | wall s (runs) | GB/s | x copy | x floor |"
              + (" x the copy just before (runs) | median |" if paired_column else "")
              + " CPU s/GB | CPU steal s, most | peak RssAnon MB | of which imports MB |")
        print("| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if paired_column else "")
              + " ---: | ---: | ---: | ---: |")
        stalls = False
        for row in rows:
            listed = ", ".join(f"{s:.2f}" for s in row["all_seconds"])
            pairs = ""
            if paired_column:
                best, shown, stalled, median = _paired_ratios(runs[row["label"]], fastest_copy)
                stalls = stalls or stalled
                pairs = f" {best:.2f} ({shown}) | {median:.2f} |" if shown else " 1.00 | 1.00 |"
            cpus = sorted(r["cpu_s"] for r in runs[row["label"]] if r.get("cpu_s") is not None)
            cpu = f"{cpus[len(cpus) // 2] / (source_bytes / 1e9):.2f}" if cpus else "-"
            # CPU time the VM lost to other tenants while the job's child ran (its imports too, its
            # paired copy not): a run that lost much of its wall this way says little.
            steal = max(r["child"]["cpu_steal_s"] for r in runs[row["label"]])
            print(f"| {row['label']} | {row['seconds']:.2f} ({listed}) | {source_bytes / row['seconds'] / 1e9:.2f} | "
                  f"{row['seconds'] / copy_seconds:.2f} | {row['seconds'] / floor_seconds:.2f} |{pairs} {cpu} | "
                  f"{steal:.2f} | "
                  f"{row['peak_anon_kb'] / 1024:.0f} | "
                  f"{(row['ready_anon_kb'] or 0) / 1024:.0f} |")
        if stalls:
            print(f"\n\\* the copy just before took over {STALLED_COPY:g}x the run's fastest copy "
                  f"({fastest_copy:.2f} s): a stall of the disk, which makes the job look fast; not counted in the best")
        if args.perf:
            _print_cpu_kinds(runs)
        if args.against:
            _print_against(runs, against_runs, args.against[1], fastest_copy)
    finally:
        if log is not None:
            log.close()
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:  # the source stays for the next run of the benchmark (made only when missing)
            for path in written:
                shutil.rmtree(path, ignore_errors=True)


STALLED_COPY = 1.5


def _round_order(jobs: list, attempt: int, rounds: int) -> list:
    """The order of one round: the first as listed (a reading job's source is written earlier in
    it), each later one started further along the list. On a VM whose speed follows what the runs
    before left in memory, one slot of a round can be slow in every round (at 3.4 GB, the plain copy
    paired with the sixth job took 6-9 s in all three rounds against 1.7 s at best): turning the
    order moves that slot's cost from job to job instead of pinning it on one."""
    start = (attempt * len(jobs)) // rounds
    return jobs[start:] + jobs[:start]


def _fastest_copy(runs: dict, against_runs: dict) -> float:
    """The fastest plain copy of this run of the benchmark: the baseline's runs and every run's paired copy."""
    copies = [r["seconds"] for r in runs.get("copy (baseline)", [])]
    copies += [r["paired_copy_seconds"] for group in (runs, against_runs) for rs in group.values() for r in rs
               if r.get("paired_copy_seconds")]
    return min(copies)


def _copy_seconds(runs: dict) -> list[float]:
    """Every plain copy of this run: the baseline's runs and each run's paired copy."""
    return [r["seconds"] for r in runs.get("copy (baseline)", [])] + [
        r["paired_copy_seconds"] for rs in runs.values() for r in rs if r.get("paired_copy_seconds")]


def _copy_flush_seconds(runs: dict) -> list[float]:
    """How long each plain copy of this run waited in its fsyncs, after its bytes were in the page
    cache: where this is most of the copy, the disk (or the host under a VM's disk) sets the pace
    of every job, not the CPU."""
    copies = [(r["seconds"], r.get("phases")) for r in runs.get("copy (baseline)", [])] + [
        (r["paired_copy_seconds"], r.get("paired_copy_phases")) for rs in runs.values() for r in rs
        if r.get("paired_copy_seconds")]
    return [seconds - phases["into_page_cache"] for seconds, phases in copies
            if phases and "into_page_cache" in phases]


def _paired_ratios(job_runs: list[dict], fastest_copy: float) -> tuple[float, str, bool, float]:
    """(best ratio, the ratios listed, whether any was against a stalled copy, median ratio) of one
    job's runs.

    A run's ratio is its wall time over the copy made right before it. A copy that took over
    ``STALLED_COPY`` times the run's fastest met a stall of the disk (on this VM: 1.2-1.9 s
    against 0.63 s), and the job right after it, on a disk that has recovered, looks up to twice as
    fast as it is: such a ratio is listed, starred, but the best is taken from the others (from
    all, where every one is starred). The median of the same ratios is the figure to compare
    between two runs of the benchmark: on a machine whose CPU is stolen by its neighbours now and
    then, one lucky round moves the best, not the median."""
    pairs = [(r["seconds"] / r["paired_copy_seconds"], r["paired_copy_seconds"] > STALLED_COPY * fastest_copy)
             for r in job_runs if r.get("paired_copy_seconds")]
    if not pairs:
        return float("nan"), "", False, float("nan")
    counted = [ratio for ratio, stalled in pairs if not stalled] or [ratio for ratio, _ in pairs]
    shown = ", ".join(f"{ratio:.2f}{'*' if stalled else ''}" for ratio, stalled in pairs)
    return min(counted), shown, any(stalled for _, stalled in pairs), statistics.median(counted)


def _print_cpu_kinds(runs: dict) -> None:
    """Where each profiled job's CPU went: the mean share of its runs' perf samples per kind."""
    names = [name for name, _ in _CPU_KINDS]
    print("\nWhere the CPU of the timed region went (perf samples, mean over the runs, percent):\n")
    print("| job | samples | " + " | ".join(names) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in names) + " |")
    kernel_seen = False
    for label, job_runs in runs.items():
        kinds = [r["cpu_kinds"] for r in job_runs if r.get("cpu_kinds")]
        if not kinds:
            continue
        means = {name: sum(k[name] for k in kinds) / len(kinds) for name in names}
        kernel_seen = kernel_seen or any(means[n] for n in names[:4])
        samples = "/".join(str(k["samples"]) for k in kinds)
        print(f"| {label} | {samples} | " + " | ".join(f"{means[n]:.1f}" for n in names) + " |")
    if not kernel_seen:
        print("\nperf saw no kernel samples: run as root or with kernel.perf_event_paranoid <= 1 to see them.")


def _print_against(runs: dict, against_runs: dict, other: str, fastest_copy: float) -> None:
    """Both trees' conversion runs of the same rounds: wall times and ratios to each run's own copy
    (a ratio against a stalled copy is left out, see `_paired_ratios`)."""
    def ratios(rs):
        return [r["seconds"] / r["paired_copy_seconds"] for r in rs
                if r["paired_copy_seconds"] and r["paired_copy_seconds"] <= STALLED_COPY * fastest_copy]

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    print(f"\nSame rounds, this tree vs {other} (ratio: wall over the copy run just before it):\n")
    print("| job | best wall s: this / other | best ratio: this / other (runs) | median ratio: this / other |")
    print("| --- | ---: | ---: | ---: |")
    for label, theirs in against_runs.items():
        ours = runs[label]
        mine, other_ratios = ratios(ours), ratios(theirs)
        print(f"| {label} | {min(r['seconds'] for r in ours):.2f} / {min(r['seconds'] for r in theirs):.2f} | "
              f"{min(mine, default=float('nan')):.2f} / {min(other_ratios, default=float('nan')):.2f} "
              f"({', '.join(f'{x:.2f}' for x in mine)} / {', '.join(f'{x:.2f}' for x in other_ratios)}) | "
              f"{median(mine):.2f} / {median(other_ratios):.2f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        main()
