"""Fused kernels. `token_logprobs` computes per-token log p(target) and entropy without
materialising the [tokens, vocab] logits; `naive_token_logprobs` is its plain-JAX reference.

Layout (after Levanter's fused cross-entropy): `api.py` dispatch, `xla.py` naive + chunked
pure-JAX paths, `pallas_tpu.py` Mosaic kernels, `pallas_gpu.py` Triton kernels, `_tile.py` the
per-tile online log-sum-exp math they share.
"""
from guijax.kernels.api import IMPLS, naive_token_logprobs, resolve_impl, token_logprobs

__all__ = ["IMPLS", "naive_token_logprobs", "resolve_impl", "token_logprobs"]
