#!/usr/bin/env bash
# One prepared device check for a CUDA machine without network (see docs/gpu.md).
#
# Expects: a python with torch (CUDA) and the wheels of what is missing in <checkout>/.whl/
# (megatron-core, transformers, ...). The python is $PYTHON, else the active virtualenv's, else
# python3. Runs from any directory, each step time-boxed inside one overall budget:
#   1. installs .whl/*.whl into a temporary directory (no index, no deps) and puts it and this
#      checkout on PYTHONPATH
#   2. pytest -m gpu                                  (tests/models/test_gpu.py and any other gpu-marked test)
#   3. mmparity check --device cuda, bfloat16 and float32, every registered family
#   4. mmparity bench --size published --device cuda --dtype bfloat16, with the parity verdict
#   5. the same with --mixed: each family's packed mixed-size batch (the real workload), parity too
#   6. benchmarks/attention_kernels.py on cuda        (where the auto policy should switch kernels)
# and writes everything under $OUT (default: a new temporary directory, named in the first line
# printed): at most 8 files, named in [A-Za-z0-9._-], so that a runner which brings back only a
# few files gets them all. The last lines printed are a summary. Exit status: 0 when every step
# ran and passed, 1 when one did not, 3 when the wheels or the imports failed, 4 without CUDA.
#
# Dry run of the plumbing on a machine without CUDA, with the packages already installed:
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_BENCH_SIZE=tiny GPU_CHECK_NO_WHEELS=1 bash scripts/gpu_check.sh
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${OUT:-}" ]]; then
    OUT="$(mktemp -d -t mmparity-gpu-check.XXXXXX)" || exit 3
fi
mkdir -p "$OUT" || exit 3
OUT="$(cd "$OUT" && pwd)"   # absolute before the cd below: a relative $OUT is the caller's
cd "$ROOT" || exit 3
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"   # the whole script, install included; keep under 8 minutes
LOG="$OUT/gpu_check.log"
: >"$LOG"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    PY="$VIRTUAL_ENV/bin/python"
else
    PY=python3
fi
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
BENCH_SIZE="${GPU_CHECK_BENCH_SIZE:-published}"
SITE=""
declare -a STATUS=()

log() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
# The installed wheels are scratch: outside $OUT, which holds only what is to come back.
trap '[[ -n "$SITE" ]] && rm -rf "$SITE"' EXIT

# step NAME CAP_S CMD...: run CMD with the smaller of CAP_S and what is left of the budget.
step() {
    local name="$1" cap="$2"; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) - 10 ))
    local limit=$(( cap < left ? cap : left ))
    if (( limit < 20 )); then
        log "SKIP $name: only ${left}s of the ${BUDGET_S}s budget left"
        STATUS+=("$name=skipped")
        return 0
    fi
    log "RUN  $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) STATUS+=("$name=ok") ;;
        124|137) STATUS+=("$name=timeout") ;;
        *) STATUS+=("$name=rc$rc") ;;
    esac
    log "DONE $name: rc=$rc"
}

log "writing to $OUT; checkout $ROOT, python $PY, device $DEVICE"

