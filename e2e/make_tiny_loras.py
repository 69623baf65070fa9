"""Build tiny LoRA adapters for the tiny Llama fully offline, with peft: one directory per
adapter (adapter_config.json + adapter_model.safetensors), random non-zero weights, a different
seed each, so each adapter changes the greedy output differently.

usage: make_tiny_loras.py MODEL_DIR OUT_DIR
"""
import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

model_dir, out = sys.argv[1], sys.argv[2]
ADAPTERS = {"lora-a": 1, "lora-b": 2, "lora-c": 3}
os.makedirs(out, exist_ok=True)
for name, seed in ADAPTERS.items():
    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    model.save_pretrained(os.path.join(out, name))
    print(f"built {os.path.join(out, name)} (seed {seed})")
