"""Reference rotary frequencies from Hugging Face transformers' `ROPE_INIT_FUNCTIONS`.

For each configuration of `CASES` (real checkpoints' `rope_theta`, head size and `rope_scaling`,
and a few that pin down the YaRN attention factor), builds the model's configuration, calls the
rope type's init function and writes the inverse frequencies and the attention factor to
`reference.json`. `../rope_reference.rs` checks `layers::inverse_frequencies` against them within
1e-6 relative, so CI needs no Python.

    python3 generate.py   # needs torch and transformers (tested with torch 2.15.0, transformers 5.25.0)
"""

import json
import pathlib

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# name, rope_theta, head_dim, max_position_embeddings, rope_scaling (None: default), sequence length
# for `dynamic` (the context the cache is built for).
CASES = [
    ("llama2-default", 10000.0, 128, 4096, None, None),
    ("linear-factor-4", 10000.0, 128, 4096, {"rope_type": "linear", "factor": 4.0}, None),
    ("dynamic-factor-2", 10000.0, 128, 4096, {"rope_type": "dynamic", "factor": 2.0}, 8192),
    (
        "llama3.1-8b",
        500000.0,
        128,
        131072,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        None,
    ),
    (
        "llama3.2-1b",
        500000.0,
        64,
        131072,
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        None,
    ),
    (
        "qwen2.5-yarn",
        1000000.0,
        128,
        32768,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        None,
    ),
    (
        "deepseek-v3",
        10000.0,
        64,
        163840,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        None,
    ),
    (
        "deepseek-v2-lite",
        10000.0,
        64,
        163840,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        None,
    ),
    (
        "gpt-oss",
        150000.0,
        64,
        131072,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        None,
    ),
    (
        "yarn-mscale-only",
        10000.0,
        128,
        16384,
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "original_max_position_embeddings": 4096},
        None,
    ),
    (
        "yarn-attention-factor",
        10000.0,
        64,
        8192,
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "attention_factor": 0.9,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 4096,
        },
        None,
    ),
]


def config(theta, head_dim, max_position, scaling):
    parameters = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        parameters = dict(scaling, rope_theta=theta)
    return transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters=parameters,
    )


def main():
    cases = []
    for name, theta, head_dim, max_position, scaling, seq_len in CASES:
        cfg = config(theta, head_dim, max_position, scaling)
        rope_type = "default" if scaling is None else scaling["rope_type"]
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            attention_factor = 1.0
        else:
            inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len)
        fields = {k: (float(v) if not isinstance(v, bool) else v) for k, v in (scaling or {}).items() if k != "rope_type"}
        cases.append(
            {
                "name": name,
                "rope_type": rope_type,
                "rope_theta": theta,
                "rotary_dim": head_dim,
                "max_position_embeddings": max_position,
                "fields": fields,
                "inv_freq": [float(f) for f in inv_freq.tolist()],
                "attention_factor": float(attention_factor),
            }
        )
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}
    path = pathlib.Path(__file__).with_name("reference.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
