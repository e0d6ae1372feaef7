"""Launch a prefill/decode pair of plain vLLM OpenAI servers (NixlConnector on CPU)
or one colocated server, run N handoffs, print per-request timings, kill everything.

Examples:
  python pd_probe.py --tag base --n 10
  python pd_probe.py --tag ucxmt --env NIXL_X=1 --kv-extra '{"num_threads":0}' --n 10
  python pd_probe.py --tag colo --colo --n 10

Env vars given with --env go to BOTH servers; --penv / --denv only to prefill / decode.
Logs: /tmp/pdlogs/<tag>/{prefill,decode,colo}.log ; results: /tmp/pdlogs/<tag>/results.json
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

PY = "/work/main/.venv/bin/python"
MODEL = "/root/.cache/pdserve/models/smollm2-135m-instruct"
HOST = "127.0.0.1"

# ~300 tokens of deterministic English text.
BASE = (
    "The history of the city begins with a small settlement on the river bank, where "
    "fishermen and traders built wooden houses and a market square. Over the centuries "
    "the town grew, walls were raised, bridges were built, and merchants from distant "
    "lands arrived with spices, cloth and news of the wider world. "
)


def make_prompt(i, ntok_target=300):
    # vary the head so prefix caching cannot short-cut the prefill
    head = f"Document {i}: notes number {i * 7919 % 1000}. "
    body = BASE * 6
    return head + body + "\nSummarize the text above in one sentence:"


def post(url, payload, timeout=120):
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = json.loads(r.read())
    return body, time.perf_counter() - t0


def wait_health(port, proc, deadline):
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited rc={proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server on {port} not healthy")


def launch(name, port, core, kv_cfg, extra_env, logdir, extra_args):
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP=HOST,
        VLLM_NIXL_SIDE_CHANNEL_HOST=HOST,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(port + 1000),
        VLLM_ENGINE_READY_TIMEOUT_S="300",
        NIXL_LOG_LEVEL=env.get("NIXL_LOG_LEVEL", "WARN"),
    )
    env.update(extra_env)
    cmd = [
        PY, "-m", "vllm.entrypoints.openai.api_server",
        "--model", MODEL, "--served-model-name", "m",
        "--host", HOST, "--port", str(port),
        "--max-model-len", "2048", "--max-num-seqs", "8",
        "--disable-log-stats",
    ] + extra_args
    if kv_cfg is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_cfg)]
    log = open(os.path.join(logdir, f"{name}.log"), "w")
    log.write(f"# env: {json.dumps({k: v for k, v in env.items() if k.startswith(('VLLM', 'UCX', 'NIXL', 'OMP'))})}\n# cmd: {' '.join(cmd)}\n")
    log.flush()
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    return p


def kill(procs):
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    t0 = time.time()
    for p in procs:
        try:
            p.wait(timeout=max(1, 15 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def parse_env(items):
    out = {}
    for it in items or []:
        k, v = it.split("=", 1)
        out[k] = v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--colo", action="store_true", help="one plain server, no KV transfer")
    ap.add_argument("--connector", default="NixlConnector")
    ap.add_argument("--kv-extra", default=None, help="kv_connector_extra_config JSON (both)")
    ap.add_argument("--env", action="append")
    ap.add_argument("--penv", action="append")
    ap.add_argument("--denv", action="append")
    ap.add_argument("--pcore", default="0")
    ap.add_argument("--dcore", default="1")
    ap.add_argument("--gap", type=float, default=0.0, help="sleep between requests")
    ap.add_argument("--extra-args", default="")
    ap.add_argument("--ref", default=None, help="results.json of a colocated run to compare text")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()

    logdir = f"/tmp/pdlogs/{args.tag}"
    os.makedirs(logdir, exist_ok=True)
    common = parse_env(args.env)
    extra_args = args.extra_args.split() if args.extra_args else []
    procs = []
    t_start = time.time()
    results = dict(tag=args.tag, args=vars(args), requests=[])
    try:
        if args.colo:
            cp = launch("colo", 8300, args.dcore, None, common, logdir, extra_args)
            procs.append(cp)
            wait_health(8300, cp, time.time() + 300)
        else:
            extra = json.loads(args.kv_extra) if args.kv_extra else None
            pk = dict(kv_connector=args.connector, kv_role="kv_producer",
                      kv_buffer_device="cpu")
            dk = dict(kv_connector=args.connector, kv_role="kv_consumer",
                      kv_buffer_device="cpu")
            if extra:
                pk["kv_connector_extra_config"] = extra
                dk["kv_connector_extra_config"] = extra
            penv = {**common, **parse_env(args.penv)}
            denv = {**common, **parse_env(args.denv)}
            pp = launch("prefill", 8100, args.pcore, pk, penv, logdir, extra_args)
            procs.append(pp)
            dp = launch("decode", 8200, args.dcore, dk, denv, logdir, extra_args)
            procs.append(dp)
            wait_health(8100, pp, time.time() + 300)
            wait_health(8200, dp, time.time() + 300)
        results["startup_s"] = round(time.time() - t_start, 1)
        print(f"# servers up after {results['startup_s']} s", flush=True)

        for i in range(args.n + 1):  # request 0 = warm-up
            prompt = make_prompt(i)
            req = dict(model="m", prompt=prompt, max_tokens=args.max_tokens,
                       temperature=0.0, ignore_eos=True)
            rec = dict(i=i)
            t0 = time.perf_counter()
            if args.colo:
                body, dt = post(f"http://{HOST}:8300/v1/completions", req, args.timeout)
                rec.update(colo_s=dt)
            else:
                preq = dict(req, max_tokens=1, max_completion_tokens=1, stream=False,
                            kv_transfer_params=dict(
                                do_remote_decode=True, do_remote_prefill=False,
                                remote_engine_id=None, remote_block_ids=None,
                                remote_host=None, remote_port=None))
                pbody, pdt = post(f"http://{HOST}:8100/v1/completions", preq, args.timeout)
                ktp = pbody.get("kv_transfer_params")
                dreq = dict(req, kv_transfer_params=ktp)
                body, ddt = post(f"http://{HOST}:8200/v1/completions", dreq, args.timeout)
                rec.update(prefill_s=pdt, decode_s=ddt,
                           nblocks=len((ktp or {}).get("remote_block_ids") or [[]])
                           and sum(len(g) for g in ktp["remote_block_ids"]))
            rec["total_s"] = time.perf_counter() - t0
            rec["prompt_tokens"] = body["usage"]["prompt_tokens"]
            rec["completion_tokens"] = body["usage"]["completion_tokens"]
            rec["text"] = body["choices"][0]["text"]
            results["requests"].append(rec)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in rec.items() if k != "text"}), flush=True)
            if args.gap:
                time.sleep(args.gap)
        reqs = results["requests"][1:]
        summ = {}
        for key in ("prefill_s", "decode_s", "total_s", "colo_s"):
            xs = [r[key] for r in reqs if key in r]
            if xs:
                summ[key] = dict(p50=round(pct(xs, 0.5), 3), p90=round(pct(xs, 0.9), 3),
                                 max=round(max(xs), 3))
        if args.ref:
            ref = json.load(open(args.ref))
            rt = {r["i"]: r["text"] for r in ref["requests"]}
            summ["text_match"] = sum(rt.get(r["i"]) == r["text"] for r in results["requests"])
            summ["text_n"] = len(results["requests"])
        results["summary"] = summ
        print("SUMMARY", json.dumps(summ), flush=True)
    finally:
        kill(procs)
        results["wall_s"] = round(time.time() - t_start, 1)
        json.dump(results, open(os.path.join(logdir, "results.json"), "w"), indent=1)
        print(f"# wall {results['wall_s']} s; logs in {logdir}", flush=True)


if __name__ == "__main__":
    main()