# 1. dependencies ---------------------------------------------------------------------------------
if [[ -z "${GPU_CHECK_NO_WHEELS:-}" ]] && compgen -G ".whl/*.whl" >/dev/null; then
    SITE="$(mktemp -d -t mmparity-gpu-site.XXXXXX)" || exit 3
    wheels=(.whl/*.whl)
    log "installing ${#wheels[@]} carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}" 2>&1 | tee -a "$LOG"
    if (( PIPESTATUS[0] != 0 )); then
        log "wheel install failed"; exit 3
    fi
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    log "no .whl/ folder (or GPU_CHECK_NO_WHEELS set): using the installed packages as they are"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>&1 | tee -a "$LOG"
else
    log "nvidia-smi is not on PATH"
fi
"$PY" - "$DEVICE" <<'EOF' 2>&1 | tee -a "$LOG"
import sys, torch, transformers, megatron.core, mmparity
from importlib import metadata
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| megatron-core", metadata.version("megatron-core"),
      "| mmparity", mmparity.__version__)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
sys.exit(0 if torch.cuda.is_available() or sys.argv[1] == "cpu" else 4)
EOF
case ${PIPESTATUS[0]} in
    0) ;;
    4) log "no CUDA device (torch.cuda.is_available() is False): this check needs one. For a dry run" \
           "of the plumbing: GPU_CHECK_DEVICE=cpu GPU_CHECK_BENCH_SIZE=tiny GPU_CHECK_NO_WHEELS=1"
       exit 4 ;;
    *) log "imports failed: see above"; exit 3 ;;
esac

# 2-6. the checks -----------------------------------------------------------------------------------
step pytest_gpu 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --continue-on-collection-errors \
    --junitxml="$OUT/pytest_gpu.xml" tests
check_dtype() {  # the full check; if it crashed (no report written), again without components
    local dtype="$1" json="$OUT/check_cuda_$1.json"
    rm -f "$json"
    step "check_$dtype" 75 "$PY" -m mmparity check --device "$DEVICE" --dtype "$dtype" --quiet \
        --json "$json"
    if [[ ! -s "$json" ]]; then
        log "check $dtype wrote no report (it crashed, see above): again with --no-components"
        step "check_${dtype}_no_components" 60 "$PY" -m mmparity check --device "$DEVICE" \
            --dtype "$dtype" --quiet --no-components --json "$json"
    fi
}
check_dtype bfloat16
check_dtype float32
# Both benches judge bf16 parity against an fp32 HF forward (exit 1 on a failed verdict) and
# rewrite their JSON after every family, so a step cut by its limit still reports what it timed.
# The towers only, named: the whole VLMs' published sizes (Mistral-Small-3.1 is 24B parameters)
# take minutes each to build on the host, longer than the step's whole limit, so not one of them
# would be timed.
step bench_published 180 "$PY" -m mmparity bench pixtral clip siglip qwen3_5 kimi_k25 --size "$BENCH_SIZE" \
    --device "$DEVICE" --dtype bfloat16 --json "$OUT/bench_published_bfloat16.json"
# Most wanted first (the towers with speed targets in benchmarks/RESULTS.md), in case the step
# runs out of time.
step bench_mixed 140 "$PY" -m mmparity bench qwen3_5 kimi_k25 pixtral siglip clip --mixed \
    --size "$BENCH_SIZE" --device "$DEVICE" --dtype bfloat16 --json "$OUT/bench_mixed_bfloat16.json"
step attention_kernels 45 "$PY" benchmarks/attention_kernels.py --device "$DEVICE" --dtype bfloat16 \
    --json "$OUT/attention_kernels.json"

# summary ----------------------------------------------------------------------------------------------
"$PY" - "$OUT" "${STATUS[@]}" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, sys
out, statuses = sys.argv[1], sys.argv[2:]
summary = {"steps": dict(s.split("=", 1) for s in statuses)}
def rnd(value, digits):
    return None if value is None else round(value, digits)
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
for dtype in ("bfloat16", "float32"):
    rep = load(f"check_cuda_{dtype}.json")
    if rep:
        fails = [f"{r['family']}:{r['check']}@{(r['first_divergence'] or {}).get('module')}"
                 for r in rep["results"] if not r["passed"]]
        summary[f"check_{dtype}"] = {"passed": rep["passed"], "results": len(rep["results"]),
                                     "failures": fails, "attention_backend": rep["attention_backend"]}
def parity_of(r):
    p = r.get("parity")
    if p is None:
        return None
    return {"passed": p["passed"], "output": p.get("output"), "native_rel_l2": p.get("native_rel_l2"),
            "hf_rel_l2": p.get("hf_rel_l2"), "tolerance": (p.get("tolerance") or {}).get("rel_l2"),
            "error": p.get("error")}
def bench_rows(rep):
    nat = lambda r, key: (r["native"] or {}).get(key)  # noqa: E731
    return {r["family"]: {"native_ms": rnd(nat(r, "median_ms"), 2),
                          "hf_ms": rnd((r["hf"] or {}).get("median_ms"), 2),
                          "speedup_vs_hf": rnd(r["speedup_vs_hf"], 2),
                          "native_tflops": rnd(nat(r, "tflops"), 1),
                          "images": r["images"], "image_size": r["image_sizes"][0],
                          "sizes": len({tuple(s) for s in r["image_sizes"]}), "tokens": r["tokens"],
                          "kernels": (nat(r, "detail") or {}).get("attention_kernels"),
                          "rel_l2": r["rel_l2"], "parity": parity_of(r), "error": r["error"]}
            for r in rep["results"]}
for key, name in (("bench", "bench_published_bfloat16.json"), ("bench_mixed", "bench_mixed_bfloat16.json")):
    rep = load(name)
    if rep and rep.get("results") is not None:
        summary[key] = bench_rows(rep)
        # False: the step was cut short; the families listed are those it finished.
        summary[key + "_complete"] = rep.get("complete", True)
kern = load("attention_kernels.json")
if kern:
    summary["attention_kernels"] = [{"scenario": r["scenario"], "auto": r["auto"], "fastest": r["fastest"],
                                     "ms": {k: round(v, 3) for k, v in r["ms"].items()}} for r in kern["rows"]]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print("=== gpu_check summary ===")
print("steps:", " ".join(statuses))
for dtype in ("bfloat16", "float32"):
    s = summary.get(f"check_{dtype}")
    if s:
        print(f"check {dtype}: {'PASS' if s['passed'] else 'FAIL'} ({s['results']} results) {s['failures'][:6]}")
def g(value):
    return "-" if value is None else format(value, ".2g")
def verdict(p):
    if p is None:
        return "parity not checked"
    if p["error"]:
        return f"parity FAIL (no fp32 reference: {p['error']})"
    hf = "" if p["hf_rel_l2"] is None else f", HF {g(p['hf_rel_l2'])}"
    return (f"parity {'PASS' if p['passed'] else 'FAIL'} ({p['output']} native {g(p['native_rel_l2'])} "
            f"{'<=' if p['passed'] else '>'} {g(p['tolerance'])}{hf})")
for key in ("bench", "bench_mixed"):
    if summary.get(key + "_complete") is False:
        print(f"{key}: INCOMPLETE (the step stopped early; families below are those it finished)")
    for fam, b in (summary.get(key) or {}).items():
        if b["error"]:
            print(f"{key} {fam}: ERROR {b['error']}")
            continue
        batch = (f"{b['images']}x{b['image_size'][0]}x{b['image_size'][1]}" if key == "bench" else
                 f"{b['sizes']} sizes x {b['images']} images")
        print(f"{key} {fam}: {batch} {b['tokens']} tokens native {b['native_ms']} ms HF {b['hf_ms']} ms "
              f"speedup {b['speedup_vs_hf']}x native {b['native_tflops']} TFLOP/s rel_l2 {g(b['rel_l2'])} "
              f"{verdict(b['parity'])} {b['kernels']}")
for r in summary.get("attention_kernels") or []:
    print(f"attn {r['scenario']}: auto={r['auto']} fastest={r['fastest']} {r['ms']}")
EOF
(( PIPESTATUS[0] == 0 )) || STATUS+=("summary=failed")
log "finished in $(( $(date +%s) - START ))s"
for s in "${STATUS[@]}"; do [[ "$s" == *=ok ]] || exit 1; done
exit 0
