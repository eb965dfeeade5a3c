"""Write the tiny random-weight Llama used for golden vLLM captures (no network, stdlib only).

    python tools/vllm_cpu/tiny_model.py DIR

writes into DIR (about 28 KB, under a second):

- ``config.json``: a 2-layer ``LlamaForCausalLM``, hidden 256, 4 heads / 2 KV heads of
  head_dim 64, intermediate 512, vocab 512, bf16. vLLM loads it with ``load_format="dummy"``,
  so there is no checkpoint: the weights are random and the output ids (often above 258)
  decode to nothing. That is expected: only the KV-cache events matter.
- ``tokenizer.json`` / ``tokenizer_config.json`` / ``special_tokens_map.json``: a byte-level BPE
  without merges: ``<unk>`` ``<s>`` ``</s>`` (ids 0, 1, 2) and the 256 byte tokens (ids 3-258,
  in GPT-2 ``bytes_to_unicode`` order), so one byte of text is one token. BOS/EOS are not added.
  The scenarios pass token ids directly, so the tokenizer is only loaded, never relied on.
- ``generation_config.json`` and a trivial ``role: content`` chat template.

See tools/vllm_cpu/README.md. Runs in any Python 3 (the scenarios import
it inside the vLLM venv).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": None,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}


def bytes_to_unicode() -> list[tuple[int, str]]:
    """GPT-2's byte -> printable character table, in its own order (printable bytes first)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [(b, chr(c)) for b, c in zip(bs, cs, strict=True)]


def tokenizer_json() -> dict:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for _, char in bytes_to_unicode():
        vocab[char] = len(vocab)
    added = [
        {
            "id": index,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def write_tiny_model(directory: str | Path) -> Path:
    """Write the model directory (idempotent) and return its path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": CONFIG,
        "generation_config.json": {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "do_sample": False,
        },
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIR")
    print(write_tiny_model(sys.argv[1]))
