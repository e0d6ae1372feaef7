"""Loaded by every Python process of a Ray instance ``pdserve serve`` starts itself (the directory is on their
PYTHONPATH: app/ray_compat.py, ``unused_imports_off``).

Ray imports pandas (Ray Serve's utilities, for a JSON encoder of data frames) and pyarrow (Ray's serializers,
for Ray Data) in every process where they are installed, and pdserve's processes use neither; they are
installed beside pdserve for its benchmarks' comparison with Ray Serve LLM. Hidden here, Ray finds neither
(an import raises ModuleNotFoundError, which Ray expects where they are not installed): 40 MiB less in each
of Serve's controller, the router, the prefill and decode replicas, and ready sooner.
"""

import sys

for _name in ("pandas", "pyarrow"):
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]
