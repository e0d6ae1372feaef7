"""``pdserve`` command line. Imports nothing heavy until a command needs it."""

from __future__ import annotations

import argparse
import sys

from pdserve import __version__
from pdserve.errors import PDServeError


def _cmd_validate(ns: argparse.Namespace) -> int:
    from pdserve.config.loader import load_config
    from pdserve.engine.launcher import EnginePlacement, build_engine_command

    loaded = load_config(ns.file)
    for note in loaded.notes:
        print(f"note: {note}")
    a = loaded.args
    print(f"{loaded.source}: OK")
    print(f"  model      {a.model_id} <- {a.prefill_config.model_loading_config.source()}")
    print(f"  prefill    {a.prefill_config.replicas_text()}   decode  {a.decode_config.replicas_text()}   "
          f"router {a.router.num_replicas} replica(s), policy {a.router.policy}")
    print(f"  endpoint   http://{a.http.host}:{a.http.port}{loaded.route_prefix.rstrip('/')}/v1")
    if ns.show_engines:
        from pdserve.app import placement

        where = placement.decide(a, on_cpu=not ns.gpu)
        a = where.args
        if where.dtype_reason:
            print(f"  dtype      {where.dtype} on CPU: {where.dtype_reason}")
        for role in ("prefill", "decode"):
            placement = EnginePlacement(http_port=0, side_channel_port=a.nixl.side_channel_port_base,
                                        side_channel_host="127.0.0.1", engine_id=f"{role}-0", cores=[0],
                                        on_cpu=not ns.gpu)
            print(f"  {role}: {build_engine_command(role, a, '<model>', placement).shell()}")
    return 0


def _cmd_model_pull(ns: argparse.Namespace) -> int:
    from pdserve.config.loader import load_config
    from pdserve.model.resolve import resolve_model

    args = load_config(ns.file).args
    path = resolve_model(args.prefill_config.model_loading_config.source(),
                         lambda m: print(m, file=sys.stderr, flush=True), cache_dir=args.cache_dir, download=True)
    print(path)
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    from pdserve.cli.serve import serve

    return serve(ns.file, host=ns.host, port=ns.port, address=ns.address)


def _cmd_status(ns: argparse.Namespace) -> int:
    from pdserve.cli.status import status

    return status(ns.url, api_key=ns.api_key, as_json=ns.json)


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from pdserve.doctor.report import run_doctor

    return run_doctor(ns.file, as_json=ns.json, run_transfer=not ns.no_transfer)


def _cmd_bench(ns: argparse.Namespace) -> int:
    """The benchmarks are their own distribution, ``pdserve-bench`` (``bench/`` in pdserve's repository); this
    is the runtime's one import of it, and only when it is installed."""
    import importlib.util

    if importlib.util.find_spec("pdserve_bench") is None:
        print("pdserve bench needs the pdserve-bench package: from pdserve's repository, "
              "pip install -e bench (or make setup)", file=sys.stderr)
        return 2
    from pdserve_bench.cli import run_bench

    return run_bench(ns)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode disaggregated LLM serving: one YAML in, one OpenAI-compatible endpoint out.",
    )
    p.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("serve", help="start the endpoint (no FILE: the embedded SmolLM2 default)")
    s.add_argument("file", nargs="?", help="pdserve YAML (bare args or a Ray Serve config)")
    s.add_argument("--host", help="listen address (default from the file, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default from the file, else 8000)")
    s.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else start one here)")
    s.set_defaults(func=_cmd_serve)

    v = sub.add_parser("validate", help="check a config file and say what is wrong")
    v.add_argument("file")
    v.add_argument("--show-engines", action="store_true", help="print each role's vLLM command line")
    v.add_argument("--gpu", action="store_true", help="with --show-engines: as on a GPU host")
    v.set_defaults(func=_cmd_validate)

    m = sub.add_parser("model", help="model preparation")
    msub = m.add_subparsers(dest="model_command", metavar="ACTION")
    mp = msub.add_parser("pull", help="prepare the model (default: the embedded SmolLM2); prints its directory")
    mp.add_argument("file", nargs="?", help="take the model from this config")
    mp.set_defaults(func=_cmd_model_pull)

    b = sub.add_parser("bench", help="measure an endpoint, or run a self-contained comparison (--scenario)")
    b.add_argument("--url", help="an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000")
    b.add_argument("--api-key", help="with --url: the endpoint's API key, sent as a bearer token "
                   "(default: $PDSERVE_API_KEY)")
    b.add_argument("--scenario", help="overhead | handoff | interference | conditional | prefix | goodput | "
                   "outside-client | router | kv-transfer | overload | overload-long | cpu-env | startup | ttft | "
                   "vs-ray-serve-llm | edge | tenants | footprint | multiturn | floor "
                   "(starts what it compares, on the same cores, one after the other)")
    b.add_argument("--config", help="pdserve YAML whose model and engine arguments the bench uses")
    b.add_argument("--model", help="model name to send (default: the config's model_id)")
    b.add_argument("--tokenizer", help="tokenizer directory for prompts (default: the config's model)")
    b.add_argument("--requests", type=int, help="number of requests")
    b.add_argument("--prompt-len", help="prompt tokens: N, uniform:LO-HI or normal:MEAN,SD")
    b.add_argument("--output-len", help="new tokens: N, uniform:LO-HI or normal:MEAN,SD")
    b.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix shared by all prompts")
    b.add_argument("--load", help="concurrency:N, rate:R or poisson:R; several separated by ';' (a sweep)")
    b.add_argument("--slo", help="e.g. ttft=500ms,tpot=50ms: goodput = share of requests meeting all")
    b.add_argument("--rates", help="goodput scenario: comma-separated Poisson rates to sweep (req/s)")
    b.add_argument("--threshold", type=int, help="conditional scenario: local-prefill threshold (tokens)")
    b.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a scenario's own setting, e.g. --opt bound=4 --opt seconds=60 (overload); repeatable")
    b.add_argument("--dry-run", action="store_true",
                   help="with --scenario: build its workload, systems and phases and print them (the plan); "
                   "start nothing")
    b.add_argument("--seed", type=int, default=0, help="prompt and arrival seed")
    b.add_argument("--out", default="bench-results", help="directory for JSON and PNG results")
    b.set_defaults(func=_cmd_bench)

    from pdserve.deploy.cli import add_render_parser

    add_render_parser(sub)

    d = sub.add_parser(
        "doctor",
        help="check this host: versions, CPU/GPU, NIXL backends and the transport KV really uses, EFA, ports, model",
    )
    d.add_argument("file", nargs="?", help="pdserve YAML to check against (default: the embedded default)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-transfer", action="store_true", help="skip the NIXL loopback transfer (the slow part)")
    d.set_defaults(func=_cmd_doctor)

    st = sub.add_parser("status", help="replicas, roles, health, load and memory of a running endpoint")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint (default %(default)s)")
    st.add_argument("--api-key", help="the endpoint's API key, when it has any (default: $PDSERVE_API_KEY)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    func = getattr(ns, "func", None)
    if func is None:
        parser.print_help()
        return 0 if ns.command is None else 2
    try:
        return int(func(ns))
    except PDServeError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
