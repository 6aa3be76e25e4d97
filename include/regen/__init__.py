"""regen: regenerate LLM training datasets with the target model, safely and resumably.

One module (or package) per stage, named in regen.stages: preflight, weights, servers, canary,
generate, audit, status. regen.pipeline is the one seam every caller goes through (the DAG's
tasks, `regen.cli`); the module map (docs/architecture.md) places every module in its layer.
"""

__version__ = "0.1.0"

import os as _os

# regen only ever reads local model directories: never let transformers reach for a hub, and keep
# its advisory banner (no PyTorch: fine, regen needs only tokenizers) out of task logs.
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
