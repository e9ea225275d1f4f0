"""The tiny dummy-weight Llama the CPU pair serves (no download: ``--load-format dummy``).

head_dim 32 keeps vLLM's CPU attention backend happy (README, "Set up and run"); two layers and
a hidden size of 64 make a forward pass take milliseconds. The KV cache costs
``2 (K,V) x layers x kv_heads x head_dim x 4 bytes = 1 KiB`` per token in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 16384,  # room for D's max_model_len (deploy.DECODE_MAX_MODEL_LEN)
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
VOCAB_SIZE = TINY_LLAMA_CONFIG["vocab_size"]


def write_tiny_llama(directory: str | Path) -> Path:
    """Write the tiny Llama ``config.json`` into ``directory`` (created); returns the directory.

    Idempotent: an identical existing file is left as is.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = path / "config.json"
    text = json.dumps(TINY_LLAMA_CONFIG, indent=2) + "\n"
    if not config.exists() or config.read_text() != text:
        config.write_text(text)
    return path
