"""guijax: a JAX/Flax trainer for end-to-end GUI computer-use agents."""
import os as _os

# guijax uses transformers for tokenizers, configs and chat templates only; without this, importing it on a
# machine without PyTorch prints advice that "models won't be available", which does not apply here.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
