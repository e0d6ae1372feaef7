"""``pdserve doctor``: is this host ready to run pdserve, and would the KV cache really move fast?

Modules, in the order a run uses them:

- :mod:`~pdserve.doctor.result` — the typed outcome of one check (ok / warn / fail / skip, detail, fix).
- :mod:`~pdserve.doctor.probes` — every look at the host (files under /proc and /sys, sockets, tools,
  installed distributions). Checks reach the host only through it, so tests replace single probes.
- :mod:`~pdserve.doctor.checks` — versions, CPU, memory, /dev/shm, GPUs, EFA, ports, model.
- :mod:`~pdserve.doctor.loopback` — a program run in its own processes: two NIXL agents move a buffer
  between two processes, under the environment the engines get, with UCX diagnostics on.
- :mod:`~pdserve.doctor.ucx_log` — reads UCX's diagnostics: which transport carried the data.
- :mod:`~pdserve.doctor.transport` — the NIXL checks built on the loopback's result.
- :mod:`~pdserve.doctor.report` — the table, the JSON, the exit code.

Nothing heavy (vLLM, torch, Ray) is imported in the doctor's own process; NIXL (and torch, when a GPU is
present) is imported only by the loopback processes. Entry point: :func:`pdserve.doctor.report.run_doctor`.
"""
