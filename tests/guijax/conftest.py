"""Fixtures shared by the tests: a locally trained tokenizer's processor, the tiny preset with that
tokenizer's special-token ids, and the one tiny recipe every end-to-end test starts from."""
import pytest

from guijax.models.config import PRESETS
from guijax.models.processor import Processor
from guijax.models.tokenizer import agent_corpus, build_tokenizer, special_token_ids
from tiny_recipe import TINY  # tests/support


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=512, corpus=agent_corpus(300))
    return Processor.from_pretrained(path)


@pytest.fixture(scope="module")
def cfg(proc):
    return PRESETS["tiny"].replace(**special_token_ids(proc.tokenizer))


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
