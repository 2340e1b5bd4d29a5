"""Fixtures shared by the pipeline and response-only tests: a locally trained tokenizer's processor and the
tiny preset with that tokenizer's special-token ids."""
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
