"""A LoRA adapter made offline for a Llama-shaped model: random A and B (PEFT starts B at zero, which would
change nothing), on q_proj and v_proj of every layer, in PEFT's file layout."""

from __future__ import annotations

import json
from pathlib import Path


def write_random_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 8, seed: int = 0,
                         std: float = 0.1) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads(Path(model_dir, "config.json").read_text())
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    outs = {"q_proj": int(cfg["num_attention_heads"]) * head_dim,
            "v_proj": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for module, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * std
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_path / "adapter_model.safetensors"))
    (out_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": sorted(outs),
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False}, indent=2))
    return out_path
