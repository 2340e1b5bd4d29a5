"""Fixtures shared by the tests: a locally trained tokenizer's processor, the tiny preset with that
tokenizer's special-token ids, and the one tiny recipe every end-to-end test starts from."""
import pytest

from guijax.models.config import PRESETS
from guijax.models.processor import Processor
from guijax.models.tokenizer import agent_corpus, build_tokenizer, special_token_ids


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=512, corpus=agent_corpus(300))
    return Processor.from_pretrained(path)


@pytest.fixture(scope="module")
def cfg(proc):
    return PRESETS["tiny"].replace(**special_token_ids(proc.tokenizer))


# The tiny recipe every end-to-end test starts from: the tiny preset on a 4-task desk, 2-step episodes,
# one RL iteration of 2 tasks x 2 episodes. Tests add their own overrides on top.
TINY = ("model.preset=tiny", "model.tokenizer_vocab=1024", "model.image_max_pixels=12544",
        "env.families=('click_button', 'toggle_checkbox')", "env.num_tasks=4", "env.num_workers=4",
        "env.step_limit=2", "env.popups=False", "rollout.prompt=compact", "rollout.max_images=1",
        "rollout.group_size=2", "rollout.tasks_per_iteration=2", "rollout.max_new_tokens=16",
        "pipeline.length_buckets=(192, 256, 384)", "pipeline.patch_bucket=64", "train.iterations=1",
        "sft.steps=2", "sft.batch_size=4", "eval.episodes_per_task=1")


@pytest.fixture(scope="session")
def tiny_config():
    """`tiny_config(recipe, *overrides)`: a recipe resolved at the tiny size, with the test's overrides."""
    from guijax import launch

    def make(recipe: str = "grpo_cpu", *overrides: str):
        return launch.resolve(recipe, [*TINY, *overrides])

    return make


@pytest.fixture(scope="session")
def tiny_flags():
    """The same tiny recipe as `--config.KEY=VALUE` flags, for tests that launch a subprocess."""
    return [f"--config.{o}" for o in TINY]
