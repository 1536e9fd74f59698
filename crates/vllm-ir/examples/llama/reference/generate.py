"""Reference logits of the Llama example's tiny random models, from Hugging Face transformers.

Builds `LlamaForCausalLM`, `GemmaForCausalLM`, `Qwen3ForCausalLM` and `Gemma3ForCausalLM` with the
configuration of `tiny_config` in
`../model.rs` and the weights `random_weights` makes there (the same generator, value for value,
in f32), runs one forward over a fixed sequence and writes `<variant>.json`: the configuration,
the seed, the tokens and the logits of every position. `tests/llama.rs` checks the example's model
against these files, so CI needs no Python.

    python3 generate.py [VARIANT ...]   # needs torch and transformers (torch 2.5.1; transformers
                                        # 4.46.3 wrote llama and gemma, 4.51.3 qwen3 and gemma3_text)
"""

import json
import pathlib

import numpy as np
import torch
import transformers

SEED = 5
TOKENS = [(i * 37 + 11) % 256 for i in range(20)]
MASK = (1 << 64) - 1


def tiny_config(model_type):
    """`tiny_config` of `../model.rs`."""
    gemma = model_type.startswith("gemma")
    gemma3 = model_type == "gemma3_text"
    config = {
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64 if gemma else 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if gemma3 else 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": gemma,
        "model_type": model_type,
    }
    if gemma3:
        config.update(
            query_pre_attn_scalar=32.0, sliding_window=8, sliding_window_pattern=2, rope_local_base_freq=10000.0
        )
    return config


def random_weights(config, seed):
    """`random_weights` of `../model.rs` in f32: a 64-bit LCG, each value uniform in [-scale, scale)."""
    state = (seed * 6364136223846793005 + 1442695040888963407) & MASK

    def tensor(shape, scale):
        nonlocal state
        n = int(np.prod(shape))
        values = np.empty(n, dtype=np.float32)
        for i in range(n):
            state = (state * 6364136223846793005 + 1442695040888963407) & MASK
            values[i] = np.float32(((state >> 40) / float(1 << 24)) * 2.0 - 1.0)
        return (values * np.float32(scale)).reshape(shape)

    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    gemma = config["model_type"].startswith("gemma")
    gemma3 = config["model_type"] == "gemma3_text"
    qk_norm = gemma3 or config["model_type"] == "qwen3"
    norm_center = np.float32(0.0 if gemma else 1.0)
    scale = 1.0 / np.sqrt(h)
    weights = {"model.embed_tokens.weight": tensor([config["vocab_size"], h], 1.0)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for name in ["input_layernorm", "post_attention_layernorm"]:
            weights[f"{p}.{name}.weight"] = tensor([h], 0.1) + norm_center
        if gemma3:
            for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"]:
                weights[f"{p}.{name}.weight"] = tensor([h], 0.1) + norm_center
        weights[f"{p}.self_attn.q_proj.weight"] = tensor([heads * d, h], scale)
        weights[f"{p}.self_attn.k_proj.weight"] = tensor([kv_heads * d, h], scale)
        weights[f"{p}.self_attn.v_proj.weight"] = tensor([kv_heads * d, h], scale)
        weights[f"{p}.self_attn.o_proj.weight"] = tensor([h, heads * d], scale)
        if qk_norm:
            for name in ["q_norm", "k_norm"]:
                weights[f"{p}.self_attn.{name}.weight"] = tensor([d], 0.1) + norm_center
        weights[f"{p}.mlp.gate_proj.weight"] = tensor([i, h], scale)
        weights[f"{p}.mlp.up_proj.weight"] = tensor([i, h], scale)
        weights[f"{p}.mlp.down_proj.weight"] = tensor([h, i], 1.0 / np.sqrt(i))
    weights["model.norm.weight"] = tensor([h], 0.1) + norm_center
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = tensor([config["vocab_size"], h], scale)
    return weights


def reference(model_type):
    config = tiny_config(model_type)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    if model_type == "gemma":
        hf = transformers.GemmaConfig(**fields, hidden_activation="gelu_pytorch_tanh", attn_implementation="eager")
        model = transformers.GemmaForCausalLM(hf)
    elif model_type == "gemma3_text":
        hf = transformers.Gemma3TextConfig(
            **fields,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            attn_implementation="eager",
        )
        model = transformers.Gemma3ForCausalLM(hf)
    elif model_type == "qwen3":
        hf = transformers.Qwen3Config(**fields, attn_implementation="eager")
        model = transformers.Qwen3ForCausalLM(hf)
    else:
        hf = transformers.LlamaConfig(**fields, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(hf)
    weights = {k: torch.from_numpy(v) for k, v in random_weights(config, SEED).items()}
    if config["tie_word_embeddings"]:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS]), use_cache=False).logits[0]
    return {
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "config": config,
        "seed": SEED,
        "tokens": TOKENS,
        "logits": [[float(v) for v in row] for row in logits.float()],
    }


if __name__ == "__main__":
    import sys

    torch.manual_seed(0)
    here = pathlib.Path(__file__).parent
    for variant in sys.argv[1:] or ["llama", "gemma", "qwen3", "gemma3_text"]:
        out = here / f"{variant}.json"
        out.write_text(json.dumps(reference(variant)) + "\n")
        print(f"wrote {out}")
