"""EvoCUA's model roles as chat clients against a local server: the denoising judge (redundant steps out of
RFT's loss) and Pair II's reflection writer; strict parsing, retries, the offline fallback, and the method's
options."""
from __future__ import annotations

import numpy as np
import pytest

from fake_chat import decoded_image, fake_chat_server
from guijax.chat import ChatClient, ChatError
from guijax.evocua.chat_roles import (ChatDenoiser, ChatReflectionWriter, ChatStateAligner, parse_redundant,
                                      parse_same_state)
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


def _pointer(step: Step, at: tuple[int, int]) -> Step:
    """`step` with a mouse pointer drawn on its screen: the same state of the task, other pixels."""
    screen = step.screenshot.copy()
    screen[at] = 255
    return Step(screen, step.response, step.response_tokens, step.behaviour_logprobs, step.actions)


# FAILED as a real screen shows it: the pointer sits somewhere else at every step
FAILED_ON_A_REAL_SCREEN = _traj([_pointer(FAILED.steps[0], (0, 0)), _pointer(FAILED.steps[1], (1, 1)),
                                 _pointer(FAILED.steps[2], (2, 2))], False)
SAME = '{"same_state": true, "reason": "only the pointer moved"}'


@pytest.mark.parametrize("answer, problem", [
    ("they look alike", "not a JSON object"),
    ('{"same": true}', "with a boolean 'same_state'"),
    ('{"same_state": "yes"}', "with a boolean 'same_state'"),
])
def test_the_aligners_answer_is_read_strictly(answer, problem):
    with pytest.raises(ValueError, match=problem):
        parse_same_state(answer)
    assert parse_same_state('```json\n{"same_state": false, "reason": "a dialog is open"}\n```') is False


def test_exact_screens_find_no_forking_point_on_a_real_screen_and_the_aligner_does():
    pairs, counts = mine_pairs([REFERENCE, FAILED_ON_A_REAL_SCREEN])
    assert pairs == [] and counts["failures_with_reference"] == 1  # the pointer makes every screen differ
    with fake_chat_server([(200, "they look alike"), (200, SAME)]) as (url, req):
        aligner = ChatStateAligner(client(url), retries=1)
        pairs, _ = mine_pairs([REFERENCE, FAILED_ON_A_REAL_SCREEN], match=aligner)
    correction, reflection = pairs
    assert correction.kind == "action_correction" and len(correction.chosen.steps) == 2
    assert correction.chosen.steps[-1].actions == ["click(b)"] and correction.rejected.steps[-1].actions == ["click(z)"]
    assert reflection.kind == "reflection" and len(reflection.chosen.steps) == 3
    # step 0 (whose action agrees), t* = 1 against the reference's step 1, and Pair II's no-op: three questions,
    # the first answered twice because its first answer could not be read
    assert aligner.calls == 3 and aligner.unreadable == 0 and len(req) == 4
    text = req[0]["body"]["messages"][0]["content"][0]["text"]
    assert "Task: open the file" in text and "Screen A (the first image): an attempt then did: click(a)" in text
    a, b = _images(req[0])
    np.testing.assert_array_equal(a, FAILED_ON_A_REAL_SCREEN.steps[0].screenshot)
    np.testing.assert_array_equal(b, REFERENCE.steps[0].screenshot)


def test_the_aligner_asks_once_per_pair_of_screens_and_never_for_equal_or_differently_sized_ones():
    with fake_chat_server([(200, SAME)]) as (url, req):
        aligner = ChatStateAligner(client(url), retries=0)
        noisy, clean = FAILED_ON_A_REAL_SCREEN.steps[0], REFERENCE.steps[0]
        assert aligner("task", noisy, clean) and aligner("task", clean, noisy) and aligner("task", clean, clean)
        wide = Step.text(np.full((4, 8, 3), 1, np.uint8), "Thought: t\nAction: click(a)", ["click(a)"])
        assert not aligner("task", clean, wide)
    assert aligner.calls == 1 and len(req) == 1


def test_screens_the_aligner_cannot_judge_are_not_aligned_and_counted():
    with fake_chat_server([(200, "the same, I think")]) as (url, req):
        aligner = ChatStateAligner(client(url), retries=1)
        pairs, _ = mine_pairs([REFERENCE, FAILED_ON_A_REAL_SCREEN], match=aligner)
    # step 0 against each reference step in its window: none judged, so the rollouts part there
    assert pairs == [] and aligner.calls == 3 and aligner.unreadable == 3 and len(req) == 6


def test_the_method_builds_the_aligner_the_recipe_asks_for(tiny_config):
    from guijax.methods import get_method

    assert get_method("evocua", tiny_config("grpo_cpu")).state_aligner() is None  # exact screens by default
    with pytest.raises(ValueError, match="evocua.state_alignment is 'chat': set evocua.chat_url"):
        get_method("evocua", tiny_config("grpo_cpu", "evocua.state_alignment=chat"))
    method = get_method("evocua", tiny_config("grpo_cpu", "evocua.state_alignment=chat",
                                              "evocua.chat_url=http://x/v1", "evocua.chat_model=m"))
    aligner = method.state_aligner()
    assert isinstance(aligner, ChatStateAligner) and aligner.client.url == "http://x/v1"
