"""A tiny Qwen3-architecture model directory built locally (no hub): the embedded default.

A byte-level BPE tokenizer trained on local text, regen's Qwen3-style chat template, a Qwen3
config and random weights. It is what the demo stages and serves with the simulator, and what the
audit tokenizes with; it is small enough to build in seconds on a CPU.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from regen.engines.simulator.text import ANSWER_WORDS, REASONING_WORDS
from regen.paths import DEMO_PROMPTS, PACKAGE_DIR

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TEMPLATE_PATH = PACKAGE_DIR / "templates" / "qwen3_style.jinja"


def qwen3_config(vocab_size: int, hidden: int = 64, layers: int = 2, head_dim: int = 64,
                 context: int = 8192) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": 2,
        "attention_bias": False,
        "use_cache": True,
    }


def random_weights(cfg: dict, seed: int = 0) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(cfg["vocab_size"], h),
               "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(nq * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nq * hd),
            p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
            p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        })
    return tensors


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def default_corpus() -> list[str]:
    lines = [" ".join(REASONING_WORDS), " ".join(ANSWER_WORDS), "OK. Okay, let me think."]
    if DEMO_PROMPTS.exists():
        lines.extend(DEMO_PROMPTS.read_text().splitlines())
    return lines


def build_tiny_model(out_dir: str | Path, corpus: Iterable[str] | None = None,
                     context: int = 8192, force: bool = False) -> Path:
    """Write the model directory atomically; an existing complete one is kept unless ``force``."""
    from safetensors.numpy import save_file
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = train_tokenizer(corpus if corpus is not None else default_corpus())
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            model_max_length=context,
        )
        fast.chat_template = TEMPLATE_PATH.read_text()
        fast.save_pretrained(str(tmp))
        cfg = qwen3_config(vocab_size=tok.get_vocab_size(), context=context)
        cfg["eos_token_id"] = tok.token_to_id("<|im_end|>")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": cfg["eos_token_id"], "temperature": 0.6, "top_p": 0.95, "top_k": 20},
            indent=2))
        save_file(random_weights(cfg), str(tmp / "model.safetensors"))
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
