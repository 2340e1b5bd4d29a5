"""The World State Model's training config: LoRA of the configured rank on the decoder, or, at rank 0, every
parameter (embeddings included) for a small model whose output vocabulary never held a judgment."""
from __future__ import annotations

import pytest

from guijax.models.lora import from_run_config
from guijax.models.trained import TrainedPart
from guijax.seagent.judge_training import judge_config


@pytest.mark.parametrize("rank", [128, 0])
def test_the_judge_trains_lora_of_its_rank_or_every_parameter(tiny_config, rank):
    config = tiny_config("seagent_cpu", f"seagent.judge_lora_rank={rank}", "seagent.judge_max_new_tokens=300",
                         "seagent.judge_length_buckets=(512, 1024)", "lora.rank=0")
    cfg = judge_config(config)
    lora = from_run_config(cfg)
    assert cfg.rollout.max_new_tokens == 300 and tuple(cfg.pipeline.length_buckets) == (512, 1024)
    assert tuple(cfg.model.frozen) == ()
    part = TrainedPart(lora, tuple(cfg.model.frozen))
    params = {"embed_tokens": 1.0, "visual": {"patch": 2.0},
              "layers": {"q_proj": {"kernel": 3.0, "lora_a": 4.0, "lora_b": 5.0}}}
    trained, frozen = part.partition(params)
    if rank:
        assert lora.rank == rank and lora.alpha == config.seagent.judge_lora_alpha
        assert trained == {"layers": {"q_proj": {"lora_a": 4.0, "lora_b": 5.0}}}
        assert "embed_tokens" in frozen
    else:
        assert lora is None and part.everything and trained == params and frozen == {}
