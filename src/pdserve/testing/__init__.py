"""Test harnesses, for pdserve's tests and the benchmarks (``pdserve-bench``); never used to serve.

- :mod:`pdserve.testing.fake_engine` — a fake engine that speaks the vLLM OpenAI server's P/D protocol;
- :mod:`pdserve.testing.thread_server` — an ASGI app (a fake engine, a router) on loopback in a thread;
- :mod:`pdserve.testing.fake_router` — a router in front of one fake prefill and one fake decode engine;
- :mod:`pdserve.testing.served` — ``pdserve serve`` as a child process;
- :mod:`pdserve.testing.cpu_probe` — fixed CPU speed and dtype-fidelity readings instead of real probes.
- :mod:`pdserve.testing.no_io` — the guard that fails a unit test opening a socket or starting a process.

The runtime's packages do not import this one (``tests/unit/test_layers.py`` holds the rule). Importing it
imports nothing: each module loads what it needs.
"""
