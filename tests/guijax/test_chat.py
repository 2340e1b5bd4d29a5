"""The OpenAI-compatible chat client (against a local fake server) and the plan extractor built on it."""
from __future__ import annotations

import pytest

from fake_chat import fake_chat_server
from guijax.chat import ChatClient, ChatError
from guijax.plans import ChatPlanExtractor


def test_chat_client_retries_server_errors_and_names_what_failed(monkeypatch):
    with fake_chat_server([(503, "busy"), (200, "hello")]) as (url, requests):
        monkeypatch.setenv("FAKE_KEY", "sk-test")
        client = ChatClient(url, "m", api_key_env="FAKE_KEY", backoff_s=0.01)
        assert client.complete([{"role": "user", "content": "hi"}]) == "hello"
        assert len(requests) == 2 and requests[1]["auth"] == "Bearer sk-test"
    with fake_chat_server([(400, "bad model")]) as (url, requests):
        with pytest.raises(ChatError, match="HTTP 400: .*bad model"):
            ChatClient(url, "m", api_key_env="", backoff_s=0.01).complete([])
        assert len(requests) == 1  # a client error is not retried
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ChatError, match="environment variable NO_SUCH_KEY"):
        ChatClient("http://127.0.0.1:9/v1", "m", api_key_env="NO_SUCH_KEY").complete([])
    with pytest.raises(ChatError, match="after 2 attempts"):
        ChatClient("http://127.0.0.1:9/v1", "m", api_key_env="", http_retries=1, backoff_s=0.01).complete([])


def test_chat_plan_extractor_reads_a_numbered_plan_through_the_client():
    from envs.desk.expert import ExpertTrace

    trace = ExpertTrace(task_id="t", instruction="Turn on Wi-Fi.", plan=[], steps=[], reward=1.0)
    with fake_chat_server([(200, "Task: Wi-Fi\n1. Open Settings\n2. Turn on Wi-Fi")]) as (url, requests):
        assert ChatPlanExtractor(url, "m", api_key_env="")(trace) == ["Open Settings", "Turn on Wi-Fi"]
    assert requests[0]["body"]["messages"][0]["content"].startswith("You are an expert at converting")


@pytest.mark.hostile
def test_a_json_answer_nested_too_deep_is_unreadable_not_a_crash():
    """The skill extractor, the SGCD judge and the task architect ask again on a ValueError; a RecursionError
    from the JSON decoder would have ended the run."""
    from guijax.chat import json_reply
    from guijax.sgcd.judge import parse_verdict
    from guijax.sgcd.skills import SkillFormatError, parse_skill

    deep = "[" * 100000 + "]" * 100000
    for text in (deep, f"```json\n{deep}\n```"):
        with pytest.raises(ValueError, match="nested too deeply"):
            json_reply(text)
    with pytest.raises(SkillFormatError, match="not JSON"):
        parse_skill(deep)
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_verdict(deep)
    assert json_reply('```json\n{"accept": true}\n```') == {"accept": True}
