"""regen: regenerate LLM training datasets with the target model, safely and resumably.

One module per stage (config, prompts, chat, stage, servers, sim, preflight, canary, generate,
audit, progress); `regen.cli` puts a command line over the same functions the DAG calls.
"""

__version__ = "0.1.0"

import os as _os

# regen only ever reads local model directories: never let transformers reach for a hub, and keep
# its advisory banner (no PyTorch: fine, regen needs only tokenizers) out of task logs.
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
