"""EvoCUA's model roles as chat clients against a local server: the denoising judge (redundant steps out of
RFT's loss) and Pair II's reflection writer; strict parsing, retries, the offline fallback, and the method's
options."""
from __future__ import annotations

import numpy as np
import pytest

from fake_chat import decoded_image, fake_chat_server
from guijax.chat import ChatClient, ChatError
from guijax.evocua.chat_roles import ChatDenoiser, ChatReflectionWriter, parse_redundant
from guijax.evocua.denoise import denoise
from guijax.evocua.step_dpo import mine_pairs
from guijax.rollout.trajectory import Status, Step, Trajectory


def _step(screen: int, action: str, thought: str = "") -> Step:
    return Step(np.full((4, 4, 3), screen, np.uint8), f"Thought: {thought or action}.\nAction: {action}",
                np.arange(3, dtype=np.int32), np.zeros(3, np.float32), [action])


def _traj(steps, success: bool, task_id: str = "t") -> Trajectory:
    return Trajectory(task_id, "open the file", steps, reward=1.0 if success else 0.0, status=Status.DONE)


WIN = _traj([_step(1, "click(a)"), _step(2, "scroll(down)"), _step(3, "click(b)"), _step(4, "finished()")], True)


def client(url: str) -> ChatClient:
    return ChatClient(url, "judge-vlm", api_key_env="")


def _images(request) -> list[np.ndarray]:
    return [decoded_image(p["image_url"]["url"]) for p in request["body"]["messages"][0]["content"]
            if p["type"] == "image_url"]


@pytest.mark.parametrize("answer, problem", [
    ("no json here", "not a JSON object"),
    ('{"steps": [1]}', "not a JSON object with a list"),
    ('{"redundant_steps": [0]}', "holds 0, not a step number from 1 to 4"),
    ('{"redundant_steps": ["2"]}', "holds '2'"),
    ('{"redundant_steps": [true]}', "holds True"),
    ('{"redundant_steps": [4]}', "the last one"),
])
def test_the_denoisers_answer_is_read_strictly(answer, problem):
    with pytest.raises(ValueError, match=problem):
        parse_redundant(answer, 4)
    assert parse_redundant('```json\n{"redundant_steps": [2, 2, 1], "reason": "r"}\n```', 4) == [0, 1]


def test_the_chat_denoiser_masks_the_steps_it_names_and_sees_every_step():
    with fake_chat_server([(200, '{"redundant_steps": [9]}'), (200, '{"redundant_steps": [2], "reason": "a detour"}')]) as (url, req):
        judge = ChatDenoiser(client(url), retries=1, screens=3)
        data = denoise([WIN], set(), judge)
    assert [r.step for r in data.refs] == [0, 2, 3] and data.masked_steps == 1 and judge.unreadable == 0
    text = req[0]["body"]["messages"][0]["content"][0]["text"]
    assert "open the file" in text and "Step 2: Thought: scroll(down). Action: scroll(down)" in text
    assert "for the last 3 steps" in text and len(req) == 2  # the first answer named no step: asked again
    shown = _images(req[1])
    assert len(shown) == 3 and [int(s[0, 0, 0]) for s in shown] == [2, 3, 4]


def test_an_unreadable_judge_keeps_every_step_and_a_dead_one_stops_the_run():
    with fake_chat_server([(200, "all of them")]) as (url, req):
        judge = ChatDenoiser(client(url), retries=1)
        data = denoise([WIN], set(), judge)
    assert [r.step for r in data.refs] == [0, 1, 2, 3] and judge.unreadable == 1 and len(req) == 2
    with fake_chat_server([(500, "down")]) as (url, _):
        with pytest.raises(ChatError, match="HTTP 500"):
            denoise([WIN], set(), ChatDenoiser(client(url), retries=0))


REFERENCE = _traj([_step(1, "click(a)"), _step(2, "click(b)", "press the button b"), _step(3, "finished()")], True)
FAILED = _traj([_step(1, "click(a)"), _step(2, "click(z)"), _step(2, "click(z)")], False)


def test_the_reflection_writer_writes_pair_twos_thought_from_the_screen_after_the_error():
    thought = "Reflection: the dialog is still closed, so clicking z did nothing. Now I will press the button b."
    with fake_chat_server([(200, "I clicked at (12, 40)."), (200, thought)]) as (url, req):
        writer = ChatReflectionWriter(client(url), retries=1)
        pairs, counts = mine_pairs([REFERENCE, FAILED], reflect=writer)
    (reflection,) = [p for p in pairs if p.kind == "reflection"]
    assert reflection.chosen.steps[-1].response == f"Thought: {thought}\nAction: click(b)"
    assert writer.fallbacks == 0 and len(req) == 2  # the first answer named coordinates: asked again
    text = req[0]["body"]["messages"][0]["content"][0]["text"]
    assert "open the file" in text and "Its previous action: click(z)" in text and "press the button b" in text
    (screen,) = _images(req[0])
    assert int(screen[0, 0, 0]) == 2  # the screen after the erring step


def test_a_reflection_no_answer_passes_falls_back_to_the_offline_template():
    with fake_chat_server([(200, "I should press b.")]) as (url, req):  # no "Reflection:" header
        writer = ChatReflectionWriter(client(url), retries=1)
        pairs, _ = mine_pairs([REFERENCE, FAILED], reflect=writer)
    (reflection,) = [p for p in pairs if p.kind == "reflection"]
    assert reflection.chosen.steps[-1].response.startswith("Thought: The screen is exactly as it was")
    assert writer.fallbacks == 1 and len(req) == 2


def test_the_method_asks_for_an_endpoint_when_the_roles_are_chat(tiny_config):
    from guijax.methods import get_method

    with pytest.raises(ValueError, match="evocua.model_roles is 'chat': set evocua.chat_url"):
        get_method("evocua", tiny_config("grpo_cpu", "evocua.model_roles=chat"))
    method = get_method("evocua", tiny_config("grpo_cpu", "evocua.model_roles=chat", "evocua.chat_url=http://x/v1",
                                              "evocua.chat_model=m"))
    judge, writer = method.chat_roles()
    assert isinstance(judge, ChatDenoiser) and isinstance(writer, ChatReflectionWriter)
    assert judge.client is writer.client and judge.client.url == "http://x/v1"
