"""Recipes as stages: `run.Run` (what stages share), `stage.Stage`, the stage modules (base, expert-guided,
comparison) and `registry`, which collects them and runs a recipe's stages in order."""
