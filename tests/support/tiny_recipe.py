"""The recipe overrides the end-to-end tests share (the tiny fixtures in tests/guijax/conftest.py, and the
benchmark smoke tests that run a recipe)."""

# The tiny recipe every end-to-end test starts from: the tiny preset on a 4-task desk, 2-step episodes,
# one RL iteration of 2 tasks x 2 episodes. Tests add their own overrides on top.
TINY = ("model.preset=tiny", "model.tokenizer_vocab=1024", "model.image_max_pixels=12544",
        "env.families=('click_button', 'toggle_checkbox')", "env.num_tasks=4", "env.num_workers=4",
        "env.step_limit=2", "env.popups=False", "rollout.prompt=compact", "rollout.max_images=1",
        "rollout.group_size=2", "rollout.tasks_per_iteration=2", "rollout.max_new_tokens=16",
        "pipeline.length_buckets=(192, 256, 384)", "pipeline.patch_bucket=64", "train.iterations=1",
        "sft.steps=2", "sft.batch_size=4", "eval.episodes_per_task=1")
