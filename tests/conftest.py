import os

# Never reach a model hub from tests: everything runs on the packaged model or fakes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
